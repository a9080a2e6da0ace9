"""The client half of idempotency: send one operation until its outcome is known.

Most double charges are made by callers: a key generated inside the retry loop makes every
attempt a new operation. ``IdempotentClient`` takes the key from the caller, sends the same
key and body bytes on every attempt, retries only what leaves the outcome unknown, with
capped backoff and jitter (or ``Retry-After``) within an attempt count and a deadline.
Needs ``httpx`` (the ``client`` extra); ``downstream_key`` is re-exported from
``downstream``. Guide: docs/client.md.
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import hmac
import json
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import httpx

from idempotency_django.core.wire import KEY_MAX_LENGTH as _SERVER_KEY_MAX_LENGTH
from idempotency_django.core.wire import downstream_key, header_value, key_error

__all__ = [
    "AsyncIdempotentClient",
    "IdempotentClient",
    "IdempotentResult",
    "RetriesExhausted",
    "RetryPolicy",
    "downstream_key",
]

logger = logging.getLogger("idempotency_django.client")

KEY_MAX_LENGTH = _SERVER_KEY_MAX_LENGTH

#: Transport failures after which the request may or may not have been processed (or was
#: never sent): retrying them with the same key is what the key is for. ``LocalProtocolError``
#: and ``UnsupportedProtocol`` are the caller's bugs and are not retried.
RETRYABLE_ERRORS: tuple[type[Exception], ...] = (
    httpx.TimeoutException,
    httpx.NetworkError,
    httpx.RemoteProtocolError,
    httpx.ProxyError,
)


@dataclass(frozen=True)
class RetryPolicy:
    """When to try again and how long to wait.

    Attempt ``n`` (from 1) that failed retryably is followed, after a pause of
    ``uniform(0, min(max_delay, base_delay * 2 ** (n - 1)))`` ("full jitter"), by attempt
    ``n + 1``; a ``Retry-After`` on the response replaces the pause. No attempt starts
    after ``deadline`` seconds from the first, and there are at most ``max_attempts``.
    """

    max_attempts: int = 5
    deadline: float = 30.0
    base_delay: float = 0.2
    max_delay: float = 5.0
    #: Statuses retried as they are (409 is decided by ``retryable_conflict``).
    retry_statuses: frozenset[int] = frozenset({429, 502, 503, 504})
    #: A ``Retry-After`` longer than this is not waited for: the response is returned.
    max_retry_after: float = 60.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("RetryPolicy.max_attempts must be at least 1")
        if self.deadline <= 0 or self.base_delay < 0 or self.max_delay < 0:
            raise ValueError("RetryPolicy durations must be positive")

    def backoff(self, attempt: int, jitter: float) -> float:
        """The pause after failed attempt ``attempt`` (1-based), ``jitter`` in [0, 1)."""
        ceiling = min(self.max_delay, self.base_delay * 2.0 ** (attempt - 1))
        return ceiling * jitter


@dataclass(frozen=True)
class IdempotentResult:
    """The final response of an operation and how it was reached."""

    response: httpx.Response
    key: str
    #: How many requests were sent (1 when the first answer was final).
    attempts: int
    #: The server answered with a stored response (``Idempotent-Replayed: true``): the
    #: operation had already run, on an earlier attempt or an earlier call with this key.
    replayed: bool
    #: The answer is itself a retryable one (a 409 in flight, 429, 502, 503, 504) and the
    #: attempts or the deadline ran out: the outcome is still unknown; retry later with the
    #: same key.
    gave_up: bool = False
    #: The retryable failures of the earlier attempts, oldest first.
    history: tuple[httpx.Response | Exception, ...] = field(default=(), repr=False)

    @property
    def status_code(self) -> int:
        return self.response.status_code

    def json(self) -> Any:
        return self.response.json()


# The secret of ``hidden_key``: made when the module is imported, never stored or sent.
_HIDDEN_KEY_SECRET = os.urandom(32)


def hidden_key(key: str) -> str:
    """How the client's logs and errors name a key by default: ``key-hmac:`` and 16 hex
    digits of an HMAC-SHA256 under a secret made when the process starts. The same key
    reads the same within the process (its attempts can be followed), and a log reader
    cannot recover a key by hashing guesses (``order-1042``): that takes the secret. Give
    ``log_key=str`` to log keys as they are, or a digest of your own."""
    digest = hmac.new(_HIDDEN_KEY_SECRET, key.encode("utf-8", "surrogatepass"), hashlib.sha256)
    return "key-hmac:" + digest.hexdigest()[:16]


class RetriesExhausted(Exception):
    """Every attempt failed before an answer (connection errors, timeouts): the outcome is
    unknown. The operation may have run; retry it later **with the same key** (``key``;
    the message names it as the client's ``log_key`` shows it). The last transport error
    is ``__cause__``."""

    def __init__(
        self,
        key: str,
        attempts: int,
        history: tuple[httpx.Response | Exception, ...],
        shown: str | None = None,
    ) -> None:
        super().__init__(
            f"No answer after {attempts} attempt(s) with Idempotency-Key "
            f"{hidden_key(key) if shown is None else shown}; the outcome is unknown: retry "
            "later with the same key."
        )
        self.key = key
        self.attempts = attempts
        self.history = history


def check_key(key: str) -> str:
    """A key the server accepts (``keys.key_error``, the server's own rule), refused here
    before anything is sent."""
    if not isinstance(key, str):
        raise ValueError("An Idempotency-Key is a non-empty string made once per operation")
    error = key_error(key)
    if error is not None:
        raise ValueError(f"Idempotency-Key {key!r} refused: {error}")
    return key


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header: delta-seconds or an HTTP-date."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - (now or datetime.now(timezone.utc))).total_seconds())


def _problem_type(response: httpx.Response) -> str | None:
    if "json" not in response.headers.get("Content-Type", ""):
        return None
    try:
        problem = json.loads(response.content)
    except ValueError:
        return None
    kind = problem.get("type") if isinstance(problem, dict) else None
    return kind if isinstance(kind, str) else None


#: Problem types that are final whatever the status lists say: the server's answer is
#: known, and sending the same request again would fail the same way.
FINAL_PROBLEMS = ("work-not-committed",)


def is_final_problem(response: httpx.Response) -> bool:
    """A problem whose ``type`` ends in one of ``FINAL_PROBLEMS``: idempotency_django's
    ``…:work-not-committed`` (500), the view's work failed to commit and was rolled back."""
    kind = _problem_type(response)
    return kind is not None and kind.endswith(FINAL_PROBLEMS)


def is_in_flight_conflict(response: httpx.Response) -> bool:
    """A 409 that says "the first request with this key is still running".

    That is a problem whose ``type`` ends in ``in-flight`` (idempotency_django's
    ``…:in-flight``), or any 409 with ``Retry-After`` (Stripe-style servers). A 409 without
    either, such as ``…:response-not-stored`` or an application's own conflict, is final.
    """
    if response.status_code != 409:
        return False
    if "Retry-After" in response.headers:
        return True
    kind = _problem_type(response)
    return kind is not None and kind.endswith("in-flight")


@dataclass
class _Attempts:
    """The retry loop's bookkeeping, shared by the sync and async clients."""

    key: str
    policy: RetryPolicy
    clock: Callable[[], float]
    jitter: Callable[[], float]
    replay_header: str
    should_retry: Callable[[httpx.Response], bool]
    shown: str = ""  # the key as logs and errors name it (``log_key``)
    started: float = 0.0
    count: int = 0
    history: list[httpx.Response | Exception] = field(default_factory=list)

    def begin(self) -> None:
        self.started = self.clock()

    def timeout_for(self, timeout: httpx.Timeout) -> httpx.Timeout:
        """The configured per-attempt timeout, each phase capped by the time that is left."""
        left = max(0.001, self.policy.deadline - (self.clock() - self.started))

        def cap(value: float | None) -> float:
            return left if value is None else min(value, left)

        return httpx.Timeout(
            connect=cap(timeout.connect),
            read=cap(timeout.read),
            write=cap(timeout.write),
            pool=cap(timeout.pool),
        )

    def start(self, request: httpx.Request, timeout: httpx.Timeout) -> None:
        """Count one more attempt of ``request``, its timeouts capped by the time left."""
        self.count += 1
        request.extensions["timeout"] = self.timeout_for(timeout).as_dict()

    def after_error(self, error: Exception) -> float | None:
        """The pause before the next attempt, or None to give up."""
        if not isinstance(error, RETRYABLE_ERRORS):
            return None
        self.history.append(error)
        return self._pause(None, repr(error))

    def pause_after_error(self, error: Exception) -> float:
        """The pause before the next attempt after ``error``, or raise: ``RetriesExhausted``
        when a retryable error leaves no attempt, the error itself when it is not one."""
        pause = self.after_error(error)
        if pause is None:
            if isinstance(error, RETRYABLE_ERRORS):
                raise self.exhausted() from error
            raise error
        return pause

    def after_response(self, response: httpx.Response) -> float | None:
        if not self.should_retry(response):
            return None
        self.history.append(response)
        retry_after = parse_retry_after(response.headers.get("Retry-After"))
        if retry_after is not None and retry_after > self.policy.max_retry_after:
            return None
        return self._pause(retry_after, f"status {response.status_code}")

    def _pause(self, retry_after: float | None, why: str) -> float | None:
        if self.count >= self.policy.max_attempts:
            return None
        pause = (
            retry_after
            if retry_after is not None
            else self.policy.backoff(self.count, self.jitter())
        )
        if self.clock() - self.started + pause >= self.policy.deadline:
            return None
        logger.info(
            "Retrying Idempotency-Key %s after attempt %d (%s) in %.2f s",
            self.shown,
            self.count,
            why,
            pause,
        )
        return pause

    def result(self, response: httpx.Response) -> IdempotentResult:
        gave_up = bool(self.history) and self.history[-1] is response
        return IdempotentResult(
            response=response,
            key=self.key,
            attempts=self.count,
            replayed=response.headers.get(self.replay_header, "").lower() == "true",
            gave_up=gave_up,
            history=tuple(self.history[:-1] if gave_up else self.history),
        )

    def exhausted(self) -> RetriesExhausted:
        return RetriesExhausted(self.key, self.count, tuple(self.history), self.shown)


def _auth(auth: httpx.Auth | tuple[str, str] | None) -> Any:
    return httpx.USE_CLIENT_DEFAULT if auth is None else auth


def _key_may_follow(sent_to: httpx.URL, redirected_to: httpx.URL) -> bool:
    """Whether a redirect stays with the origin the key was sent to (scheme, host, port), or
    is that host's upgrade from http to https (which httpx lets ``Authorization`` follow)."""

    def port(url: httpx.URL) -> int | None:
        return url.port or {"http": 80, "https": 443}.get(url.scheme)

    if redirected_to.host != sent_to.host:
        return False
    if redirected_to.scheme == sent_to.scheme:
        return port(redirected_to) == port(sent_to)
    return (
        sent_to.scheme == "http"
        and redirected_to.scheme == "https"
        and port(sent_to) == 80
        and port(redirected_to) == 443
    )


class _Base:
    http: httpx.Client | httpx.AsyncClient

    def __init__(
        self,
        policy: RetryPolicy | None,
        header: str,
        replay_header: str,
        clock: Callable[[], float],
        jitter: Callable[[], float],
        log_key: Callable[[str], str],
    ) -> None:
        self.policy = policy or RetryPolicy()
        self.header = header
        self.replay_header = replay_header
        self._clock = clock
        self._jitter = jitter
        self.log_key = log_key

    def next_hop(self, response: httpx.Response, hops: int) -> httpx.Request | None:
        """The request that follows ``response``'s redirect, or ``None``: it is no redirect,
        the wrapped client does not follow redirects, or it leads to another origin and
        would send the body again (307, 308; or a 301/302 of anything but a POST).

        The key never leaves the origin it was sent to: httpx would carry it along, as any
        header but ``Authorization`` and ``Cookie``. A redirect to another origin that
        becomes a ``GET`` (303, or a POST's 301/302) is followed without the key; one that
        would send the body again is not followed at all, and is the answer: sent without
        its key, it could run twice there, and its retries with it.
        """
        following = response.next_request
        if following is None or not self.http.follow_redirects:
            return None
        if hops >= self.http.max_redirects:
            raise httpx.TooManyRedirects("Exceeded maximum allowed redirects.", request=following)
        if not _key_may_follow(response.request.url, following.url):
            if following.method not in ("GET", "HEAD"):
                return None
            for name in [name for name in following.headers if name.lower() == self.header.lower()]:
                del following.headers[name]
        return following

    def should_retry(self, response: httpx.Response) -> bool:
        """Whether ``response`` leaves the outcome unknown or asks to be retried.

        Override to widen or narrow it; a definitive 4xx (400, 402, 404, 422 …) is final
        and must stay so, or a declined card would be retried until it is accepted, and so
        is a ``work-not-committed`` problem (``is_final_problem``), even where a policy
        retries its status.
        """
        if is_final_problem(response):
            return False
        if response.status_code == 409:
            return is_in_flight_conflict(response)
        return response.status_code in self.policy.retry_statuses

    def _prepare(
        self,
        method: str,
        url: httpx.URL | str,
        key: str,
        json: Any,
        content: bytes | str | None,
        data: Mapping[str, Any] | None,
        params: Mapping[str, Any] | None,
        headers: Mapping[str, str] | None,
    ) -> tuple[_Attempts, httpx.Request]:
        """The attempts of one operation, and its request (the key in its header)."""
        attempts = _Attempts(
            key=check_key(key),
            policy=self.policy,
            clock=self._clock,
            jitter=self._jitter,
            replay_header=self.replay_header,
            should_retry=self.should_retry,
            shown=self.log_key(key),  # after check_key: a key the server accepts
        )
        request = self.http.build_request(
            method,
            url,
            json=json,
            content=content,
            data=data,
            params=params,
            headers=self._headers(attempts.key, headers),
        )
        return attempts, request

    def _headers(self, key: str, headers: Mapping[str, str] | None) -> dict[str, str]:
        merged = dict(headers or {})
        for name in list(merged):
            if name.lower() == self.header.lower():
                raise ValueError(f"Pass the key as key=, not as a {self.header} header")
        merged[self.header] = header_value(key)  # quoted if it holds a space
        return merged


class IdempotentClient(_Base):
    """Send POST/PATCH (or any method) with an ``Idempotency-Key`` until the outcome is known.

    Wraps an ``httpx.Client`` (its ``base_url``, auth, headers and transport apply), or
    makes one that it closes on ``close()``::

        with IdempotentClient(httpx.Client(base_url="https://pay.example", auth=auth)) as pay:
            result = pay.post("/charges/", key=order.payment_key, json={"amount": 1000})
            if result.status_code == 201: ...

    ``log_key`` names a key in the client's logs and errors (``hidden_key``: a digest, by
    default). A redirect is followed as the wrapped client says (``follow_redirects``), but
    the key never goes to another origin (``next_hop``). ``sleep``, ``clock`` and ``jitter``
    (a ``[0, 1)`` random source) are for tests.
    """

    http: httpx.Client

    def __init__(
        self,
        http: httpx.Client | None = None,
        *,
        policy: RetryPolicy | None = None,
        timeout: httpx.Timeout | float | None = None,
        header: str = "Idempotency-Key",
        replay_header: str = "Idempotent-Replayed",
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
        log_key: Callable[[str], str] = hidden_key,
    ) -> None:
        super().__init__(policy, header, replay_header, clock, jitter, log_key)
        self._owned = http is None
        self.http = http if http is not None else httpx.Client()
        self.timeout = self.http.timeout if timeout is None else httpx.Timeout(timeout)
        self._sleep = sleep

    def __enter__(self) -> IdempotentClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._owned:
            self.http.close()

    def request(
        self,
        method: str,
        url: httpx.URL | str,
        *,
        key: str,
        json: Any = None,
        content: bytes | str | None = None,
        data: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        auth: httpx.Auth | tuple[str, str] | None = None,
    ) -> IdempotentResult:
        """Send the request until a final answer, the attempts or the deadline run out.

        Returns the final response (a definitive one, or the last retryable one with
        ``gave_up``). Raises ``RetriesExhausted`` when no attempt got an answer, and
        non-retryable transport errors as they are.
        """
        attempts, request = self._prepare(method, url, key, json, content, data, params, headers)
        request.read()  # a streamed body becomes bytes: every attempt sends the same ones
        attempts.begin()
        pause: float | None
        while True:
            attempts.start(request, self.timeout)
            try:
                response = self._send(request, auth)
            except Exception as error:
                pause = attempts.pause_after_error(error)
            else:
                pause = attempts.after_response(response)
                if pause is None:
                    return attempts.result(response)
                response.close()
            self._sleep(pause)

    def _send(
        self, request: httpx.Request, auth: httpx.Auth | tuple[str, str] | None
    ) -> httpx.Response:
        """One attempt: the request, and the redirects ``next_hop`` lets it follow (each
        sent as httpx built it, without applying ``auth`` again)."""
        response = self.http.send(request, auth=_auth(auth), follow_redirects=False)
        history: list[httpx.Response] = []
        while (following := self.next_hop(response, len(history))) is not None:
            response.close()
            history.append(response)
            response = self.http.send(following, auth=None, follow_redirects=False)
            response.history = list(history)
        return response

    def post(self, url: httpx.URL | str, *, key: str, **kwargs: Any) -> IdempotentResult:
        return self.request("POST", url, key=key, **kwargs)

    def patch(self, url: httpx.URL | str, *, key: str, **kwargs: Any) -> IdempotentResult:
        return self.request("PATCH", url, key=key, **kwargs)

    def put(self, url: httpx.URL | str, *, key: str, **kwargs: Any) -> IdempotentResult:
        return self.request("PUT", url, key=key, **kwargs)


class AsyncIdempotentClient(_Base):
    """``IdempotentClient`` over an ``httpx.AsyncClient``; the same rules, awaited."""

    http: httpx.AsyncClient

    def __init__(
        self,
        http: httpx.AsyncClient | None = None,
        *,
        policy: RetryPolicy | None = None,
        timeout: httpx.Timeout | float | None = None,
        header: str = "Idempotency-Key",
        replay_header: str = "Idempotent-Replayed",
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
        log_key: Callable[[str], str] = hidden_key,
    ) -> None:
        super().__init__(policy, header, replay_header, clock, jitter, log_key)
        self._owned = http is None
        self.http = http if http is not None else httpx.AsyncClient()
        self.timeout = self.http.timeout if timeout is None else httpx.Timeout(timeout)
        self._sleep = sleep

    async def __aenter__(self) -> AsyncIdempotentClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owned:
            await self.http.aclose()

    async def request(
        self,
        method: str,
        url: httpx.URL | str,
        *,
        key: str,
        json: Any = None,
        content: bytes | str | None = None,
        data: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        auth: httpx.Auth | tuple[str, str] | None = None,
    ) -> IdempotentResult:
        """See ``IdempotentClient.request``."""
        attempts, request = self._prepare(method, url, key, json, content, data, params, headers)
        await request.aread()
        attempts.begin()
        pause: float | None
        while True:
            attempts.start(request, self.timeout)
            try:
                response = await self._send(request, auth)
            except Exception as error:
                pause = attempts.pause_after_error(error)
            else:
                pause = attempts.after_response(response)
                if pause is None:
                    return attempts.result(response)
                await response.aclose()
            await self._sleep(pause)

    async def _send(self, request: httpx.Request, auth: httpx.Auth | tuple[str, str] | None) -> Any:
        """See ``IdempotentClient._send``."""
        response = await self.http.send(request, auth=_auth(auth), follow_redirects=False)
        history: list[httpx.Response] = []
        while (following := self.next_hop(response, len(history))) is not None:
            await response.aclose()
            history.append(response)
            response = await self.http.send(following, auth=None, follow_redirects=False)
            response.history = list(history)
        return response

    async def post(self, url: httpx.URL | str, *, key: str, **kwargs: Any) -> IdempotentResult:
        return await self.request("POST", url, key=key, **kwargs)

    async def patch(self, url: httpx.URL | str, *, key: str, **kwargs: Any) -> IdempotentResult:
        return await self.request("PATCH", url, key=key, **kwargs)

    async def put(self, url: httpx.URL | str, *, key: str, **kwargs: Any) -> IdempotentResult:
        return await self.request("PUT", url, key=key, **kwargs)
