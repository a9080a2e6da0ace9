"""What names one logical operation: the key header, the account and endpoint scope, and
the fingerprint that tells a retry from a different request reusing the key."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any
from urllib.parse import parse_qsl

from django.http import HttpRequest
from django.http.request import RawPostDataException

from idempotency_django.exceptions import KeyMalformed
from idempotency_django.models import KEY_MAX_LENGTH

Fingerprinter = Callable[[HttpRequest], "str | bytes | None"]


def parse_key(raw: str) -> str:
    """Parse an ``Idempotency-Key`` value: a bare token or an RFC 8941 sf-string.

    ``abc`` and ``"abc"`` name the same key, so clients that follow the IETF draft and
    clients that follow Stripe's examples interoperate.
    """
    value = raw.strip(" \t")
    if value.startswith('"'):
        key = _parse_sf_string(value)
    else:
        if any(not 0x21 <= ord(char) <= 0x7E for char in value):
            raise KeyMalformed("The key must be visible ASCII characters (or a quoted string).")
        key = value
    if not key.strip(" "):
        raise KeyMalformed("The key is empty.")
    if len(key) > KEY_MAX_LENGTH:
        raise KeyMalformed(f"The key is longer than {KEY_MAX_LENGTH} characters.")
    return key


def _parse_sf_string(value: str) -> str:
    chars: list[str] = []
    index = 1
    while index < len(value):
        char = value[index]
        if char == "\\":
            index += 1
            if index == len(value) or value[index] not in '"\\':
                raise KeyMalformed('Only \\" and \\\\ may be escaped in a quoted key.')
            chars.append(value[index])
        elif char == '"':
            if index != len(value) - 1:
                raise KeyMalformed("Nothing may follow the closing quote of the key.")
            return "".join(chars)
        elif not 0x20 <= ord(char) <= 0x7E:
            raise KeyMalformed("The key must be printable ASCII characters.")
        else:
            chars.append(char)
        index += 1
    raise KeyMalformed("The quoted key has no closing quote.")


def fit(value: str, max_length: int) -> str:
    """Keep a scope value within its column: long values become a stable digest."""
    if len(value) <= max_length:
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
    return f"sha256:{digest}"[:max_length]


def default_account(request: HttpRequest) -> str | None:
    """The authenticated user's primary key; ``None`` for anonymous requests."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return None
    return str(user.pk)


def default_endpoint(request: HttpRequest) -> str:
    """Method and concrete path: ``/orders/1/refund`` and ``/orders/2/refund`` are apart."""
    return f"{request.method} {request.path}"


def media_type(request: HttpRequest) -> str:
    """``application/json`` for ``application/json; charset=utf-8`` (Django's
    ``content_type`` has no parameters; Django REST framework's ``Request`` keeps them)."""
    return (request.content_type or "").split(";", 1)[0].strip().lower()


def canonical_body(request: HttpRequest, fields: Sequence[str] | None = None) -> bytes:
    """A form of the body in which JSON key order, whitespace and form field order don't count."""
    try:
        body = request.body
    except RawPostDataException:
        # A multipart body already parsed into POST and FILES (by middleware, or a DRF
        # authenticator or permission) can't be read again: fingerprint what was parsed.
        return _parsed_form(request)
    parsed = _parse_body(media_type(request), body)
    if parsed is _UNPARSED:
        return body
    if fields is not None and isinstance(parsed, dict):
        parsed = {name: parsed.get(name) for name in fields}
    canonical = json.dumps(parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return canonical.encode("utf-8", "surrogatepass")


_UNPARSED = object()


def _parse_body(content_type: str, body: bytes) -> Any:
    if content_type == "application/json" or content_type.endswith("+json"):
        try:
            return json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
            return _UNPARSED
    if content_type == "application/x-www-form-urlencoded":
        pairs = _parse_pairs(body.decode("latin-1"))
        return _pairs_to_dict(pairs)
    return _UNPARSED


def _parse_pairs(encoded: str) -> list[tuple[str, str]]:
    # Latin-1 maps every percent-escaped byte to one character, so two different invalid
    # UTF-8 values never decode to the same replacement character.
    return parse_qsl(encoded, keep_blank_values=True, encoding="latin-1")


def _parsed_form(request: HttpRequest) -> bytes:
    form = {name: request.POST.getlist(name) for name in request.POST}
    files = {
        name: [[upload.name, upload.size] for upload in request.FILES.getlist(name)]
        for name in request.FILES
    }
    return json.dumps({"form": form, "files": files}, sort_keys=True).encode()


def _pairs_to_dict(pairs: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    result: dict[str, list[str]] = {}
    for name, value in pairs:
        result.setdefault(name, []).append(value)
    return result


def digest(*parts: bytes) -> str:
    """SHA-256 over length-prefixed parts, so no two different part lists collide by joining."""
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(len(part).to_bytes(8, "big"))
        hasher.update(part)
    return hasher.hexdigest()


def default_fingerprint(
    request: HttpRequest,
    endpoint: str,
    fields: Sequence[str] | None = None,
    body: Fingerprinter | None = None,
) -> str:
    """SHA-256 over method, endpoint, sorted query string, media type and canonical body.

    ``fields`` limits the body to the named fields; ``body`` replaces the body part with
    what a view-supplied callable returns.
    """
    query = sorted(_parse_pairs(request.META.get("QUERY_STRING", "")))
    content = body(request) if body is not None else None
    if content is None:
        body_bytes = canonical_body(request, fields)
    else:
        body_bytes = content.encode() if isinstance(content, str) else content
    return digest(
        (request.method or "").encode(),
        endpoint.encode("utf-8", "surrogatepass"),
        json.dumps(query).encode(),
        media_type(request).encode(),
        body_bytes,
    )
