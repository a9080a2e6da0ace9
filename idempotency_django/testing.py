"""Prove that your own views are idempotent, in a few lines of test.

Assertion functions for ``django.test.TestCase`` and pytest (``assert_replays``,
``assert_rejects_changed_body``, ``assert_single_flight``, ``assert_releases_on_failure``)
and a pytest plugin with the ``idempotency_check`` and ``idempotency_key`` fixtures. Each
sends real requests through a test client, counts side effects with a callable you give,
and fails, saying why, for a view that is not protected. Guide: docs/testing.md.
(The helpers raise ``AssertionError`` themselves: PYTEST_DONT_REWRITE.)
"""

from __future__ import annotations

import copy
import json
import threading
import time
import unittest
import uuid
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import KW_ONLY, dataclass
from typing import Any
from urllib.parse import urlencode

from django.db import connections
from django.http import HttpResponseBase
from django.test import Client

from idempotency_django.conf import conf

__all__ = [
    "IdempotencyCheck",
    "assert_rejects_changed_body",
    "assert_releases_on_failure",
    "assert_replays",
    "assert_single_flight",
    "new_key",
]

JSON = "application/json"
PROBLEM_JSON = "application/problem+json"

#: Counts the view's side effects (rows it created, calls a fake provider received …).
SideEffects = Callable[[], int]
#: A client, or a callable that makes one (for ``assert_single_flight``: one per thread).
ClientOrFactory = Client | Callable[[], Client]

_DEFAULT: Any = object()


def new_key() -> str:
    """A fresh ``Idempotency-Key`` for one test operation."""
    return f"idempotency-test-{uuid.uuid4()}"


# --- the four assertions ----------------------------------------------------------------------


def assert_replays(
    client: Client,
    path: str,
    data: Any = None,
    *,
    side_effects: SideEffects,
    method: str = "post",
    content_type: str = JSON,
    headers: Mapping[str, str] | None = None,
    key: str | None = None,
    runs_per_request: int = 1,
) -> tuple[HttpResponseBase, HttpResponseBase]:
    """The same request twice with one key: identical status and body, the second marked
    as a replay, and the side effects of one run only. Returns both responses."""
    request = _Request(method, path, data, content_type, headers, key or new_key())
    before = side_effects()
    first = request.send(client)
    after_first = side_effects()
    _check_ran_once(before, after_first, runs_per_request, first, "The first request")
    if _replayed(first):
        raise AssertionError(
            f"The first request with a new Idempotency-Key was answered as a replay "
            f"({conf.REPLAY_HEADER}: true): {_describe(first)}"
        )
    second = request.send(client)
    after_second = side_effects()
    if after_second != after_first:
        raise AssertionError(
            f"The view ran again for the same Idempotency-Key: side effects went "
            f"{after_first} -> {after_second}. A protected view replays the first response "
            f"instead. Is the view decorated with @idempotent, for method "
            f"{request.method}, and is the {conf.HEADER} header reaching it?\n"
            f"first:  {_describe(first)}\nsecond: {_describe(second)}"
        )
    if not _replayed(second):
        raise AssertionError(
            f"The retry ran no side effect but was not marked as a replay "
            f"(no {conf.REPLAY_HEADER}: true): {_describe(second)}\nfirst: {_describe(first)}"
        )
    if second.status_code != first.status_code or _body(second) != _body(first):
        raise AssertionError(
            "The replay differs from the first response:\n"
            f"first:  {_describe(first)}\nreplay: {_describe(second)}"
        )
    return first, second


def assert_rejects_changed_body(
    client: Client,
    path: str,
    data: Any,
    changed: Any,
    *,
    side_effects: SideEffects | None = None,
    method: str = "post",
    content_type: str = JSON,
    headers: Mapping[str, str] | None = None,
    key: str | None = None,
    problem_type: str | None = _DEFAULT,
) -> HttpResponseBase:
    """A request, then a *different* one with the same key: the second is a ``422`` and
    runs nothing. Returns the ``422``.

    ``problem_type`` is the expected problem ``type`` (by default the package's
    ``key-mismatch`` type under ``PROBLEM_TYPE_BASE``); ``None`` checks the status only.
    """
    key = key or new_key()
    original = _Request(method, path, data, content_type, headers, key)
    different = _Request(method, path, changed, content_type, headers, key)
    if original.body == different.body:
        raise ValueError("assert_rejects_changed_body needs a changed body that differs")
    if problem_type is _DEFAULT:
        problem_type = f"{conf.PROBLEM_TYPE_BASE}key-mismatch"
    first = original.send(client)
    before = side_effects() if side_effects is not None else 0
    second = different.send(client)
    after = side_effects() if side_effects is not None else 0
    if second.status_code != 422:
        raise AssertionError(
            f"The same Idempotency-Key with a different body should be refused with 422, "
            f"but was answered {second.status_code}. Is the view decorated with "
            f"@idempotent (and does its fingerprint cover the field that changed)?\n"
            f"first:   {_describe(first)}\nchanged: {_describe(second)}"
        )
    if problem_type is not None:
        kind = _problem_type(second)
        if kind != problem_type:
            raise AssertionError(
                f"The 422 is not the key-mismatch problem {problem_type!r} (type {kind!r}): "
                f"it came from the view, not from the key check.\n{_describe(second)}"
            )
    if _replayed(second):
        raise AssertionError(f"The 422 was marked as a replay: {_describe(second)}")
    if after != before:
        raise AssertionError(
            f"The changed request ran the view: side effects went {before} -> {after}."
        )
    return second


def assert_single_flight(
    client: ClientOrFactory,
    path: str,
    data: Any = None,
    *,
    side_effects: SideEffects,
    requests: int = 8,
    method: str = "post",
    content_type: str = JSON,
    headers: Mapping[str, str] | None = None,
    key: str | None = None,
    runs_per_request: int = 1,
    timeout: float = 60.0,
) -> list[HttpResponseBase]:
    """``requests`` identical requests at once, one thread (and database connection) each,
    released together by a barrier: the view runs once; every other answer is a replay of
    that one's response or a ``409`` "in flight". Returns the responses.

    Needs a transactional test database (``@pytest.mark.django_db(transaction=True)`` or a
    ``TransactionTestCase``), so that the threads see each other's claims as a production
    server would, and a database that lets writers run concurrently (PostgreSQL,
    MariaDB/MySQL; SQLite serialises writers). ``client`` is a client that is copied for
    each thread, or a callable that makes one.
    """
    if requests < 2:
        raise ValueError("assert_single_flight needs at least 2 concurrent requests")
    open_transactions = [
        c.alias for c in connections.all(initialized_only=True) if c.in_atomic_block
    ]
    if open_transactions:
        raise RuntimeError(
            "assert_single_flight needs a transactional test database: the test runs inside "
            f"a transaction on {', '.join(open_transactions)}, which the request threads "
            "cannot see into. Use @pytest.mark.django_db(transaction=True) or "
            "TransactionTestCase."
        )
    from idempotency_django.core import claims  # imports models: not at plugin load time

    store = connections[claims.store_alias()]
    if store.vendor == "sqlite" and getattr(store, "is_in_memory_db", bool)():
        raise unittest.SkipTest(
            "assert_single_flight needs a database that runs writers concurrently "
            "(PostgreSQL, MariaDB/MySQL, or SQLite in a file): on in-memory SQLite "
            "concurrent requests fail with 'database table is locked' instead of racing "
            "for the key"
        )
    request = _Request(method, path, data, content_type, headers, key or new_key())
    make_client = _client_factory(client)
    barrier = threading.Barrier(requests)
    results: list[HttpResponseBase | BaseException | None] = [None] * requests

    def send(index: int) -> None:
        try:
            own = make_client()
            barrier.wait(timeout)
            results[index] = request.send(own)
        except BaseException as error:  # reported below, with the others
            results[index] = error
        finally:
            connections.close_all()

    before = side_effects()
    threads = [
        threading.Thread(target=send, args=(index,), name=f"idempotency-check-{index}", daemon=True)
        for index in range(requests)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if any(thread.is_alive() for thread in threads):
        raise AssertionError(
            f"{requests} concurrent requests did not all finish within {timeout} s "
            "(a deadlock, or a view waiting for something?)"
        )
    after = side_effects()
    errors = [result for result in results if isinstance(result, BaseException)]
    if errors:
        raise AssertionError(
            f"{len(errors)} of {requests} concurrent requests raised: {errors[0]!r}"
        ) from errors[0]
    responses = [result for result in results if isinstance(result, HttpResponseBase)]
    listing = "\n".join(_describe(response) for response in responses)
    if after - before != runs_per_request:
        hint = (
            _NOTHING_RAN
            if after == before
            else "Is the view decorated with @idempotent (and for this method)?"
        )
        raise AssertionError(
            f"{requests} concurrent identical requests with one Idempotency-Key made "
            f"{after - before} side effect(s), expected {runs_per_request} (one run of the "
            f"view). {hint}\n{listing}"
        )
    refused = [
        response
        for response in responses
        if _problem_type(response, conf.PROBLEM_TYPE_BASE) and not _in_flight(response)
    ]
    if refused:
        raise AssertionError(
            f"{len(refused)} of {requests} concurrent requests were refused by the key check "
            f"itself ({_problem_type(refused[0])}), neither run nor replayed nor told to "
            f"retry: the store could not take concurrent claims.\n{listing}"
        )
    ran = [response for response in responses if not _replayed(response)]
    ran = [response for response in ran if not _in_flight(response)]
    if len(ran) != 1:
        raise AssertionError(
            f"{len(ran)} of {requests} concurrent requests were answered as if they ran the "
            f"view (neither a replay nor a 409 in flight); expected 1.\n{listing}"
        )
    original = ran[0]
    for response in responses:
        if response is original or _in_flight(response):
            continue
        if response.status_code != original.status_code or _body(response) != _body(original):
            raise AssertionError(
                "A concurrent duplicate got a replay that differs from the response of the "
                f"request that ran:\nran:    {_describe(original)}\nreplay: {_describe(response)}"
            )
    return responses


def assert_releases_on_failure(
    client: Client,
    path: str,
    data: Any = None,
    *,
    side_effects: SideEffects,
    failing: Callable[[], AbstractContextManager[Any]],
    method: str = "post",
    content_type: str = JSON,
    headers: Mapping[str, str] | None = None,
    key: str | None = None,
    runs_per_request: int = 1,
) -> tuple[HttpResponseBase | Exception, HttpResponseBase]:
    """A request whose view fails leaves its key free: the retry runs the view.

    ``failing`` returns a context manager under which the view fails (raises, or answers
    a 5xx), e.g. ``lambda: mock.patch("shop.provider.charge", side_effect=ProviderDown)``.
    The request is sent once inside it and retried outside it with the same key: the retry
    must run the view (not a replay, not a ``409``), and a third request must then be a
    replay of the retry, which shows that the view honours the key at all. Returns the
    failure (a response, or the exception the client raised) and the retry's response.
    """
    request = _Request(method, path, data, content_type, headers, key or new_key())
    failure: HttpResponseBase | Exception
    with failing():
        try:
            failure = request.send(client)
        except Exception as error:  # the test client re-raises the view's exception
            failure = error
    if isinstance(failure, HttpResponseBase) and failure.status_code < 500:
        raise AssertionError(
            f"The view did not fail under `failing` (answered {_describe(failure)}); make "
            "`failing` make it raise or answer a 5xx."
        )
    before = side_effects()
    retry = request.send(client)
    after = side_effects()
    if _replayed(retry):
        raise AssertionError(
            "The retry after a failure got the failure replayed: the failed outcome was "
            f"stored, so the key can never succeed. A 5xx or an exception must release the "
            f"key.\nfailure: {_describe(failure)}\nretry:   {_describe(retry)}"
        )
    if _in_flight(retry) or retry.status_code == 409:
        raise AssertionError(
            "The retry after a failure was refused with 409: the failed request left its key "
            f"in progress instead of releasing it.\nretry: {_describe(retry)}"
        )
    if after - before != runs_per_request:
        raise AssertionError(
            f"The retry after a failure did not run the view once: side effects went "
            f"{before} -> {after} (expected {runs_per_request} more).\nretry: {_describe(retry)}"
        )
    if retry.status_code >= 500:
        raise AssertionError(
            "The retry failed as well; `failing` must make only the requests inside it "
            f"fail.\nretry: {_describe(retry)}"
        )
    third = request.send(client)
    if side_effects() != after or not _replayed(third):
        raise AssertionError(
            "A request repeating the successful retry's key ran the view again instead of "
            "replaying it: the view does not honour the Idempotency-Key at all. Is it "
            f"decorated with @idempotent?\nretry: {_describe(retry)}\nagain: {_describe(third)}"
        )
    return failure, retry


# --- a view under test, for the pytest fixture (and for TestCase helpers of your own) ---------


@dataclass
class IdempotencyCheck:
    """One request to one of your views, and the four assertions about it::

    check = IdempotencyCheck(client, "/charges/", {"amount": 100},
                             side_effects=Charge.objects.count)
    check.assert_replays()
    check.assert_rejects_changed_body({"amount": 200})
    """

    client: Client
    path: str
    data: Any = None
    _: KW_ONLY
    side_effects: SideEffects
    method: str = "post"
    content_type: str = JSON
    headers: Mapping[str, str] | None = None
    runs_per_request: int = 1

    def assert_replays(
        self, *, key: str | None = None
    ) -> tuple[HttpResponseBase, HttpResponseBase]:
        return assert_replays(self.client, self.path, self.data, key=key, **self._options())

    def assert_rejects_changed_body(
        self, changed: Any, *, key: str | None = None, problem_type: str | None = _DEFAULT
    ) -> HttpResponseBase:
        options = self._options()
        del options["runs_per_request"]
        return assert_rejects_changed_body(
            self.client,
            self.path,
            self.data,
            changed,
            key=key,
            problem_type=problem_type,
            **options,
        )

    def assert_single_flight(
        self,
        *,
        requests: int = 8,
        client: ClientOrFactory | None = None,
        key: str | None = None,
        timeout: float = 60.0,
    ) -> list[HttpResponseBase]:
        return assert_single_flight(
            client or self.client,
            self.path,
            self.data,
            requests=requests,
            key=key,
            timeout=timeout,
            **self._options(),
        )

    def assert_releases_on_failure(
        self, failing: Callable[[], AbstractContextManager[Any]], *, key: str | None = None
    ) -> tuple[HttpResponseBase | Exception, HttpResponseBase]:
        return assert_releases_on_failure(
            self.client, self.path, self.data, failing=failing, key=key, **self._options()
        )

    def _options(self) -> dict[str, Any]:
        return {
            "side_effects": self.side_effects,
            "method": self.method,
            "content_type": self.content_type,
            "headers": self.headers,
            "runs_per_request": self.runs_per_request,
        }


# --- requests and responses -------------------------------------------------------------------


@dataclass(frozen=True)
class _Request:
    method: str
    path: str
    data: Any
    content_type: str
    headers: Mapping[str, str] | None
    key: str

    @property
    def body(self) -> bytes:
        return _encode(self.data, self.content_type)

    def send(self, client: Client) -> HttpResponseBase:
        extra: dict[str, Any] = {
            _meta_name(name): value for name, value in (self.headers or {}).items()
        }
        extra[_meta_name(conf.HEADER)] = self.key
        response: HttpResponseBase = client.generic(
            self.method.upper(), self.path, self.body, content_type=self.content_type, **extra
        )
        return response


def _encode(data: Any, content_type: str) -> bytes:
    if data is None:
        return b""
    if isinstance(data, bytes):
        return data
    if isinstance(data, str):
        return data.encode()
    if content_type == "application/x-www-form-urlencoded" and isinstance(data, Mapping):
        return urlencode(data, doseq=True).encode()
    return json.dumps(data).encode()


def _meta_name(header: str) -> str:
    """The ``request.META`` key of a header, which every test client version accepts."""
    return "HTTP_" + header.upper().replace("-", "_")


def _client_factory(client: ClientOrFactory) -> Callable[[], Client]:
    if not isinstance(client, Client):
        return client

    def clone() -> Client:
        # A test client keeps per-request state (cookies, the last exception): one copy per
        # thread. Its handler, authentication (force_login, APIClient.force_authenticate)
        # and default headers are shared.
        own = copy.copy(client)
        own.cookies = copy.deepcopy(client.cookies)
        return own

    return clone


def _body(response: HttpResponseBase) -> bytes:
    cached: bytes | None = getattr(response, "_idempotency_check_body", None)
    if cached is None:
        if getattr(response, "streaming", False):
            cached = b"".join(response.streaming_content)  # type: ignore[attr-defined]
        else:
            cached = bytes(response.content)  # type: ignore[attr-defined]
        response._idempotency_check_body = cached  # type: ignore[attr-defined]
    return cached


def _replayed(response: HttpResponseBase) -> bool:
    return str(response.headers.get(conf.REPLAY_HEADER, "")).lower() == "true"


def _problem_type(response: HttpResponseBase, prefix: str = "") -> str | None:
    """The ``type`` of a problem+json response (that starts with ``prefix``)."""
    if not str(response.headers.get("Content-Type", "")).startswith(PROBLEM_JSON):
        return None
    try:
        problem = json.loads(_body(response))
    except ValueError:
        return None
    kind = problem.get("type") if isinstance(problem, dict) else None
    return kind if isinstance(kind, str) and kind.startswith(prefix) else None


def _in_flight(response: HttpResponseBase) -> bool:
    kind = _problem_type(response)
    return response.status_code == 409 and kind is not None and kind.endswith("in-flight")


def _check_ran_once(
    before: int, after: int, expected: int, response: HttpResponseBase, what: str
) -> None:
    if after - before == expected:
        return
    hint = (
        _NOTHING_RAN
        if after == before
        else "Pass runs_per_request= if one run of the view makes several side effects."
    )
    raise AssertionError(
        f"{what} with a new Idempotency-Key should run the view once ({expected} side "
        f"effect(s)), but side_effects() went {before} -> {after}. {hint}\n{_describe(response)}"
    )


_NOTHING_RAN = (
    "Does side_effects count what the view does, and did the requests reach the view "
    "(authentication, URL, method; in a transactional test, data from migrations is gone)?"
)


def _describe(outcome: HttpResponseBase | BaseException) -> str:
    if isinstance(outcome, BaseException):
        return f"raised {outcome!r}"
    body = _body(outcome)
    shown = body[:300].decode(errors="replace") + ("…" if len(body) > 300 else "")
    replay = f" [{conf.REPLAY_HEADER}: true]" if _replayed(outcome) else ""
    return f"{outcome.status_code}{replay} {outcome.headers.get('Content-Type', '')} {shown}"


# --- the pytest plugin ------------------------------------------------------------------------

try:
    import pytest
except ImportError:  # pragma: no cover - the assertion functions need no pytest
    _HAVE_PYTEST = False
else:
    _HAVE_PYTEST = True

if _HAVE_PYTEST:  # pragma: no branch

    @pytest.fixture
    def idempotency_key() -> str:
        """A fresh ``Idempotency-Key``."""
        return new_key()

    @pytest.fixture
    def idempotency_check(client: Client) -> Callable[..., IdempotencyCheck]:
        """Make an ``IdempotencyCheck`` for one of your views, with pytest-django's ``client``
        unless you pass ``client=`` (a logged-in client, DRF's ``APIClient`` …)::

            def test_charges_are_idempotent(idempotency_check, alice):
                check = idempotency_check("/charges/", {"amount": 100},
                                          side_effects=Charge.objects.count)
                check.assert_replays()
        """

        def make(path: str, data: Any = None, **options: Any) -> IdempotencyCheck:
            options.setdefault("client", client)
            return IdempotencyCheck(path=path, data=data, **options)

        return make
