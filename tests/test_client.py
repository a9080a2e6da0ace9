"""The retrying client (``idempotency_django.client``) against scripted transports, and the
downstream keys (``idempotency_django.downstream``), alone and from a protected view.

Time is fake: the client's ``sleep`` advances a fake ``clock``, so backoff and deadlines are
checked exactly and the tests never wait. The client against the example project served
for real, with lost responses, is in ``tests/e2e/test_client_live.py``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from typing import Any
from unittest import mock

import httpx
import pytest
from django.contrib.auth.models import User
from django.test import Client, RequestFactory, override_settings

from idempotency_django.client import (
    AsyncIdempotentClient,
    IdempotentClient,
    RetriesExhausted,
    RetryPolicy,
    is_in_flight_conflict,
    parse_retry_after,
)
from idempotency_django.downstream import downstream_key, downstream_key_for
from idempotency_django.exceptions import KeyMalformed, KeyMissing
from tests.project import kit_views

KEY = "order-42-payment"
BODY = {"amount": 1000, "currency": "eur", "card": "tok_visa"}
PROBLEM = "application/problem+json"
IN_FLIGHT_TYPE = "urn:idempotency-django:problem:in-flight"
NOT_STORED_TYPE = "urn:idempotency-django:problem:response-not-stored"

Outcome = httpx.Response | Exception | type[Exception]


def problem(status: int, kind: str, **headers: str) -> httpx.Response:
    body = {"type": kind, "title": kind, "status": status}
    return httpx.Response(
        status, headers={"Content-Type": PROBLEM, **headers}, content=json.dumps(body).encode()
    )


def created(replayed: bool = False) -> httpx.Response:
    headers = {"Idempotent-Replayed": "true"} if replayed else {}
    return httpx.Response(201, json={"id": "ch_1"}, headers=headers)


@dataclass
class FakeTime:
    """A clock that only ``sleep`` (and slow attempts) move."""

    now: float = 0.0
    sleeps: list[float] = field(default_factory=list)

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    async def async_sleep(self, seconds: float) -> None:
        self.sleep(seconds)


@dataclass
class Script:
    """A transport handler answering each request with the next outcome, recording them."""

    outcomes: list[Outcome]
    time: FakeTime
    attempt_duration: float = 0.0
    requests: list[httpx.Request] = field(default_factory=list)
    started_at: list[float] = field(default_factory=list)
    timeouts: list[dict[str, float | None]] = field(default_factory=list)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        self.started_at.append(self.time.now)
        self.timeouts.append(dict(request.extensions["timeout"]))
        self.time.now += self.attempt_duration
        assert self.outcomes, "the client sent more requests than the test scripted"
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, httpx.Response):
            return outcome
        if isinstance(outcome, type):
            outcome = outcome("scripted failure")
        if isinstance(outcome, httpx.RequestError):
            outcome.request = request
        raise outcome

    def sent_keys(self) -> list[str | None]:
        return [request.headers.get("Idempotency-Key") for request in self.requests]

    def sent_bodies(self) -> list[bytes]:
        return [request.content for request in self.requests]


@pytest.fixture
def fake_time() -> FakeTime:
    return FakeTime()


Make = Callable[..., tuple[IdempotentClient, Script]]


@pytest.fixture
def make(fake_time: FakeTime) -> Iterator[Make]:
    """An ``IdempotentClient`` over a scripted transport, on fake time, jitter fixed at 0.5."""
    clients: list[IdempotentClient] = []

    def build(
        *outcomes: Outcome,
        policy: RetryPolicy | None = None,
        jitter: Callable[[], float] = lambda: 0.5,
        attempt_duration: float = 0.0,
        **client_options: Any,
    ) -> tuple[IdempotentClient, Script]:
        script = Script(list(outcomes), fake_time, attempt_duration)
        http = httpx.Client(base_url="https://pay.test", transport=httpx.MockTransport(script))
        client = IdempotentClient(
            http,
            policy=policy,
            sleep=fake_time.sleep,
            clock=fake_time.clock,
            jitter=jitter,
            **client_options,
        )
        clients.append(client)
        return client, script

    yield build
    for client in clients:
        client.http.close()


# --- one key, one body, every attempt ---------------------------------------------------------


def test_every_attempt_sends_the_callers_key_and_the_same_body(make: Make) -> None:
    client, script = make(httpx.ConnectError, problem(503, "x"), httpx.ReadTimeout, created())

    result = client.post("/charges/", key=KEY, json=BODY)

    assert result.status_code == 201
    assert result.attempts == 4
    assert script.sent_keys() == [KEY] * 4
    assert len(set(script.sent_bodies())) == 1
    assert json.loads(script.sent_bodies()[0]) == BODY
    assert {request.method for request in script.requests} == {"POST"}


def test_a_streamed_body_is_read_once_and_sent_whole_on_every_attempt(make: Make) -> None:
    client, script = make(httpx.ConnectError, created())

    result = client.patch("/charges/1/", key=KEY, content=iter([b"part-1,", b"part-2"]))

    assert result.attempts == 2
    assert script.sent_bodies() == [b"part-1,part-2"] * 2


def test_the_key_is_the_callers_to_make(make: Make) -> None:
    client, script = make(created())

    with pytest.raises(TypeError, match="key"):
        client.post("/charges/", json=BODY)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="key="):
        client.post("/charges/", key=KEY, headers={"idempotency-key": "other"})
    assert script.requests == []


def test_a_key_with_a_space_is_sent_as_a_quoted_string_the_server_reads_back(make: Make) -> None:
    from idempotency_django.keys import parse_key

    client, script = make(created())

    client.post("/charges/", key="two words", json=BODY)

    sent = script.requests[0].headers["Idempotency-Key"]
    assert sent == '"two words"'
    assert parse_key(sent) == "two words"


@pytest.mark.parametrize("key", ["", "   ", "k" * 256, "clé", "tab\there", "a,b"])
def test_a_key_the_server_would_refuse_is_refused_before_sending(make: Make, key: str) -> None:
    client, script = make(created())

    with pytest.raises(ValueError, match="Idempotency-Key"):
        client.post("/charges/", key=key, json=BODY)
    assert script.requests == []


def test_other_headers_are_sent_along(make: Make) -> None:
    client, script = make(created())

    client.post("/charges/", key=KEY, json=BODY, headers={"X-Trace-Id": "t1"})

    assert script.requests[0].headers["X-Trace-Id"] == "t1"
    assert script.requests[0].headers["Idempotency-Key"] == KEY


def test_the_header_names_are_configurable(make: Make) -> None:
    replay = httpx.Response(201, json={}, headers={"X-Replayed": "true"})
    client, script = make(replay, header="X-Request-Key", replay_header="X-Replayed")

    result = client.put("/charges/1/", key=KEY, json=BODY)

    assert script.requests[0].headers["X-Request-Key"] == KEY
    assert "Idempotency-Key" not in script.requests[0].headers
    assert result.replayed


# --- what is retried --------------------------------------------------------------------------


RETRYABLE: list[Outcome] = [
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.ReadTimeout,
    httpx.WriteTimeout,
    httpx.PoolTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,  # "Server disconnected without sending a response."
    httpx.ProxyError,
    problem(409, IN_FLIGHT_TYPE, **{"Retry-After": "1"}),
    problem(409, IN_FLIGHT_TYPE),
    httpx.Response(409, headers={"Retry-After": "2"}),  # Stripe-style: key in use
    problem(429, "rate-limited"),
    httpx.Response(502),
    problem(503, "urn:idempotency-django:problem:store-unavailable", **{"Retry-After": "1"}),
    httpx.Response(504),
]


@pytest.mark.parametrize("outcome", RETRYABLE, ids=repr)
def test_an_unknown_or_retryable_outcome_is_retried(make: Make, outcome: Outcome) -> None:
    client, script = make(outcome, created(replayed=True))

    result = client.post("/charges/", key=KEY, json=BODY)

    assert result.status_code == 201
    assert result.attempts == 2
    assert result.replayed
    assert len(result.history) == 1
    assert script.sent_keys() == [KEY, KEY]


FINAL = [
    problem(400, "invalid"),
    problem(401, "unauthorized"),
    problem(402, "card-declined"),
    problem(403, "urn:idempotency-django:problem:anonymous"),
    httpx.Response(404),
    problem(409, NOT_STORED_TYPE),
    problem(409, "urn:shop:order-already-paid"),
    httpx.Response(409, text="conflict"),
    problem(413, "urn:idempotency-django:problem:body-too-large"),
    problem(422, "urn:idempotency-django:problem:key-mismatch"),
    httpx.Response(500),
    httpx.Response(200, json={}),
]


@pytest.mark.parametrize("response", FINAL, ids=lambda r: f"{r.status_code}")
def test_a_definitive_answer_is_returned_at_once(
    make: Make, fake_time: FakeTime, response: httpx.Response
) -> None:
    client, _ = make(response)

    result = client.post("/charges/", key=KEY, json=BODY)

    assert result.response is response
    assert result.attempts == 1
    assert not result.gave_up
    assert not result.replayed
    assert fake_time.sleeps == []


@pytest.mark.parametrize("error", [httpx.UnsupportedProtocol, httpx.LocalProtocolError])
def test_a_mistake_of_the_callers_is_raised_at_once(make: Make, error: type[Exception]) -> None:
    client, script = make(error)

    with pytest.raises(error):
        client.post("/charges/", key=KEY, json=BODY)
    assert len(script.requests) == 1


def test_work_not_committed_is_final_even_where_its_status_is_retried(
    make: Make, fake_time: FakeTime
) -> None:
    """The server's own word that the work failed to commit and rolled back: sending it
    again would fail the same way, whatever the policy retries."""
    failed = problem(500, "urn:idempotency-django:problem:work-not-committed")
    client, script = make(
        failed, created(), policy=RetryPolicy(retry_statuses=frozenset({500, 503}))
    )

    result = client.post("/charges/", key=KEY, json=BODY)

    assert result.response is failed
    assert result.attempts == 1
    assert len(script.requests) == 1
    assert fake_time.sleeps == []


def test_should_retry_can_be_overridden(make: Make) -> None:
    class RetryServerErrors(IdempotentClient):
        def should_retry(self, response: httpx.Response) -> bool:
            return response.status_code == 500 or super().should_retry(response)

    fake = FakeTime()
    script = Script([httpx.Response(500), created()], fake)
    client = RetryServerErrors(
        httpx.Client(transport=httpx.MockTransport(script)), sleep=fake.sleep, clock=fake.clock
    )

    assert client.post("https://pay.test/charges/", key=KEY, json=BODY).attempts == 2


def test_is_in_flight_conflict() -> None:
    assert is_in_flight_conflict(problem(409, "https://errors.example/in-flight"))
    assert is_in_flight_conflict(httpx.Response(409, headers={"Retry-After": "1"}))
    assert not is_in_flight_conflict(problem(409, NOT_STORED_TYPE))
    assert not is_in_flight_conflict(problem(503, IN_FLIGHT_TYPE))
    assert not is_in_flight_conflict(httpx.Response(409, json=["in-flight"]))
    broken = httpx.Response(409, headers={"Content-Type": PROBLEM}, content=b"{not json")
    assert not is_in_flight_conflict(broken)


# --- how long it waits ------------------------------------------------------------------------


def test_backoff_is_capped_exponential_with_full_jitter(make: Make, fake_time: FakeTime) -> None:
    jitters = iter([0.9, 0.1, 0.5, 0.99, 0.0, 0.5])
    policy = RetryPolicy(max_attempts=7, deadline=100, base_delay=0.1, max_delay=0.5)
    client, _ = make(
        *[httpx.ConnectError] * 6, created(), policy=policy, jitter=lambda: next(jitters)
    )

    result = client.post("/charges/", key=KEY, json=BODY)

    assert result.attempts == 7
    # uniform(0, min(cap, base * 2 ** n)): ceilings 0.1, 0.2, 0.4, then the cap 0.5.
    assert fake_time.sleeps == pytest.approx([0.09, 0.02, 0.2, 0.495, 0.0, 0.25])


def test_retry_after_replaces_the_backoff(make: Make, fake_time: FakeTime) -> None:
    client, _ = make(
        problem(409, IN_FLIGHT_TYPE, **{"Retry-After": "1"}),
        problem(503, "busy", **{"Retry-After": "3"}),
        httpx.Response(429, headers={"Retry-After": "0"}),
        created(replayed=True),
    )

    result = client.post("/charges/", key=KEY, json=BODY)

    assert result.attempts == 4
    assert fake_time.sleeps == [1.0, 3.0, 0.0]


def test_retry_after_as_an_http_date() -> None:
    now = datetime(2025, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
    assert parse_retry_after(format_datetime(now + timedelta(seconds=7), usegmt=True), now) == 7
    assert parse_retry_after("Wed, 01 Jan 2025 11:00:00 GMT", now) == 0
    assert parse_retry_after("Wed, 01 Jan 2025 12:00:30", now) == 30  # no zone: GMT
    assert parse_retry_after(" 12 ", now) == 12
    assert parse_retry_after("soon", now) is None
    assert parse_retry_after(None, now) is None


def test_a_retry_after_too_long_to_wait_is_handed_back(make: Make, fake_time: FakeTime) -> None:
    client, _ = make(
        problem(503, "maintenance", **{"Retry-After": "3600"}),
        policy=RetryPolicy(max_retry_after=60),
    )

    result = client.post("/charges/", key=KEY, json=BODY)

    assert result.status_code == 503
    assert result.gave_up
    assert result.attempts == 1
    assert fake_time.sleeps == []


# --- when it stops ----------------------------------------------------------------------------


def test_attempts_are_bounded_and_the_last_answer_is_handed_back(
    make: Make, fake_time: FakeTime
) -> None:
    client, script = make(*[httpx.Response(502)] * 3, policy=RetryPolicy(max_attempts=3))

    result = client.post("/charges/", key=KEY, json=BODY)

    assert result.status_code == 502
    assert result.attempts == 3
    assert result.gave_up
    assert len(result.history) == 2
    assert len(script.requests) == 3
    assert len(fake_time.sleeps) == 2


def test_no_answer_at_all_raises_retries_exhausted(make: Make) -> None:
    outcomes = [problem(503, "busy"), httpx.ConnectError, httpx.ReadTimeout]
    client, _ = make(*outcomes, policy=RetryPolicy(max_attempts=3))

    with pytest.raises(RetriesExhausted, match="outcome is unknown") as raised:
        client.post("/charges/", key=KEY, json=BODY)

    assert raised.value.key == KEY
    assert raised.value.attempts == 3
    assert isinstance(raised.value.__cause__, httpx.ReadTimeout)
    assert [type(item) for item in raised.value.history] == [
        httpx.Response,
        httpx.ConnectError,
        httpx.ReadTimeout,
    ]


def test_no_attempt_starts_after_the_deadline(make: Make, fake_time: FakeTime) -> None:
    policy = RetryPolicy(max_attempts=100, deadline=10, base_delay=1, max_delay=1)
    # Every attempt takes 3 s and fails; the backoff waits 0.5 s (jitter 0.5).
    client, script = make(*[httpx.ReadTimeout] * 100, policy=policy, attempt_duration=3.0)

    with pytest.raises(RetriesExhausted):
        client.post("/charges/", key=KEY, json=BODY)

    assert script.started_at == [0.0, 3.5, 7.0]
    assert fake_time.now < 10 + 3


def test_each_attempt_timeout_is_capped_by_the_time_left(make: Make) -> None:
    policy = RetryPolicy(deadline=8, base_delay=1, max_delay=1)
    client, script = make(httpx.ReadTimeout, created(), policy=policy, attempt_duration=5.0)
    client.timeout = httpx.Timeout(6.0, connect=2.0)

    client.post("/charges/", key=KEY, json=BODY)

    first, second = script.timeouts
    assert first == {"connect": 2.0, "read": 6.0, "write": 6.0, "pool": 6.0}
    # 5 s spent in the first attempt and 0.5 s waiting: 2.5 s left.
    assert second == {"connect": 2.0, "read": 2.5, "write": 2.5, "pool": 2.5}


def test_the_policy_is_validated() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="positive"):
        RetryPolicy(deadline=0)


# --- the client's own httpx.Client ------------------------------------------------------------


def test_without_an_httpx_client_it_makes_and_closes_its_own() -> None:
    with IdempotentClient(timeout=3) as client:
        assert client.timeout == httpx.Timeout(3)
    assert client.http.is_closed

    borrowed = httpx.Client()
    with IdempotentClient(borrowed):
        pass
    assert not borrowed.is_closed
    borrowed.close()


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_auth_is_the_httpx_clients_or_given_per_call(fake_time: FakeTime) -> None:
    script = Script([created(), created()], fake_time)
    http = httpx.Client(auth=("alice", "alice"), transport=httpx.MockTransport(script))
    with IdempotentClient(http, sleep=fake_time.sleep, clock=fake_time.clock) as client:
        client.post("https://pay.test/charges/", key=KEY, json=BODY)
        client.post("https://pay.test/charges/", key=KEY, json=BODY, auth=("bob", "bob"))
    http.close()

    sent = [request.headers["Authorization"] for request in script.requests]
    assert sent == [basic("alice", "alice"), basic("bob", "bob")]


# --- async ------------------------------------------------------------------------------------


def run_async(
    outcomes: list[Outcome],
    fake_time: FakeTime,
    policy: RetryPolicy | None = None,
    method: str = "post",
) -> tuple[Any, Script]:
    script = Script(outcomes, fake_time)

    async def main() -> Any:
        http = httpx.AsyncClient(base_url="https://pay.test", transport=httpx.MockTransport(script))
        async with AsyncIdempotentClient(
            http, policy=policy, sleep=fake_time.async_sleep, clock=fake_time.clock
        ) as client:
            try:
                return await getattr(client, method)("/charges/", key=KEY, json=BODY)
            except (RetriesExhausted, httpx.UnsupportedProtocol) as exc:
                return exc
            finally:
                await http.aclose()

    return asyncio.run(main()), script


def test_async_client_retries_with_the_same_key_and_body(fake_time: FakeTime) -> None:
    outcomes: list[Outcome] = [httpx.ConnectError, problem(409, IN_FLIGHT_TYPE), created(True)]
    result, script = run_async(outcomes, fake_time)

    assert result.status_code == 201
    assert result.replayed
    assert result.attempts == 3
    assert script.sent_keys() == [KEY] * 3
    assert len(set(script.sent_bodies())) == 1


@pytest.mark.parametrize("method", ["post", "patch", "put"])
def test_async_client_returns_a_definitive_answer_at_once(fake_time: FakeTime, method: str) -> None:
    result, script = run_async([problem(402, "card-declined")], fake_time, method=method)

    assert script.requests[0].method == method.upper()
    assert result.status_code == 402
    assert result.attempts == 1
    assert fake_time.sleeps == []


def test_async_client_raises_when_no_attempt_was_answered(fake_time: FakeTime) -> None:
    result, _ = run_async([httpx.ConnectError] * 2, fake_time, RetryPolicy(max_attempts=2))

    assert isinstance(result, RetriesExhausted)
    assert result.attempts == 2


def test_async_client_raises_a_callers_mistake_at_once(fake_time: FakeTime) -> None:
    result, script = run_async([httpx.UnsupportedProtocol], fake_time)

    assert isinstance(result, httpx.UnsupportedProtocol)
    assert len(script.requests) == 1


def test_async_client_makes_and_closes_its_own() -> None:
    async def main() -> AsyncIdempotentClient:
        async with AsyncIdempotentClient(timeout=2) as client:
            return client

    assert asyncio.run(main()).http.is_closed


# --- downstream keys --------------------------------------------------------------------------


def test_downstream_key_is_pinned() -> None:
    # A change here changes every downstream key during a deploy: retries that straddle it
    # would charge twice at the provider. Never update these values; add a new version.
    assert downstream_key("order-42", "stripe-charge") == "ccf70636-cdbe-86aa-ba67-9702821f9ab9"
    pinned = downstream_key("order-42", "stripe-charge", "7", endpoint="POST /orders/42/pay/")
    assert pinned == "306c9509-1285-8fe4-a729-d42eff022645"


def test_downstream_key_is_a_uuid_every_provider_accepts() -> None:
    value = downstream_key("k" * 255, "p" * 1000, "a" * 128, endpoint="e" * 255)

    parsed = uuid.UUID(value)
    assert str(parsed) == value
    assert parsed.version == 8
    assert parsed.variant == uuid.RFC_4122
    assert len(value) == 36


def test_downstream_key_differs_for_every_part() -> None:
    base = downstream_key("k1", "charge", "1", endpoint="POST /a")
    variants = {
        downstream_key("k2", "charge", "1", endpoint="POST /a"),
        downstream_key("k1", "refund", "1", endpoint="POST /a"),
        downstream_key("k1", "charge", "2", endpoint="POST /a"),
        downstream_key("k1", "charge", "1", endpoint="POST /b"),
        downstream_key("k1", "charge", "1"),
        downstream_key("k1", "charge", "", endpoint="POST /a"),
        downstream_key("k1", "charge", None, endpoint="POST /a"),
    }
    assert base not in variants
    assert len(variants) == 7
    # Parts are length-prefixed: moving characters from one part to the next changes it.
    assert downstream_key("ab", "c") != downstream_key("a", "bc")
    assert downstream_key("k", "ab", "c") != downstream_key("k", "a", "bc")


def test_downstream_key_needs_a_key_and_a_purpose() -> None:
    with pytest.raises(ValueError, match="Idempotency-Key"):
        downstream_key("", "charge")
    with pytest.raises(ValueError, match="purpose"):
        downstream_key("k1", "")


def test_downstream_key_for_a_request_uses_its_key_and_scope(alice: User) -> None:
    factory = RequestFactory()
    request = factory.post("/orders/", headers={"Idempotency-Key": "order-42"})
    request.user = alice
    quoted = factory.post("/orders/", headers={"Idempotency-Key": '"order-42"'})
    quoted.user = alice

    derived = downstream_key_for(request, "stripe-charge")

    assert derived == downstream_key(
        "order-42", "stripe-charge", str(alice.pk), endpoint="POST /orders/"
    )
    assert downstream_key_for(quoted, "stripe-charge") == derived
    assert downstream_key_for(request, "stripe-charge", account="x", endpoint="y") == (
        downstream_key("order-42", "stripe-charge", "x", endpoint="y")
    )


def test_downstream_key_for_a_request_without_a_valid_key(rf: RequestFactory) -> None:
    with pytest.raises(KeyMissing):
        downstream_key_for(rf.post("/orders/"), "stripe-charge")
    with pytest.raises(KeyMalformed):
        downstream_key_for(rf.post("/orders/", headers={"Idempotency-Key": "a b"}), "charge")


@override_settings(IDEMPOTENCY={"HEADER": "X-Request-Key"})
def test_downstream_key_for_follows_the_header_setting(rf: RequestFactory) -> None:
    request = rf.post("/orders/", headers={"X-Request-Key": "k1"})

    assert downstream_key_for(request, "charge", account="guest:1") == downstream_key(
        "k1", "charge", "guest:1", endpoint="POST /orders/"
    )


@pytest.fixture
def provider_calls() -> Iterator[list[tuple[int, str | None]]]:
    kit_views.provider.calls.clear()
    yield kit_views.provider.calls
    kit_views.provider.calls.clear()


@pytest.mark.urls("tests.project.kit_urls")
def test_a_retried_request_passes_the_provider_the_same_downstream_key(
    client: Client, alice: User, bob: User, provider_calls: list[tuple[int, str | None]]
) -> None:
    def charge(user: str) -> Any:
        return client.post(
            "/kit/downstream/",
            {"amount": 5},
            content_type="application/json",
            headers={"Idempotency-Key": "order-42", "X-User": user},
        )

    def provider_down(amount: int, idempotency_key: str | None = None) -> None:
        provider_calls.append((amount, idempotency_key))
        raise kit_views.ProviderUnavailable

    with mock.patch.object(kit_views.provider, "charge", side_effect=provider_down):
        assert charge("alice").status_code == 503  # not stored: the key is released
    assert charge("alice").status_code == 201  # the retry runs the view again
    assert charge("alice")["Idempotent-Replayed"] == "true"  # and then replays
    assert charge("bob").status_code == 201  # bob's order-42 is another operation

    keys = [key for _, key in provider_calls]
    assert len(keys) == 3
    assert keys[0] == keys[1]  # the retry reused alice's downstream key
    assert keys[2] != keys[0]  # bob's is his own
    assert keys[0] == downstream_key(
        "order-42", "provider-charge", str(alice.pk), endpoint="POST /kit/downstream/"
    )
