"""Turning responses into stored outcomes and back, and the problem+json error bodies."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from django.http import HttpResponse, HttpResponseBase

from idempotency_django.conf import FORBIDDEN_STORED_HEADERS, conf
from idempotency_django.exceptions import IdempotencyError

ALWAYS_STORED_HEADERS = ("Content-Type", "Location")
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
    names = [*ALWAYS_STORED_HEADERS, *conf.STORED_HEADERS]
    return [name for name in names if name.lower() not in FORBIDDEN_STORED_HEADERS]


def capture(response: HttpResponse) -> StoredResponse:
    """The parts of a response that a replay needs: status, body bytes, allow-listed headers."""
    headers = [
        (name, response[name]) for name in stored_header_names() if response.has_header(name)
    ]
    return StoredResponse(
        status=response.status_code, body=bytes(response.content), headers=headers
    )


def replay(stored: StoredResponse) -> HttpResponse:
    response = HttpResponse(stored.body, status=stored.status)
    if not any(name.lower() == "content-type" for name, _ in stored.headers):
        del response["Content-Type"]
    for name, value in stored.headers:
        response[name] = value
    response[conf.REPLAY_HEADER] = "true"
    return response


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
