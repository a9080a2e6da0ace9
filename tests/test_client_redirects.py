"""The client keeps the key to itself: never sent to another origin on a redirect, never
written to its logs or errors as it is (``idempotency_django.client``), against scripted
transports that record what each host received."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from idempotency_django.client import (
    AsyncIdempotentClient,
    IdempotentClient,
    RetriesExhausted,
    RetryPolicy,
    hidden_key,
)

KEY = "order-1042-payment"
API = "https://pay.example"


class Hosts:
    """A transport whose hosts answer from a table of ``(host, path) -> response``; every
    request is recorded, with its headers."""

    def __init__(self, routes: dict[tuple[str, str], Callable[[], httpx.Response]]) -> None:
        self.routes = routes
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        return self.routes[(request.url.host, request.url.path)]()

    def keys_sent_to(self, host: str) -> list[str | None]:
        return [r.headers.get("Idempotency-Key") for r in self.seen if r.url.host == host]


def redirect(status: int, location: str) -> Callable[[], httpx.Response]:
    return lambda: httpx.Response(status, headers={"Location": location})


def created() -> httpx.Response:
    return httpx.Response(201, json={"id": "ch_1"})


def client(hosts: Hosts, **options: Any) -> IdempotentClient:
    http = httpx.Client(base_url=API, transport=httpx.MockTransport(hosts), follow_redirects=True)
    return IdempotentClient(http, sleep=lambda seconds: None, **options)


@pytest.mark.parametrize("status", [307, 308])
def test_a_redirect_to_another_origin_that_resends_the_body_is_not_followed(
    status: int,
) -> None:
    hosts = Hosts(
        {
            ("pay.example", "/charges/"): redirect(status, "https://elsewhere.example/steal"),
            ("elsewhere.example", "/steal"): created,
        }
    )

    result = client(hosts).post("/charges/", key=KEY, json={"amount": 1})

    assert result.status_code == status  # the redirect is the answer
    assert result.attempts == 1
    assert hosts.keys_sent_to("pay.example") == [KEY]
    assert hosts.keys_sent_to("elsewhere.example") == []  # neither the key nor the body


@pytest.mark.parametrize("status", [302, 303])
def test_a_redirect_to_another_origin_that_becomes_a_get_is_followed_without_the_key(
    status: int,
) -> None:
    hosts = Hosts(
        {
            ("pay.example", "/charges/"): redirect(status, "https://cdn.example/receipt"),
            ("cdn.example", "/receipt"): lambda: httpx.Response(200, text="receipt"),
        }
    )

    result = client(hosts).post("/charges/", key=KEY, json={"amount": 1})

    assert result.status_code == 200
    assert [r.method for r in hosts.seen] == ["POST", "GET"]
    assert hosts.keys_sent_to("cdn.example") == [None]
    assert [r.status_code for r in result.response.history] == [status]


def test_a_redirect_within_the_origin_keeps_the_key() -> None:
    hosts = Hosts(
        {
            ("pay.example", "/charges"): redirect(308, "/charges/"),
            ("pay.example", "/charges/"): created,
        }
    )

    result = client(hosts).post("/charges", key=KEY, json={"amount": 1})

    assert result.status_code == 201
    assert hosts.keys_sent_to("pay.example") == [KEY, KEY]
    assert [r.method for r in hosts.seen] == ["POST", "POST"]


def test_another_port_is_another_origin() -> None:
    hosts = Hosts(
        {
            ("pay.example", "/charges/"): redirect(307, "https://pay.example:8443/charges/"),
        }
    )

    result = client(hosts).post("/charges/", key=KEY, json={"amount": 1})

    assert result.status_code == 307
    assert len(hosts.seen) == 1


def test_credentials_are_not_sent_again_to_another_origin() -> None:
    hosts = Hosts(
        {
            ("pay.example", "/charges/"): redirect(303, "https://cdn.example/receipt"),
            ("cdn.example", "/receipt"): lambda: httpx.Response(200),
        }
    )

    client(hosts).post("/charges/", key=KEY, json={}, auth=("merchant", "secret"))

    assert "Authorization" in hosts.seen[0].headers
    assert "Authorization" not in hosts.seen[1].headers


def test_a_client_that_does_not_follow_redirects_still_does_not() -> None:
    hosts = Hosts({("pay.example", "/charges/"): redirect(308, "/charges/v2/")})
    http = httpx.Client(base_url=API, transport=httpx.MockTransport(hosts))

    result = IdempotentClient(http).post("/charges/", key=KEY, json={})

    assert result.status_code == 308
    assert len(hosts.seen) == 1


def test_redirects_are_bounded_as_httpx_bounds_them() -> None:
    hosts = Hosts({("pay.example", "/loop/"): redirect(308, "/loop/")})
    http = httpx.Client(
        base_url=API, transport=httpx.MockTransport(hosts), follow_redirects=True, max_redirects=3
    )

    with pytest.raises(httpx.TooManyRedirects):
        IdempotentClient(http).post("/loop/", key=KEY, json={})

    assert len(hosts.seen) == 4  # the request and three redirects


def test_the_async_client_keeps_the_key_to_its_origin() -> None:
    hosts = Hosts(
        {
            ("pay.example", "/charges/"): redirect(307, "https://elsewhere.example/steal"),
            ("elsewhere.example", "/steal"): created,
        }
    )

    async def send() -> Any:
        async with httpx.AsyncClient(
            base_url=API, transport=httpx.MockTransport(hosts), follow_redirects=True
        ) as http:
            return await AsyncIdempotentClient(http).post("/charges/", key=KEY, json={})

    result = asyncio.run(send())

    assert result.status_code == 307
    assert hosts.keys_sent_to("elsewhere.example") == []


# --- the client's logs and errors ---------------------------------------------------------


def failing(hosts_seen: list[httpx.Request]) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        hosts_seen.append(request)
        if len(hosts_seen) == 1:
            return httpx.Response(503, headers={"Retry-After": "0"})
        raise httpx.ConnectError("refused", request=request)

    return httpx.MockTransport(handler)


def test_the_key_is_not_logged_or_raised_as_it_is(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[httpx.Request] = []
    pay = IdempotentClient(
        httpx.Client(base_url=API, transport=failing(seen)),
        policy=RetryPolicy(max_attempts=3),
        sleep=lambda seconds: None,
    )

    with (
        caplog.at_level(logging.INFO, logger="idempotency_django.client"),
        pytest.raises(RetriesExhausted) as raised,
    ):
        pay.post("/charges/", key=KEY, json={})

    logged = [record.getMessage() for record in caplog.records]
    assert len(logged) == 2  # two retries
    assert not [line for line in logged if KEY in line]
    assert all(hidden_key(KEY) in line for line in logged)
    assert KEY not in str(raised.value)
    assert raised.value.key == KEY  # for the caller, who retries later with it
    assert seen[0].headers["Idempotency-Key"] == KEY  # the server still gets it


def test_the_hidden_key_names_one_key_one_way_and_hides_it() -> None:
    assert hidden_key(KEY) == hidden_key(KEY)
    assert hidden_key(KEY) != hidden_key(KEY + "x")
    assert hidden_key(KEY).startswith("key-hmac:")
    assert "order" not in hidden_key(KEY)


def test_a_caller_may_log_keys_as_they_are(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[httpx.Request] = []
    pay = IdempotentClient(
        httpx.Client(base_url=API, transport=failing(seen)),
        policy=RetryPolicy(max_attempts=2),
        sleep=lambda seconds: None,
        log_key=str,
    )

    with (
        caplog.at_level(logging.INFO, logger="idempotency_django.client"),
        pytest.raises(RetriesExhausted) as raised,
    ):
        pay.post("/charges/", key=KEY, json={})

    assert [record for record in caplog.records if KEY in record.getMessage()]
    assert KEY in str(raised.value)
