"""The test kit (``idempotency_django.testing``): each helper passes for a protected view
(a plain view and a DRF viewset) and fails, saying why, for a view that is not protected
or is protected wrongly."""

from __future__ import annotations

import json
import threading
import unittest
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any
from unittest import mock

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.http import HttpResponse, HttpResponseBase, StreamingHttpResponse
from django.test import Client, TestCase, TransactionTestCase, override_settings
from rest_framework.test import APIClient

from idempotency_django.testing import (
    IdempotencyCheck,
    assert_rejects_changed_body,
    assert_releases_on_failure,
    assert_replays,
    assert_single_flight,
)
from tests import records
from tests.models import SideEffect
from tests.project import kit_views
from tests.project.factories import UserFactory

pytest_plugins = ["idempotency_django.testing"]
pytestmark = pytest.mark.urls("tests.project.kit_urls")

PLAIN = "/kit/charges/"
DRF = "/kit/drf/mixin/"  # IdempotentMixin
DRF_ACTION = "/kit/drf/charges/"  # one action protected with @idempotent
PROTECTED = [PLAIN, DRF, DRF_ACTION]
UNPROTECTED = ["/kit/unprotected/", "/kit/drf/unprotected/"]
BODY = {"amount": 100}
AS_ALICE = {"X-User": "alice"}


def runs() -> int:
    """The side effects of the kit views: one row per run of a view body."""
    return SideEffect.objects.count()


def provider_down() -> AbstractContextManager[Any]:
    """The provider is unreachable: the views answer 503."""
    return mock.patch.object(
        kit_views.provider, "charge", side_effect=kit_views.ProviderUnavailable
    )


def provider_crashes() -> AbstractContextManager[Any]:
    """The provider call raises something the views don't handle: the view raises."""
    return mock.patch.object(kit_views.provider, "charge", side_effect=RuntimeError("boom"))


@pytest.fixture(
    params=[
        pytest.param("in a test transaction", marks=pytest.mark.django_db),
        pytest.param("committing", marks=pytest.mark.django_db(transaction=True)),
    ]
)
def either_db(request: pytest.FixtureRequest) -> User:
    """Alice, in a test transaction (where a commit-mode view runs in atomic mode) or in a
    transactional test database (where it commits its claim first, as in production)."""
    assert connection.in_atomic_block == (request.param == "in a test transaction")
    return UserFactory(username="alice")


@pytest.fixture(autouse=True)
def _reset_kit_views() -> Iterator[None]:
    kit_views.provider.calls.clear()
    kit_views.seen_keys.clear()
    yield
    kit_views.seen_keys.clear()


# --- assert_replays ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", PROTECTED)
def test_replays_passes_for_a_protected_view(client: Client, either_db: User, path: str) -> None:
    first, second = assert_replays(client, path, BODY, side_effects=runs, headers=AS_ALICE)

    assert first.status_code == 201
    assert "Idempotent-Replayed" not in first.headers
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.content == first.content  # type: ignore[attr-defined]
    assert runs() == 1


@pytest.mark.parametrize("path", UNPROTECTED)
def test_replays_fails_for_an_unprotected_view(client: Client, alice: User, path: str) -> None:
    with pytest.raises(AssertionError, match=r"ran again for the same Idempotency-Key.*1 -> 2"):
        assert_replays(client, path, BODY, side_effects=runs, headers=AS_ALICE)


def test_replays_fails_for_a_duplicate_answered_differently(client: Client, alice: User) -> None:
    with pytest.raises(AssertionError, match="The replay differs from the first response"):
        assert_replays(client, "/kit/naive-dedupe/", BODY, side_effects=runs, headers=AS_ALICE)


def test_replays_fails_when_side_effects_count_nothing(client: Client, alice: User) -> None:
    with pytest.raises(AssertionError, match=r"side_effects\(\) went 0 -> 0"):
        assert_replays(client, PLAIN, BODY, side_effects=lambda: 0, headers=AS_ALICE)


def test_replays_fails_when_the_request_never_reaches_the_view(client: Client, db: None) -> None:
    # No user: the key is refused (403) before the view runs.
    with pytest.raises(AssertionError, match="403"):
        assert_replays(client, PLAIN, BODY, side_effects=runs)


def test_replays_counts_several_side_effects_per_run(client: Client, alice: User) -> None:
    def doubled() -> int:
        return 2 * runs()

    with pytest.raises(AssertionError, match="runs_per_request"):
        assert_replays(client, PLAIN, BODY, side_effects=doubled, headers=AS_ALICE)
    assert_replays(client, PLAIN, BODY, side_effects=doubled, headers=AS_ALICE, runs_per_request=2)


def test_replays_sends_the_key_it_is_given(client: Client, alice: User) -> None:
    assert_replays(client, PLAIN, BODY, side_effects=runs, headers=AS_ALICE, key="order-42")

    assert records.get().key == "order-42"


@override_settings(IDEMPOTENCY={"HEADER": "X-Request-Key", "REPLAY_HEADER": "X-Replayed"})
def test_replays_follows_the_header_settings(client: Client, alice: User) -> None:
    _, second = assert_replays(client, PLAIN, BODY, side_effects=runs, headers=AS_ALICE)

    assert second.headers["X-Replayed"] == "true"


# --- assert_rejects_changed_body --------------------------------------------------------------


@pytest.mark.parametrize("path", PROTECTED)
def test_rejects_changed_body_passes_for_a_protected_view(
    client: Client, either_db: User, path: str
) -> None:
    refused = assert_rejects_changed_body(
        client, path, BODY, {"amount": 200}, side_effects=runs, headers=AS_ALICE
    )

    assert refused.status_code == 422
    assert runs() == 1


@pytest.mark.parametrize("path", UNPROTECTED)
def test_rejects_changed_body_fails_for_an_unprotected_view(
    client: Client, alice: User, path: str
) -> None:
    with pytest.raises(AssertionError, match="should be refused with 422, but was answered 201"):
        assert_rejects_changed_body(client, path, BODY, {"amount": 200}, headers=AS_ALICE)


def test_rejects_changed_body_fails_when_the_fingerprint_ignores_the_body(
    client: Client, alice: User
) -> None:
    with pytest.raises(AssertionError, match="answered 201"):
        assert_rejects_changed_body(
            client, "/kit/ignores-body/", BODY, {"amount": 200}, headers=AS_ALICE
        )


def test_rejects_changed_body_fails_for_a_422_from_the_view_itself(
    client: Client, alice: User
) -> None:
    with pytest.raises(AssertionError, match="not the key-mismatch problem"):
        assert_rejects_changed_body(
            client, "/kit/validating/", BODY, {"amount": 5000}, headers=AS_ALICE
        )
    # problem_type=None checks the status only, and then cannot tell.
    assert_rejects_changed_body(
        client, "/kit/validating/", BODY, {"amount": 5000}, headers=AS_ALICE, problem_type=None
    )


def test_rejects_changed_body_needs_a_changed_body(client: Client) -> None:
    with pytest.raises(ValueError, match="differs"):
        assert_rejects_changed_body(client, PLAIN, BODY, dict(BODY))


# --- assert_releases_on_failure ---------------------------------------------------------------


@pytest.mark.parametrize("path", PROTECTED)
@pytest.mark.parametrize("failing", [provider_down, provider_crashes])
def test_releases_on_failure_passes_for_a_protected_view(
    client: Client, either_db: User, path: str, failing: Callable[[], AbstractContextManager[Any]]
) -> None:
    failure, retry = assert_releases_on_failure(
        client, path, BODY, side_effects=runs, failing=failing, headers=AS_ALICE
    )

    if failing is provider_down:
        assert not isinstance(failure, Exception)
        assert failure.status_code == 503
    else:
        assert isinstance(failure, RuntimeError)
    assert retry.status_code == 201
    assert runs() == 1


@pytest.mark.parametrize("path", UNPROTECTED)
def test_releases_on_failure_fails_for_an_unprotected_view(
    client: Client, alice: User, path: str
) -> None:
    with pytest.raises(AssertionError, match="does not honour the Idempotency-Key"):
        assert_releases_on_failure(
            client, path, BODY, side_effects=runs, failing=provider_down, headers=AS_ALICE
        )


def test_releases_on_failure_fails_when_the_failure_is_stored(client: Client, alice: User) -> None:
    with pytest.raises(AssertionError, match="got the failure replayed"):
        assert_releases_on_failure(
            client,
            "/kit/stores-failures/",
            BODY,
            side_effects=runs,
            failing=provider_down,
            headers=AS_ALICE,
        )


@pytest.mark.django_db(transaction=True)
def test_releases_on_failure_fails_when_the_key_stays_in_progress(client: Client) -> None:
    # A release that never happens (as if the worker had lost its database connection);
    # commit mode, as in production: in a test transaction a failure rolls the claim back.
    UserFactory(username="alice")
    with (
        mock.patch("idempotency_django.core.shell.release"),
        pytest.raises(AssertionError, match="refused with 409"),
    ):
        assert_releases_on_failure(
            client, PLAIN, BODY, side_effects=runs, failing=provider_down, headers=AS_ALICE
        )


def test_releases_on_failure_needs_a_failure(client: Client, alice: User) -> None:
    with pytest.raises(AssertionError, match="did not fail under `failing`"):
        assert_releases_on_failure(
            client, PLAIN, BODY, side_effects=runs, failing=nullcontext, headers=AS_ALICE
        )


# --- assert_single_flight ---------------------------------------------------------------------


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", PROTECTED)
def test_single_flight_passes_for_a_protected_view(client: Client, path: str) -> None:
    UserFactory(username="alice")

    responses = assert_single_flight(client, path, BODY, side_effects=runs, headers=AS_ALICE)

    assert len(responses) == 8
    assert runs() == 1
    ran = [r for r in responses if r.status_code == 201 and "Idempotent-Replayed" not in r]
    assert len(ran) == 1


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", UNPROTECTED)
def test_single_flight_fails_for_an_unprotected_view(client: Client, path: str) -> None:
    UserFactory(username="alice")

    with pytest.raises(AssertionError, match="made 8 side effect"):
        assert_single_flight(client, path, BODY, side_effects=runs, headers=AS_ALICE)


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_single_flight_takes_a_client_factory() -> None:
    user = UserFactory(username="alice")

    def logged_in() -> APIClient:
        api = APIClient()
        api.force_authenticate(user)
        return api

    # force_authenticate reaches DRF's authentication, which the viewset's action runs after.
    assert_single_flight(logged_in, DRF, BODY, side_effects=runs, requests=4)
    assert runs() == 1


def test_single_flight_refuses_a_test_inside_a_transaction(client: Client, alice: User) -> None:
    with pytest.raises(RuntimeError, match=r"transactional test database.*transaction=True"):
        assert_single_flight(client, PLAIN, BODY, side_effects=runs, headers=AS_ALICE)
    assert runs() == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "sqlite", reason="in-memory SQLite only")
def test_single_flight_skips_on_in_memory_sqlite(client: Client) -> None:
    with pytest.raises(unittest.SkipTest, match="database table is locked"):
        assert_single_flight(client, PLAIN, BODY, side_effects=runs, headers=AS_ALICE)


def test_single_flight_needs_two_requests(client: Client) -> None:
    with pytest.raises(ValueError, match="at least 2"):
        assert_single_flight(client, PLAIN, BODY, side_effects=runs, requests=1)


# --- the pytest fixtures: the docs' examples (docs/testing.md includes them) -----------------


def test_idempotency_check_fixture_on_a_plain_view(
    idempotency_check: Callable[..., IdempotencyCheck], alice: User
) -> None:
    charges = idempotency_check(
        PLAIN,
        {"amount": 100},
        side_effects=runs,
        headers=AS_ALICE,
    )

    charges.assert_replays()
    charges.assert_rejects_changed_body({"amount": 200})
    charges.assert_releases_on_failure(provider_down)


def test_idempotency_check_fixture_on_a_drf_viewset(
    idempotency_check: Callable[..., IdempotencyCheck], alice: User
) -> None:
    api = APIClient()
    api.force_authenticate(alice)
    charges = idempotency_check(DRF, {"amount": 100}, side_effects=runs, client=api)

    charges.assert_replays()
    charges.assert_rejects_changed_body({"amount": 200})
    charges.assert_releases_on_failure(provider_crashes)


def test_idempotency_check_fixture_fails_for_an_unprotected_view(
    idempotency_check: Callable[..., IdempotencyCheck], alice: User
) -> None:
    charges = idempotency_check(UNPROTECTED[0], BODY, side_effects=runs, headers=AS_ALICE)

    with pytest.raises(AssertionError):
        charges.assert_replays()
    with pytest.raises(AssertionError):
        charges.assert_rejects_changed_body({"amount": 200})
    with pytest.raises(AssertionError):
        charges.assert_releases_on_failure(provider_down)


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_idempotency_check_fixture_single_flight(
    idempotency_check: Callable[..., IdempotencyCheck],
) -> None:
    UserFactory(username="alice")
    charges = idempotency_check(DRF, BODY, side_effects=runs, headers=AS_ALICE)

    charges.assert_single_flight(requests=6)
    assert runs() == 1
    with pytest.raises(AssertionError, match="made 6 side effect"):
        idempotency_check(
            UNPROTECTED[1], BODY, side_effects=runs, headers=AS_ALICE
        ).assert_single_flight(requests=6)


def test_idempotency_key_fixture_is_fresh(idempotency_key: str) -> None:
    assert idempotency_key.startswith("idempotency-test-")
    assert len(idempotency_key) <= 255


# --- from a TestCase ------------------------------------------------------------------------


@override_settings(ROOT_URLCONF="tests.project.kit_urls")
class KitInATestCase(TestCase):
    """The plain functions in a ``TestCase`` (which runs every test in a transaction)."""

    def setUp(self) -> None:
        self.user = UserFactory(username="alice")
        self.client.defaults.update({"HTTP_X_USER": "alice"})

    def test_replays(self) -> None:
        assert_replays(self.client, PLAIN, BODY, side_effects=runs)

    def test_rejects_changed_body(self) -> None:
        assert_rejects_changed_body(
            self.client,
            PLAIN,
            BODY,
            {"amount": 7},
            side_effects=runs,
        )

    def test_releases_on_failure(self) -> None:
        assert_releases_on_failure(
            self.client, PLAIN, BODY, side_effects=runs, failing=provider_down
        )

    def test_an_unprotected_view_fails(self) -> None:
        with pytest.raises(AssertionError):
            assert_replays(self.client, UNPROTECTED[0], BODY, side_effects=runs)


@pytest.mark.concurrency
@override_settings(ROOT_URLCONF="tests.project.kit_urls")
class KitInATransactionTestCase(TransactionTestCase):
    def test_single_flight(self) -> None:
        UserFactory(username="alice")
        assert_single_flight(Client, PLAIN, BODY, side_effects=runs, headers=AS_ALICE)


# --- every way a view can fail an assertion, with a scripted client ---------------------------


class Scripted(Client):
    """A test client answering from a script instead of a view: each step is a response (or
    an exception the client raises) and the side effects the "view" made for it."""

    def __init__(self, *steps: tuple[HttpResponseBase | Exception, int]) -> None:
        super().__init__()
        self.steps = list(steps)
        self.effects: list[int] = []  # shared with the per-thread copies of the client
        self.sent: list[tuple[str, Any, str, dict[str, Any]]] = []
        self.lock = threading.Lock()
        self.hold = threading.Event()
        self.hold.set()

    def generic(  # type: ignore[override]
        self, method: str, path: str, data: Any = "", content_type: str = "", **extra: Any
    ) -> HttpResponseBase:
        self.hold.wait(30)
        with self.lock:
            self.sent.append((method, data, content_type, extra))
            outcome, effects = self.steps.pop(0)
            self.effects.append(effects)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def count(self) -> int:
        return sum(self.effects)


def answer(status: int = 201, body: bytes = b'{"id": 1}', *, replayed: bool = False) -> Any:
    response = HttpResponse(body, status=status, content_type="application/json")
    if replayed:
        response["Idempotent-Replayed"] = "true"
    return response


def problem(status: int, slug: str, **headers: str) -> HttpResponse:
    body = json.dumps({"type": f"urn:idempotency-django:problem:{slug}", "status": status})
    response = HttpResponse(body, status=status, content_type="application/problem+json")
    for name, value in headers.items():
        response[name] = value
    return response


def test_scripted_a_first_answer_marked_as_a_replay() -> None:
    client = Scripted((answer(replayed=True), 1))
    with pytest.raises(AssertionError, match="first request with a new Idempotency-Key was"):
        assert_replays(client, PLAIN, BODY, side_effects=client.count)


def test_scripted_a_retry_not_marked_as_a_replay() -> None:
    client = Scripted((answer(), 1), (answer(), 0))
    with pytest.raises(AssertionError, match="not marked as a replay"):
        assert_replays(client, PLAIN, BODY, side_effects=client.count)


def test_scripted_a_replay_with_another_status() -> None:
    client = Scripted((answer(201), 1), (answer(200, replayed=True), 0))
    with pytest.raises(AssertionError, match="replay differs"):
        assert_replays(client, PLAIN, BODY, side_effects=client.count)


def test_scripted_a_streamed_response_is_compared_by_its_bytes() -> None:
    def streamed(replayed: bool = False) -> StreamingHttpResponse:
        response = StreamingHttpResponse(iter([b'{"id":', b" 1}"]), status=201)
        if replayed:
            response["Idempotent-Replayed"] = "true"
        return response

    client = Scripted((streamed(), 1), (streamed(replayed=True), 0))
    assert_replays(client, PLAIN, BODY, side_effects=client.count)


def test_scripted_a_422_marked_as_a_replay() -> None:
    client = Scripted((answer(), 1), (problem(422, "key-mismatch"), 0))
    client.steps[1][0]["Idempotent-Replayed"] = "true"  # type: ignore[index]
    with pytest.raises(AssertionError, match="422 was marked as a replay"):
        assert_rejects_changed_body(client, PLAIN, BODY, {"amount": 2}, side_effects=client.count)


def test_scripted_a_422_after_running_the_view() -> None:
    client = Scripted((answer(), 1), (problem(422, "key-mismatch"), 1))
    with pytest.raises(AssertionError, match="changed request ran the view"):
        assert_rejects_changed_body(client, PLAIN, BODY, {"amount": 2}, side_effects=client.count)


def test_scripted_a_422_whose_problem_body_is_not_json() -> None:
    broken = HttpResponse(b"{oops", status=422, content_type="application/problem+json")
    client = Scripted((answer(), 1), (broken, 0))
    with pytest.raises(AssertionError, match="type None"):
        assert_rejects_changed_body(client, PLAIN, BODY, {"amount": 2})


def test_scripted_the_key_check_follows_problem_type_base() -> None:
    base = "https://api.example/problems/"
    body = json.dumps({"type": f"{base}key-mismatch"})
    mismatch = HttpResponse(body, status=422, content_type="application/problem+json")
    client = Scripted((answer(), 1), (mismatch, 0))
    with override_settings(IDEMPOTENCY={"PROBLEM_TYPE_BASE": base}):
        assert_rejects_changed_body(client, PLAIN, BODY, {"amount": 2})


def test_scripted_a_failure_replayed_after_an_exception() -> None:
    client = Scripted((RuntimeError("boom"), 0), (answer(500, replayed=True), 0))
    with pytest.raises(AssertionError, match=r"failure replayed(.|\n)*raised RuntimeError"):
        assert_releases_on_failure(
            client, PLAIN, BODY, side_effects=client.count, failing=nullcontext
        )


def test_scripted_a_retry_after_a_failure_that_runs_nothing() -> None:
    client = Scripted((answer(503), 0), (answer(201), 0))
    with pytest.raises(AssertionError, match="did not run the view once"):
        assert_releases_on_failure(
            client, PLAIN, BODY, side_effects=client.count, failing=nullcontext
        )


def test_scripted_a_retry_that_fails_as_well() -> None:
    client = Scripted((answer(503), 0), (answer(503), 1))
    with pytest.raises(AssertionError, match="retry failed as well"):
        assert_releases_on_failure(
            client, PLAIN, BODY, side_effects=client.count, failing=nullcontext
        )


@pytest.mark.parametrize(
    ("data", "content_type", "sent"),
    [
        (None, "application/json", b""),
        (b"\x00raw", "application/octet-stream", b"\x00raw"),
        ("<x/>", "application/xml", b"<x/>"),
        ({"a": ["1", "2"]}, "application/x-www-form-urlencoded", b"a=1&a=2"),
        ([1, 2], "application/json", b"[1, 2]"),
    ],
)
def test_scripted_bodies_and_headers_as_sent(data: Any, content_type: str, sent: bytes) -> None:
    client = Scripted((answer(), 1), (answer(replayed=True), 0))

    assert_replays(
        client,
        "/x/",
        data,
        side_effects=client.count,
        content_type=content_type,
        method="patch",
        headers={"X-Trace-Id": "t1"},
        key="k1",
    )

    method, body, kind, extra = client.sent[0]
    assert (method, body, kind) == ("PATCH", sent, content_type)
    assert extra == {"HTTP_X_TRACE_ID": "t1", "HTTP_IDEMPOTENCY_KEY": "k1"}
    assert client.sent[1] == client.sent[0]


# Scripted, concurrent: no database is touched, but the helper refuses in-memory SQLite.


def test_scripted_concurrent_requests_that_raise() -> None:
    client = Scripted((answer(), 1), *[(RuntimeError("boom"), 0)] * 3)
    with pytest.raises(AssertionError, match=r"3 of 4 concurrent requests raised"):
        assert_single_flight(client, PLAIN, BODY, side_effects=client.count, requests=4)


def test_scripted_concurrent_requests_refused_by_the_store() -> None:
    unavailable = [(problem(503, "store-unavailable", **{"Retry-After": "1"}), 0)] * 2
    client = Scripted((answer(), 1), (problem(409, "in-flight"), 0), *unavailable)
    with pytest.raises(AssertionError, match="2 of 4 concurrent requests were refused"):
        assert_single_flight(client, PLAIN, BODY, side_effects=client.count, requests=4)


def test_scripted_concurrent_requests_answered_as_if_they_ran() -> None:
    client = Scripted((answer(), 1), (answer(), 0), (answer(replayed=True), 0))
    with pytest.raises(AssertionError, match="2 of 3 concurrent requests were answered as if"):
        assert_single_flight(client, PLAIN, BODY, side_effects=client.count, requests=3)


def test_scripted_concurrent_replays_that_differ() -> None:
    other = answer(201, b'{"id": 2}', replayed=True)
    client = Scripted((answer(), 1), (problem(409, "in-flight"), 0), (other, 0))
    with pytest.raises(AssertionError, match="replay that differs"):
        assert_single_flight(client, PLAIN, BODY, side_effects=client.count, requests=3)


def test_scripted_concurrent_requests_that_never_finish() -> None:
    client = Scripted(*[(answer(replayed=True), 0)] * 2)
    client.hold.clear()  # every request hangs until the test lets it go
    try:
        with pytest.raises(AssertionError, match="did not all finish"):
            assert_single_flight(
                client, PLAIN, BODY, side_effects=client.count, requests=2, timeout=0.1
            )
    finally:
        client.hold.set()
