"""What a response becomes in the store and what a replay sends back: capture, replay,
and the problem+json answers (RFC 9457) of every refusal. The contract: docs/http-contract.md
and docs/problems.md; what is stored: docs/stored-responses.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from django.http import HttpResponse, HttpResponseBase

from idempotency_django.conf import conf
from idempotency_django.exceptions import IdempotencyError

# Cache-Control too: a replay says what the first response said of caching, and without it
# "no-store" (``replay``).
ALWAYS_STORED_HEADERS = ("Content-Type", "Location", "Cache-Control")
#: What a replay says of caching when the first response said nothing: it answers one
#: client's retry of an unsafe request with a stored result, which no cache should keep.
REPLAY_CACHE_CONTROL = "no-store"
#: Headers that describe the body's bytes, not the response: never stored or replayed from
#: the store (lower case). A redacted body is shorter than the first one, and the server
#: (or ``CommonMiddleware``) counts the bytes a replay sends.
BODY_LENGTH_HEADERS = frozenset({"content-length"})

#: Headers never stored and never replayed, whatever ``STORED_HEADERS`` says (lower case).
#: A replay goes to whoever holds the key, over another connection, maybe through other
#: proxies: it must carry neither the first exchange's credentials and challenges nor the
#: first connection's hop-by-hop headers (RFC 9110 §7.6.1), which would be wrong on the new
#: connection (a stale ``Transfer-Encoding`` or ``Connection: close`` breaks the framing).
NEVER_STORED_HEADERS = frozenset(
    {
        # Credentials, sessions and authentication exchanges.
        "set-cookie",
        "set-cookie2",
        "cookie",
        "authorization",
        "www-authenticate",
        "authentication-info",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-authentication-info",
        # Hop-by-hop: they describe one connection, not the response.
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
TRANSIENT_CLIENT_ERRORS = frozenset({408, 409, 425, 429})


def is_definitive(status: int) -> bool:
    """The default ``STORE_STATUSES``: 2xx, 3xx, and 4xx that a retry would not change.

    5xx and the transient 4xx (timeout, conflict, too early, too many requests) are not
    stored: caching a blip would make it the key's permanent answer.
    """
    if 200 <= status < 400:
        return True
    return 400 <= status < 500 and status not in TRANSIENT_CLIENT_ERRORS


@dataclass(frozen=True)
class StoredResponse:
    status: int
    body: bytes
    headers: list[tuple[str, str]] = field(default_factory=list)


def stored_header_names() -> list[str]:
    """The allow-list (``Content-Type``, ``Location`` and ``STORED_HEADERS``), less the
    ``NEVER_STORED_HEADERS``."""
    return list(_allowed(conf.STORED_HEADERS))


# The allow-list of the last STORED_HEADERS seen: built once, not per completion.
_allowed_for: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())


def _allowed(setting: tuple[str, ...]) -> tuple[str, ...]:
    global _allowed_for
    seen, names = _allowed_for
    if seen != setting or not names:
        names = tuple(name for name in (*ALWAYS_STORED_HEADERS, *setting) if _replayable(name))
        _allowed_for = (setting, names)
    return names


def _connection_options(response: HttpResponseBase) -> frozenset[str]:
    """The headers a response's ``Connection`` header names: hop-by-hop too (RFC 9110)."""
    value = response.headers.get("Connection", "")
    return frozenset(option.strip().lower() for option in value.split(",") if option.strip())


def capture(response: HttpResponse) -> StoredResponse:
    """The parts of a response that a replay needs: status, body bytes, allow-listed headers."""
    return StoredResponse(
        status=response.status_code, body=bytes(response.content), headers=stored_headers(response)
    )


def stored_headers(response: HttpResponseBase) -> list[tuple[str, str]]:
    """The allow-listed headers of ``response`` that a replay carries."""
    headers = response.headers
    hop_by_hop = _connection_options(response) if "Connection" in headers else frozenset()
    return [
        (name, headers[name])
        for name in _allowed(conf.STORED_HEADERS)
        if name in headers and name.lower() not in hop_by_hop
    ]


def replay(stored: StoredResponse) -> HttpResponse:
    """The stored response, as a new response marked with ``REPLAY_HEADER``, then passed
    to the ``REPLAY_HOOK`` if one is set.

    The ``NEVER_STORED_HEADERS`` and ``BODY_LENGTH_HEADERS`` are dropped here as well as at
    capture: a record stored by an older version, or written by hand, must not replay them
    either. ``Cache-Control`` is the first response's, or ``no-store``. The hook gets this
    new response and what was read: a replay never writes to the store.
    """
    headers = [(name, value) for name, value in stored.headers if _replayable(name)]
    # The stored Content-Type given at construction: not Django's default, set then replaced.
    first = next((i for i, (name, _) in enumerate(headers) if name.lower() == "content-type"), -1)
    content_type = None if first < 0 else headers[first][1]
    response = HttpResponse(stored.body, status=stored.status, content_type=content_type)
    if content_type is None:
        del response["Content-Type"]
    for index, (name, value) in enumerate(headers):
        if index != first:
            response[name] = value
    if "Cache-Control" not in response:
        response["Cache-Control"] = REPLAY_CACHE_CONTROL
    response[conf.REPLAY_HEADER] = "true"
    hook = conf.optional_callable("REPLAY_HOOK")
    if hook is None:
        return response
    adjusted = hook(response, stored)
    if adjusted is None:  # adjusted in place
        return response
    if not isinstance(adjusted, HttpResponse):
        raise TypeError(
            f"REPLAY_HOOK returned {type(adjusted).__name__}: return the HttpResponse it "
            "was given (or another HttpResponse), or None."
        )
    return adjusted


def _replayable(name: str) -> bool:
    lower = name.lower()
    return lower not in NEVER_STORED_HEADERS and lower not in BODY_LENGTH_HEADERS


def problem_response(error: IdempotencyError) -> HttpResponseBase:
    """An RFC 9457 ``application/problem+json`` response with a stable ``type`` per case."""
    body = {
        "type": f"{conf.PROBLEM_TYPE_BASE}{error.slug}",
        "title": error.title,
        "status": error.status,
        "detail": error.detail,
    }
    response = HttpResponse(
        json.dumps(body), status=error.status, content_type="application/problem+json"
    )
    if error.retry_after is not None:
        response["Retry-After"] = str(error.retry_after)
    return response
