"""The retrying client against the example payments API under gunicorn, with faults.

A TCP proxy in front of the server loses responses *after the server committed them*: it
forwards the request, waits for the first byte of the answer (sent only once the view has
run and its outcome is stored) and then closes the client's connection, or holds the
answer until the client's read timeout fires. The client cannot know whether the charge
happened; it retries with the same key, gets the stored response replayed, and exactly one
charge exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from idempotency_django.client import (
    AsyncIdempotentClient,
    IdempotentClient,
    IdempotentResult,
    RetryPolicy,
)
from tools.server import (
    ALICE,
    HTTP_TIMEOUT_SECONDS,
    Server,
    new_amount,
)
from tools.threads import concurrently

IN_FLIGHT = "urn:idempotency-django:problem:in-flight"
# Short pauses: the scenarios are about which attempts happen, not about waiting.
QUICK = RetryPolicy(max_attempts=5, deadline=60, base_delay=0.05, max_delay=0.2)


def charge_body(card: str = "tok_visa") -> dict[str, Any]:
    return {"amount": new_amount(), "currency": "EUR", "card": card}


def _kill(sock: socket.socket) -> None:
    """Close a socket that another thread may be blocked on (``shutdown`` wakes it)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class LosingProxy:
    """A TCP proxy to ``upstream`` that loses the responses to the first ``lose`` requests.

    A lost response is one the server has started to send, so its view ran and its outcome
    was stored: the proxy then closes the client's connection without a byte (``stall``:
    holds it open, silent, until the client gives up). Later requests pass through.
    """

    def __init__(self, upstream_port: int, *, lose: int = 1, stall: bool = False) -> None:
        self._upstream = ("127.0.0.1", upstream_port)
        self._to_lose = lose
        self._stall = stall
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self.lost = 0
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._spawn(self._accept)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        _kill(self._listener)
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _kill(sock)
        for thread in self._threads:
            thread.join(HTTP_TIMEOUT_SECONDS)

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name="losing-proxy", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self._listener.accept()
            except OSError:  # closed
                return
            self._spawn(self._serve, downstream)

    def _serve(self, downstream: socket.socket) -> None:
        upstream = socket.create_connection(self._upstream, timeout=HTTP_TIMEOUT_SECONDS)
        client_gone = threading.Event()
        with self._lock:
            self._sockets += [downstream, upstream]
            self.connections += 1
        self._spawn(self._pump, downstream, upstream, client_gone)
        try:
            chunk = upstream.recv(65536)  # the server's first byte: the outcome is stored
            with self._lock:
                lose = bool(chunk) and self._to_lose > 0
                if lose:
                    self._to_lose -= 1
                    self.lost += 1
            if lose:
                if self._stall:
                    client_gone.wait(HTTP_TIMEOUT_SECONDS)
                return
            while chunk:
                downstream.sendall(chunk)
                chunk = upstream.recv(65536)
        except OSError:
            pass
        finally:
            _kill(downstream)
            _kill(upstream)

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, done: threading.Event) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            done.set()


@pytest.fixture
def losing_proxy(server: Server) -> Iterator[Callable[..., LosingProxy]]:
    proxies: list[LosingProxy] = []

    def start(upstream: Server = server, **options: Any) -> LosingProxy:
        proxy = LosingProxy(upstream.port, **options)
        proxies.append(proxy)
        return proxy

    yield start
    for proxy in proxies:
        proxy.close()


def payments(base_url: str, **options: Any) -> IdempotentClient:
    http = httpx.Client(base_url=base_url, auth=ALICE, timeout=HTTP_TIMEOUT_SECONDS)
    return IdempotentClient(http, **{"policy": QUICK, **options})


def assert_one_charge(server: Server, before: int, result: IdempotentResult) -> None:
    assert result.status_code == 201, result.response.text
    charge_id = result.json()["id"]
    assert server.charge_count() == before + 1
    assert server.charge_ids().count(charge_id) == 1


# --- lost responses ---------------------------------------------------------------------------


# The example serves one charge service as a function view, an async view and a DRF viewset.
@pytest.mark.parametrize("path", ["/charges/", "/async/charges/", "/api/charges/"])
def test_a_response_lost_after_the_commit_is_replayed_on_retry(
    server: Server, losing_proxy: Callable[..., LosingProxy], key: str, path: str
) -> None:
    proxy = losing_proxy()
    before = server.charge_count()

    with payments(proxy.url) as client:
        result = client.post(path, key=key, json=charge_body())

    assert proxy.lost == 1
    assert result.attempts == 2
    assert isinstance(result.history[0], httpx.RemoteProtocolError), result.history
    assert result.replayed  # the first attempt had charged: the retry got its response
    assert_one_charge(server, before, result)
    assert proxy.connections == 2


def test_a_response_held_past_the_read_timeout_is_replayed_on_retry(
    server: Server, losing_proxy: Callable[..., LosingProxy], key: str
) -> None:
    proxy = losing_proxy(stall=True)
    before = server.charge_count()

    # The example's provider answers in 0.3 s; the proxy holds that answer until the
    # client's 2 s read timeout gives up on it.
    with payments(proxy.url, timeout=httpx.Timeout(HTTP_TIMEOUT_SECONDS, read=2.0)) as client:
        result = client.post("/charges/", key=key, json=charge_body())

    assert proxy.lost == 1
    assert isinstance(result.history[0], httpx.ReadTimeout), result.history
    assert result.replayed
    assert_one_charge(server, before, result)


def test_several_lost_responses_in_a_row(
    server: Server, losing_proxy: Callable[..., LosingProxy], key: str
) -> None:
    proxy = losing_proxy(lose=3)
    before = server.charge_count()

    with payments(proxy.url) as client:
        result = client.post("/charges/", key=key, json=charge_body())

    assert proxy.lost == 3
    assert result.attempts == 4
    assert result.replayed
    assert_one_charge(server, before, result)


def test_the_async_client_retries_a_lost_response(
    server: Server, losing_proxy: Callable[..., LosingProxy], key: str
) -> None:
    proxy = losing_proxy()
    before = server.charge_count()

    async def charge() -> IdempotentResult:
        http = httpx.AsyncClient(base_url=proxy.url, auth=ALICE, timeout=HTTP_TIMEOUT_SECONDS)
        async with http, AsyncIdempotentClient(http, policy=QUICK) as client:
            return await client.post("/charges/", key=key, json=charge_body())

    result = asyncio.run(charge())

    assert result.attempts == 2
    assert result.replayed
    assert_one_charge(server, before, result)


# --- the server's answers -----------------------------------------------------------------------


def test_a_concurrent_duplicate_retries_the_409_until_the_replay(
    start_example: Callable[..., Server], key: str
) -> None:
    # A slow provider keeps the first request running while its duplicate arrives.
    slow = start_example(EXAMPLE_PROVIDER_DELAY_MS="3000")
    body = charge_body()
    before = slow.charge_count()

    def send() -> IdempotentResult:
        with payments(slow.base_url) as client:
            return client.post("/charges/", key=key, json=body)

    results = concurrently(2, send, within=HTTP_TIMEOUT_SECONDS * 2)
    assert all(isinstance(result, IdempotentResult) for result in results), results
    done = [result for result in results if isinstance(result, IdempotentResult)]
    ran = [result for result in done if not result.replayed]
    waited = [result for result in done if result.replayed]
    assert len(ran) == 1, done
    assert len(waited) == 1, done
    assert ran[0].attempts == 1
    # The duplicate was told "in flight" (409, Retry-After) and came back until the replay.
    assert waited[0].attempts >= 2
    conflicts = [r for r in waited[0].history if isinstance(r, httpx.Response)]
    assert conflicts, waited[0].history
    assert all(r.status_code == 409 for r in conflicts)
    assert all(r.json()["type"] == IN_FLIGHT for r in conflicts)
    assert waited[0].response.content == ran[0].response.content
    assert_one_charge(slow, before, ran[0])


def test_a_declined_card_is_final_and_replayed_without_retrying(server: Server, key: str) -> None:
    body = charge_body("tok_declined")
    before = server.charge_count()

    with payments(server.base_url) as client:
        first = client.post("/charges/", key=key, json=body)
        again = client.post("/charges/", key=key, json=body)

    assert (first.status_code, first.attempts, first.replayed) == (402, 1, False)
    assert (again.status_code, again.attempts, again.replayed) == (402, 1, True)
    assert server.charge_count() == before


def test_a_changed_body_under_the_same_key_is_final(server: Server, key: str) -> None:
    body = charge_body()
    before = server.charge_count()

    with payments(server.base_url) as client:
        first = client.post("/charges/", key=key, json=body)
        changed = client.post("/charges/", key=key, json={**body, "amount": body["amount"] + 1})

    assert_one_charge(server, before, first)
    assert (changed.status_code, changed.attempts) == (422, 1)


def test_a_provider_timeout_is_retried_until_the_attempts_run_out(server: Server, key: str) -> None:
    # 504 releases the key on the server, so every attempt runs the view again.
    before = server.charge_count()

    with payments(server.base_url, policy=RetryPolicy(max_attempts=3, base_delay=0.05)) as client:
        result = client.post("/charges/", key=key, json=charge_body("tok_timeout"))

    assert result.status_code == 504
    assert result.attempts == 3
    assert result.gave_up
    assert not result.replayed
    assert server.charge_count() == before
