"""The published contract, as plain OpenAPI 3 dicts: the key header (its format and maximum
length), the expiry policy (the IETF draft's one MUST for servers), every problem response the
app can give, and the replay header.

One source for every schema generator: ``openapi.py`` (drf-spectacular) and ``ninja.py``
(django-ninja) both call ``document``. Nothing here imports Django REST framework or
django-ninja, so a project with only one of them installed needs nothing of the other. Every
text is built when a schema is generated, from the settings in force (``HEADER``,
``TTL_SECONDS``, ``REPLAY_HEADER``, ``RETRY_AFTER_SECONDS``, ``PROBLEM_TYPE_BASE``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from idempotency_django import exceptions
from idempotency_django.conf import conf
from idempotency_django.core.codecs import ResponseUnreadable
from idempotency_django.core.keys import KEY_PATTERN, KEY_VALUE_MAX_LENGTH
from idempotency_django.models import KEY_MAX_LENGTH

#: The problems each status can carry, in the order a reader meets them.
PROBLEMS: dict[int, tuple[type[exceptions.IdempotencyError], ...]] = {
    400: (exceptions.KeyMissing, exceptions.KeyMalformed),
    403: (exceptions.AnonymousNotAllowed,),
    409: (exceptions.InFlight, exceptions.ResponseNotStored, ResponseUnreadable),
    413: (exceptions.BodyTooLarge,),
    422: (exceptions.KeyMismatch,),
    429: (exceptions.QuotaExceeded,),  # published while MAX_IN_FLIGHT_PER_ACCOUNT is set
    500: (exceptions.WorkNotCommitted,),
    503: (exceptions.StoreUnavailable,),
}
PROBLEM_MEDIA_TYPE = "application/problem+json"

_WHEN = {
    400: "The {header} header is missing (where required) or malformed.",
    403: "An {header} was sent by an unauthenticated client: keys belong to an account.",
    409: "A request with this {header} is still being processed (retry after Retry-After "
    "seconds), or it was processed but its response cannot be replayed (it was too large "
    "to store, or the stored response cannot be read): it is not run again.",
    413: "The request body is too large to fingerprint (DATA_UPLOAD_MAX_MEMORY_SIZE).",
    422: "This {header} was already used with a different request (method, path, query or body).",
    429: "The account already has MAX_IN_FLIGHT_PER_ACCOUNT requests in progress: this one "
    "was refused before it claimed its key, and nothing ran. Retry after Retry-After seconds.",
    500: "The request's work failed to commit and was rolled back (a deferred constraint, a "
    "serialization failure): the key is free again, and the same request would most likely "
    "fail the same way. Not retried automatically.",
    503: "The idempotency store cannot be reached, or the request's outcome could not be "
    "recorded. Retry after Retry-After seconds with the same key: a request that may have "
    "been carried out is refused (409) until its lease lapses, never run twice meanwhile.",
}


def ttl_text(ttl: float | None) -> str:
    """The expiry policy in one sentence, for ``ttl`` seconds (``None``: keys never expire)."""
    if ttl is None:
        return "Keys never expire: a completed key is replayed for as long as it is stored."
    seconds = f"{ttl:g}"
    hours = ttl / 3600
    span = f" ({hours:g} hours)" if ttl >= 3600 and hours == int(hours) else ""
    return (
        f"Keys expire {seconds} seconds{span} after the first response is stored; a completed "
        "key is replayed until then, and afterwards it names a new request. A key whose "
        "first request is still running does not expire."
    )


def key_parameter(*, required: bool, ttl: float | None) -> dict[str, Any]:
    """The header parameter: its name, format, maximum length and the expiry policy.

    The pattern and ``maxLength`` accept exactly the values ``keys.parse_key`` accepts, in
    both forms: a client that validates against them is never refused a key the server
    takes, nor sent one it would refuse. The pattern carries the key's length limit (the
    unquoted key's); ``maxLength`` is the longest value it allows (every character escaped).
    """
    header = conf.HEADER
    return {
        "in": "header",
        "name": header,
        "required": required,
        "schema": {
            "type": "string",
            "minLength": 1,
            "maxLength": KEY_VALUE_MAX_LENGTH,
            "pattern": KEY_PATTERN,
        },
        "description": (
            "Names one logical operation: send the same key on every retry of it, and a new "
            "key for a new operation (a UUID v4 is a good key). A completed key replays its "
            f"first response, marked with {conf.REPLAY_HEADER}: true. The key is 1 to "
            f"{KEY_MAX_LENGTH} visible ASCII characters other than a comma (not only "
            "spaces), sent in one header line; its RFC 8941 "
            'quoted-string form ("...", with \\" and \\\\ escapes, where spaces are allowed) '
            f"names the same key, of 1 to {KEY_MAX_LENGTH} characters once unquoted. "
            "Keys are scoped to the authenticated account and the endpoint. "
            + ttl_text(ttl)
            + ("" if required else f" Without {header}, the request runs unprotected.")
        ),
    }


def problem_schema() -> dict[str, Any]:
    """RFC 9457 problem details, with the app's stable ``type`` URIs named.

    ``type`` is open: the status is shared with the view's own problems (a 400 of its own
    validation, a 422 of its business rules), whose types the app cannot know, so the app's
    types are listed in the description and an example, not as an enum that would refuse
    every other.
    """
    types = sorted(
        {
            f"{conf.PROBLEM_TYPE_BASE}{problem.slug}"
            for problems in PROBLEMS.values()
            for problem in problems
        }
    )
    return {
        "type": "object",
        "properties": {
            "type": {
                "type": "string",
                "format": "uri-reference",
                "description": "The problem type (RFC 9457): the view's own, or one of this "
                f"API's idempotency problems: {', '.join(types)}.",
                "example": f"{conf.PROBLEM_TYPE_BASE}{exceptions.KeyMismatch.slug}",
            },
            "title": {"type": "string"},
            "status": {"type": "integer"},
            "detail": {"type": "string"},
        },
        "required": ["type", "title", "status"],
    }


def _retry_after() -> dict[str, Any]:
    return {
        "schema": {"type": "integer", "minimum": 0},
        "description": "Seconds to wait before retrying with the same key "
        f"(RETRY_AFTER_SECONDS, {conf.RETRY_AFTER_SECONDS} here); on a 409 for a request "
        "whose lease is no longer renewed (its worker died), the seconds until that lease "
        "lapses, if longer.",
    }


def problem_response(status: int) -> dict[str, Any]:
    """The response object for one of ``PROBLEMS``' statuses."""
    slugs = ", ".join(f"{conf.PROBLEM_TYPE_BASE}{p.slug}" for p in PROBLEMS[status])
    response: dict[str, Any] = {
        "description": f"{_WHEN[status].format(header=conf.HEADER)} Problem type: {slugs}.",
        "content": {PROBLEM_MEDIA_TYPE: {"schema": problem_schema()}},
    }
    if status in (409, 429, 503):
        response["headers"] = {"Retry-After": _retry_after()}
    return response


def published_statuses() -> list[int]:
    """The statuses of ``PROBLEMS`` an operation can answer with these settings: ``429`` only
    while ``MAX_IN_FLIGHT_PER_ACCOUNT`` is set."""
    quota = conf.get("MAX_IN_FLIGHT_PER_ACCOUNT") is not None
    return [status for status in PROBLEMS if status != 429 or quota]


def replay_header() -> dict[str, Any]:
    return {
        "schema": {"type": "string", "enum": ["true"]},
        "description": "Present, and true, when this is the stored first response to an "
        f"earlier request with the same {conf.HEADER}: same status, body and stored headers.",
    }


def expiry_extension(ttl: float | None) -> dict[str, Any]:
    """``x-idempotency``: the same policy for machines (the IETF draft asks servers to
    publish it; a client generator can read the TTL here rather than parse prose)."""
    return {
        "header": conf.HEADER,
        "maxKeyLength": KEY_MAX_LENGTH,
        "ttlSeconds": ttl,
        "replayHeader": conf.REPLAY_HEADER,
    }


def _merge_problem(response: dict[str, Any], ours: dict[str, Any]) -> None:
    """Add the app's problem content to the view's own ``response`` for the same status.

    A problem+json schema the view documented is kept, as one alternative (``anyOf``: a body
    of either kind validates, and one that fits both is not refused as ``oneOf`` would).
    """
    content = response.setdefault("content", {})
    theirs = content.get(PROBLEM_MEDIA_TYPE)
    mine = ours["content"][PROBLEM_MEDIA_TYPE]
    if not isinstance(theirs, dict) or "schema" not in theirs:
        content[PROBLEM_MEDIA_TYPE] = {**(theirs or {}), **mine}
    elif theirs["schema"] != mine["schema"]:
        theirs["schema"] = {"anyOf": [theirs["schema"], mine["schema"]]}
    response.setdefault("headers", {}).update(ours.get("headers", {}))


def document(
    operation: dict[str, Any],
    *,
    required: bool,
    ttl: float | None,
    stored: Callable[[int], bool],
) -> dict[str, Any]:
    """Add the contract to ``operation`` (an OpenAPI operation object) and return it.

    The key parameter is appended; a problem status the operation already documents keeps
    its description and its own problem+json schema, and gains the app's as an alternative
    (a view's own 422 and the app's 422 share the status). The replay header goes on every
    response whose status ``stored`` (the view's ``STORE_STATUSES``) stores, the app's
    problem statuses included: the app's problems are never stored, but the view's own
    answers with those statuses are (a serializer's 400), and are replayed with it. Status
    keys may be strings (drf-spectacular) or ints (django-ninja); new ones follow the
    operation's kind.
    """
    operation.setdefault("parameters", []).append(key_parameter(required=required, ttl=ttl))
    responses: dict[Any, Any] = operation.setdefault("responses", {})
    ints = bool(responses) and all(isinstance(status, int) for status in responses)
    for status in published_statuses():
        ours = problem_response(status)
        name = next((n for n in (status, str(status)) if n in responses), None)
        if name is None:
            responses[status if ints else str(status)] = ours
        else:
            _merge_problem(responses[name], ours)
    for status, response in responses.items():
        code = str(status)
        if code.isdigit() and stored(int(code)):  # "default" names no status
            response.setdefault("headers", {})[conf.REPLAY_HEADER] = replay_header()
    operation["x-idempotency"] = expiry_extension(ttl)
    return operation
