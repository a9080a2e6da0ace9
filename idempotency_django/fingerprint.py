"""The fingerprint: what tells a retry from a different request that reuses its key.

``default_fingerprint`` is ``"2:"`` and a SHA-256 over the method, endpoint, query string,
media type and body, each in a canonical form, so that what a retry may change (key order,
whitespace, a multipart boundary) does not count and anything the view could act on does.
``task_fingerprint`` does the same for a task's work; ``fingerprints_match`` compares
across versions of the form; ``custom_fingerprint`` namespaces a project's own value.
Hostile bodies get a fingerprint, never an exception. The canonical form, rule by rule:
docs/http-contract.md (The fingerprint), and ``default_fingerprint``'s docstring.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from json.encoder import encode_basestring
from typing import Any, cast
from urllib.parse import parse_qsl
from uuid import UUID

from django.conf import settings
from django.core.exceptions import SuspiciousOperation
from django.core.files import uploadhandler
from django.core.files.uploadedfile import UploadedFile
from django.http import HttpRequest, QueryDict
from django.http.multipartparser import MultiPartParser, MultiPartParserError
from django.http.request import RawPostDataException
from django.utils.datastructures import MultiValueDict
from django.utils.duration import duration_iso_string
from django.utils.functional import Promise

Fingerprinter = Callable[[HttpRequest], "str | bytes | None"]

# The version of the canonical form: stored with each fingerprint so that a later change of
# the form is recognised as such rather than as a different request.
FINGERPRINT_VERSION = 2

# Deeper JSON is compared as bytes. Without a limit of our own, whether a deep body parses
# would depend on how much of the recursion limit the caller's stack has already used, and
# the same body could get two fingerprints.
MAX_JSON_DEPTH = 128

# The column's width (models.IdempotencyRecord.fingerprint).
FINGERPRINT_MAX_LENGTH = 80


def media_type(request: HttpRequest) -> str:
    """``application/json`` for ``application/json; charset=utf-8`` (Django's
    ``content_type`` has no parameters; Django REST framework's ``Request`` keeps them)."""
    return (request.content_type or "").split(";", 1)[0].strip().lower()


# -- fingerprints ---------------------------------------------------------------------------


def default_fingerprint(
    request: HttpRequest,
    endpoint: str,
    fields: Sequence[str] | None = None,
    body: Fingerprinter | None = None,
) -> str:
    """``"2:"`` and a SHA-256 over method, endpoint, query string, media type and body, each
    in the canonical form below.

    ``default_fingerprint`` returns ``"2:"`` and a SHA-256 (hex) over length-prefixed parts:
    method, endpoint, query string, media type and body, each in a canonical form, so that what
    a retry may change (key order, whitespace, a multipart boundary) does not count and
    anything the view could act on does. The ``2`` is the version of this canonical form;
    digests with no prefix (64 hex characters) are version 1. ``fingerprints_match`` compares a
    stored fingerprint with a fresh one across versions. A project's own ``FINGERPRINT`` value
    is stored namespaced (``custom_fingerprint``), so it never reads as a version.

    - **Query string**: percent-decoded pairs, sorted by name only, so ``?a=1&b=2`` is
      ``?b=2&a=1`` but ``?a=1&a=2`` is not ``?a=2&a=1`` (repeated values keep their order,
      as ``request.GET.getlist`` does). Bytes decode as Latin-1, which maps each byte to one
      character, so two different invalid UTF-8 values never compare equal.
    - **Media type**: without parameters (``application/json; charset=utf-8`` is
      ``application/json``; a multipart boundary is not part of it). A form sent as multipart and
      the same fields sent URL-encoded are different media types, so different requests.
    - **JSON** (``application/json``, ``*+json``): parsed as RFC 8259 JSON and written back
      with sorted keys and no whitespace. Numbers are compared by exact decimal value: ``1``,
      ``1.0``, ``1e0`` and ``10e-1`` are one number (JSON defines no integer/float
      distinction), ``0.1`` and ``0.1000000000000000055511151231257827`` are two (a float
      would round them to one). Of duplicate object keys the last wins, as in ``json.loads``.
      A body that is not RFC 8259 JSON (not strict UTF-8, a byte order mark, ``NaN`` or
      ``Infinity``, a number beyond ``decimal``'s range, nesting deeper than
      ``MAX_JSON_DEPTH``) is compared byte for byte.
    - **URL-encoded forms**: field names sorted, each field's values in the order sent.
    - **Multipart forms**: the fields as Django parses them (what the view sees: a field's
      invalid UTF-8 is replaced, as in ``request.POST``), and for each uploaded file its name,
      content type, charset and the SHA-256 of its contents, read in chunks (an upload Django
      spooled to disk is never held in memory) and rewound for the view. A body whose
      ``Content-Length`` fits ``DATA_UPLOAD_MAX_MEMORY_SIZE`` is read into ``request.body``
      first, so a view can still read the raw body (to check a signature over it) as well
      as ``request.POST``/``FILES``; a larger one is parsed from the stream (reading it whole
      would refuse it), after which Django refuses ``request.body`` as after any
      ``request.POST``. A body parsed earlier (``CsrfViewMiddleware`` reads
      ``request.POST``) gives the same fingerprint as one parsed here. As under
      ``CsrfViewMiddleware``, the view can then no longer change ``request.upload_handlers``.
      A ``POST`` Django cannot parse raises ``MultiPartParserError`` (a 400), as the view's own
      access would. Other methods, which Django does not parse, are fingerprinted from a
      parsed copy of ``request.body``. With DRF's ``Request``, DRF's parsers do the parsing.
    - **Other media types**: the body's bytes.
    - ``fingerprint_fields`` keeps only the named fields of a JSON object or a form; a field
      that is absent differs from one that is ``null`` (or empty).
    - A ``fingerprint=`` callable's str (UTF-8) or bytes replace the body.

    Each body form is tagged with its kind (``json``, ``form``, ``multipart``, ``raw``, …), so a
    canonical form never equals another kind's bytes. Hostile bodies (deep nesting, huge
    numbers, invalid UTF-8, lone surrogates, NUL bytes) get a fingerprint, never an exception.
    A body whose stream was read before the fingerprint (not through ``request.body``) has
    nothing left to fingerprint: DRF's parsed ``request.data`` stands in for it, and a plain
    request raises ``RawPostDataException`` rather than count every such body as one request.

    ``fields`` limits the body to the named fields; ``body`` replaces the body part with
    what a view-supplied callable returns. ``request`` may be Django REST framework's
    ``Request``: its parsed data is then what the view will see.
    """
    content = body(request) if body is not None else None
    if content is None:
        body_part = canonical_body(request, fields)
    else:
        raw = content.encode("utf-8", "surrogatepass") if isinstance(content, str) else content
        body_part = b"custom:" + raw
    return _versioned(
        digest(
            (request.method or "").encode(),
            endpoint.encode("utf-8", "surrogatepass"),
            _canonical_query(request.META.get("QUERY_STRING", "")),
            media_type(request).encode(),
            body_part,
        )
    )


def task_fingerprint(endpoint: str, work: Any, label: str) -> str:
    """``"2:"`` and a SHA-256 over a task's endpoint and the canonical form of its work.

    ``bytes`` count as they are. Anything else is written like JSON with sorted keys:
    ``datetime``, ``date``, ``time`` (to the microsecond, with their UTC offset),
    ``timedelta``, ``UUID`` are tagged so none equals a string with the same text, numbers
    (``int``, ``float``, ``Decimal``) compare by exact value as Python's ``==`` does
    (``1 == 1.0 == Decimal("1")``; ``0.1`` is the float's exact binary value, not
    ``Decimal("0.1")``), tuples are lists and lazy strings are strings.

    Raises ``TypeError`` naming ``label`` (and, for a dict of arguments, the argument) when
    the work holds anything else, a non-finite number or a cycle.
    """
    if isinstance(work, bytes):
        kind, payload = b"bytes", work
    else:
        kind, payload = b"json", _task_json(work, label)
    return _versioned(digest(b"task", endpoint.encode("utf-8", "surrogatepass"), kind, payload))


def custom_fingerprint(value: object) -> str:
    """A project's own ``FINGERPRINT`` value as stored: ``"custom:"`` and the value, or
    ``"custom-sha256:"`` and its SHA-256 when the value would not fit the column.

    The namespace keeps a project's value from ever reading as one of the library's
    versioned fingerprints (``"100:EUR"`` is not version 100 of anything), so custom values
    are compared by equality only.
    """
    text = str(value)
    if len(_CUSTOM) + len(text) <= FINGERPRINT_MAX_LENGTH:
        return _CUSTOM + text
    return _CUSTOM_DIGEST + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def fingerprints_match(stored: str, current: str) -> bool:
    """Whether ``current`` fingerprints the same request as ``stored``.

    Equal strings match. Two fingerprints the library produced, of *different versions* of
    the canonical form (``"N:"`` and 64 hex characters, or 64 hex characters alone for
    version 1), cannot be compared, and count as a match: a client retrying across an
    upgrade, with a request the first attempt already claimed or completed, must get that
    outcome (a replay, or a 409), not a 422 for a mismatch that is only a change of
    canonical form. The window closes on its own: once the records written before the
    upgrade expire, every stored fingerprint has the current version.

    A custom fingerprint (``custom_fingerprint``) matches only the same value, including
    the value as an earlier release stored it, without the namespace. Anything else that
    differs does not match.
    """
    if stored == current:
        return True
    if current.startswith(_CUSTOM_NAMESPACES):
        return _same_custom_value(stored, current)
    stored_version, current_version = _version(stored), _version(current)
    return (
        stored_version is not None
        and current_version is not None
        and stored_version != current_version
    )


_CUSTOM = "custom:"
_CUSTOM_DIGEST = "custom-sha256:"
_CUSTOM_NAMESPACES = (_CUSTOM, _CUSTOM_DIGEST)
# Only what the library writes: a project's "100:EUR" or "3:abc" is never a version.
_VERSIONED = re.compile(r"([1-9][0-9]{0,8}):[0-9a-f]{64}")
_LEGACY = re.compile(r"[0-9a-f]{64}")


def _version(fingerprint: str) -> int | None:
    match = _VERSIONED.fullmatch(fingerprint)
    if match:
        return int(match.group(1))
    return 1 if _LEGACY.fullmatch(fingerprint) else None


def _same_custom_value(stored: str, current: str) -> bool:
    """Whether ``stored`` is the custom value ``current`` names, as the previous release
    stored it: the value itself, or ``"sha256:"`` and its digest when over the column's
    length (``fit``). A namespaced stored value matches only when equal."""
    if stored.startswith(_CUSTOM_NAMESPACES):
        return False
    if current.startswith(_CUSTOM_DIGEST):
        hexdigest = current[len(_CUSTOM_DIGEST) :]
        return (
            stored == "sha256:" + hexdigest
            or hashlib.sha256(stored.encode("utf-8", "surrogatepass")).hexdigest() == hexdigest
        )
    return stored == current[len(_CUSTOM) :]


def _versioned(hexdigest: str) -> str:
    return f"{FINGERPRINT_VERSION}:{hexdigest}"


def digest(*parts: bytes) -> str:
    """SHA-256 over length-prefixed parts, so no two different part lists collide by joining."""
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(len(part).to_bytes(8, "big"))
        hasher.update(part)
    return hasher.hexdigest()


def _canonical_query(query_string: str) -> bytes:
    """The query string's pairs, stable-sorted by name: parameter order doesn't count, the
    order of one name's values does."""
    if not query_string:
        return b"[]"  # what the general case writes for no pairs, without building it
    pairs = sorted(_parse_pairs(query_string), key=lambda pair: pair[0])
    return _encode([list(pair) for pair in pairs])


def canonical_body(request: HttpRequest, fields: Sequence[str] | None = None) -> bytes:
    """The body's kind and canonical form, ``b"<kind>:<form>"`` (``default_fingerprint``
    describes it).

    Raises ``RawPostDataException`` for a plain Django request whose (non-form) body was
    read from its stream before: nothing is left to fingerprint, and treating every such
    body as the same request would replay one client's response to another request.
    """
    content_type = media_type(request)
    if content_type == "multipart/form-data":
        return _multipart(request, fields)
    try:
        body = request.body
    except RawPostDataException:
        if not _is_drf(request):
            raise RawPostDataException(
                "The request body was read from its stream before the fingerprint could "
                "see it; read request.body instead of the stream, or give the view a "
                "fingerprint= callable."
            ) from None
        # A DRF parser that reads the stream itself (not JSONParser or FormParser):
        # fingerprint what it parsed, which is what the view will see.
        data = _plain(cast(Any, request).data)
        return b"data:" + _encode(_pick(data, fields), _data_value)
    if content_type == "application/json" or content_type.endswith("+json"):
        parsed = _parse_json(body)
        if parsed is _UNPARSED:
            return b"raw:" + body
        try:
            return b"json:" + _encode(_pick(parsed, fields), max_depth=MAX_JSON_DEPTH)
        except _TooDeep:
            return b"raw:" + body
    if content_type == "application/x-www-form-urlencoded":
        form = _pairs_to_dict(_parse_pairs(body.decode("latin-1")))
        return b"form:" + _encode(_pick(form, fields))
    return b"raw:" + body


def _pick(parsed: Any, fields: Sequence[str] | None) -> Any:
    """The named fields of an object; a field that is absent stays absent (unlike ``null``)."""
    if fields is None or not isinstance(parsed, dict):
        return parsed
    return {name: parsed[name] for name in fields if name in parsed}


# -- JSON -----------------------------------------------------------------------------------

_UNPARSED: Any = object()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _parse_json(body: bytes) -> Any:
    try:
        # Strict UTF-8, as RFC 8259 requires: json.loads(bytes) would also take UTF-16, a
        # byte order mark, and encoded surrogates (ED A0 80) as if they were \ud800.
        text = body.decode("utf-8")
        return json.loads(
            text, parse_float=Decimal, parse_int=Decimal, parse_constant=_reject_constant
        )
    # ValueError: invalid UTF-8, not JSON, NaN or Infinity; ArithmeticError: an exponent
    # beyond decimal's range; RecursionError: nesting too deep for the parser.
    except (ValueError, ArithmeticError, RecursionError):
        return _UNPARSED


# -- forms ----------------------------------------------------------------------------------


def _parse_pairs(encoded: str) -> list[tuple[str, str]]:
    # Latin-1 maps every percent-escaped byte to one character, so two different invalid
    # UTF-8 values never decode to the same replacement character.
    return parse_qsl(encoded, keep_blank_values=True, encoding="latin-1")


def _pairs_to_dict(pairs: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    result: dict[str, list[str]] = {}
    for name, value in pairs:
        result.setdefault(name, []).append(value)
    return result


def _multipart(request: HttpRequest, fields: Sequence[str] | None) -> bytes:
    """Fields and file digests of a multipart body, whoever parses it and whatever its
    boundary.

    The parse is the one the view gets: DRF's parsers for a DRF ``Request``, Django's
    ``request.POST``/``FILES`` for a plain ``POST`` (already parsed or parsed now). A body
    that parser rejects raises as it would in the view (400), rather than letting the view
    run with the empty data Django and DRF leave behind. Where nobody would parse it
    (Django parses ``POST`` only; a DRF view without a multipart parser), a copy of the
    body is parsed and the request is left as it was.
    """
    _read_body_if_it_fits(cast(Any, request)._request if _is_drf(request) else request)
    if _is_drf(request):
        from rest_framework.exceptions import UnsupportedMediaType

        try:
            return _canonical_form(request.POST, request.FILES, fields)
        except UnsupportedMediaType:
            return _multipart_copy(cast(Any, request)._request, fields)
    if request.method == "POST":
        return _canonical_form(request.POST, request.FILES, fields)
    return _multipart_copy(request, fields)


def _read_body_if_it_fits(request: HttpRequest) -> None:
    """Read ``request.body`` before a multipart body is parsed, when its ``Content-Length``
    fits ``DATA_UPLOAD_MAX_MEMORY_SIZE`` (Django's own bound on a body held in memory;
    ``FILE_UPLOAD_MAX_MEMORY_SIZE`` where that is ``None``).

    Parsing reads the stream, after which Django refuses ``request.body``: a view that
    verifies a signature over the raw body (a webhook) would fail. Parsed from the body
    read here, the view has both. A larger body, or one without a ``Content-Length``, is
    left to stream (an upload spooled to disk is never held in memory); a view reading its
    ``request.body`` gets Django's ``RawPostDataException``, as after ``request.POST``.
    """
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    if limit is None:
        limit = settings.FILE_UPLOAD_MAX_MEMORY_SIZE
    try:
        length = int(request.META.get("CONTENT_LENGTH") or "")
    except ValueError:
        return
    if 0 <= length <= limit:
        # Parsed before (CsrfViewMiddleware reads request.POST): nothing left to keep.
        with contextlib.suppress(RawPostDataException):
            request.body  # noqa: B018 - read and kept by Django for the parse and the view


def _multipart_copy(request: HttpRequest, fields: Sequence[str] | None) -> bytes:
    try:
        body = request.body
    except RawPostDataException:
        # Parsed by the application itself: what it left in POST and FILES is all there is.
        return _canonical_form(request.POST, request.FILES, fields)
    handlers = [uploadhandler.load_handler(path, request) for path in settings.FILE_UPLOAD_HANDLERS]
    try:
        post, files = MultiPartParser(
            request.META, io.BytesIO(body), handlers, request.encoding
        ).parse()
    except (MultiPartParserError, SuspiciousOperation):
        return b"raw:" + body  # the view, parsing it itself, would fail too
    try:
        return _canonical_form(post, files, fields)
    finally:
        for _name, uploads in files.lists():
            for upload in uploads:
                upload.close()  # the copy's temporary files go with it


def _canonical_form(
    post: QueryDict, files: MultiValueDict[str, UploadedFile[Any]], fields: Sequence[str] | None
) -> bytes:
    field_names = list(post) if fields is None else [name for name in fields if name in post]
    file_names = list(files) if fields is None else [name for name in fields if name in files]
    form = {
        "fields": {name: post.getlist(name) for name in field_names},
        "files": {name: [_upload(upload) for upload in files.getlist(name)] for name in file_names},
    }
    return b"multipart:" + _encode(form)


def _upload(upload: UploadedFile[Any]) -> list[str | None]:
    return [upload.name, upload.content_type, upload.charset, _file_digest(upload)]


def _file_digest(upload: UploadedFile[Any]) -> str:
    """SHA-256 of an upload's contents, read chunk by chunk (an upload spooled to a temporary
    file is never read into memory whole), then rewound so the view reads it from the start."""
    hasher = hashlib.sha256()
    for chunk in upload.chunks():
        hasher.update(chunk)
    upload.seek(0)
    return hasher.hexdigest()


# -- Django REST framework ------------------------------------------------------------------


def _is_drf(request: Any) -> bool:
    """A wrapper around an ``HttpRequest`` (DRF's ``Request``), recognised without importing
    DRF, which is optional."""
    return not isinstance(request, HttpRequest) and isinstance(
        getattr(request, "_request", None), HttpRequest
    )


def _plain(data: Any) -> Any:
    """DRF's parsed data with ``QueryDict``s as ``{name: [values]}`` (every value counts)."""
    if isinstance(data, MultiValueDict):
        return {name: data.getlist(name) for name in data}
    return data


def _data_value(value: Any) -> str:
    """Canonical text for what a DRF parser may put in ``request.data`` beyond JSON types;
    never raises, since it stands in for a request body."""
    if isinstance(value, UploadedFile):
        return "file:" + _encode(_upload(value)).decode("utf-8", "surrogatepass")
    if isinstance(value, (float, Decimal)):  # non-finite: finite ones never get here
        return str(value)
    try:
        return _django_value(value)
    except TypeError:
        text = f"{type(value).__module__}.{type(value).__qualname__}:{value}"
        return "object:" + encode_basestring(text)


# -- tasks ----------------------------------------------------------------------------------


def _task_json(work: Any, label: str) -> bytes:
    try:
        return _encode(work)
    except (TypeError, ValueError) as error:
        culprit = ""
        if isinstance(work, dict):
            for arg, value in work.items():
                try:
                    _encode(value)
                except (TypeError, ValueError):
                    culprit = f" (argument {arg!r}, a {type(value).__name__})"
                    break
        raise TypeError(
            f"{label}: cannot fingerprint its arguments{culprit}: {error}. Name the "
            "arguments that define the work with fingerprint_args=, or give fingerprint=."
        ) from error


def _django_value(value: Any) -> str:
    """Canonical text for the types Django's JSON encoder accepts beyond JSON's own, at full
    precision (Django's encoder cuts datetimes and times to milliseconds)."""
    if isinstance(value, datetime):
        return "datetime:" + encode_basestring(value.isoformat())
    if isinstance(value, date):
        return "date:" + encode_basestring(value.isoformat())
    if isinstance(value, time):
        return "time:" + encode_basestring(value.isoformat())
    if isinstance(value, timedelta):
        return "timedelta:" + encode_basestring(duration_iso_string(value))
    if isinstance(value, UUID):
        return "uuid:" + encode_basestring(str(value))
    if isinstance(value, Promise):
        return encode_basestring(str(value))
    if isinstance(value, (float, Decimal)):
        raise ValueError(f"Out of range float values are not JSON compliant: {value!r}")
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# -- the canonical writer -------------------------------------------------------------------


class _TooDeep(Exception):
    pass


class _Close:
    """The end of a container, queued on the writer's stack: leaves the path that cycle
    detection and the depth limit look at."""

    __slots__ = ("ident", "text")

    def __init__(self, text: str, ident: int) -> None:
        self.text = text
        self.ident = ident


def _encode(
    value: Any,
    other: Callable[[Any], str] = _django_value,
    *,
    max_depth: int | None = None,
) -> bytes:
    """Write ``value`` like compact JSON with sorted keys, numbers by exact value, and
    ``other(value)`` for anything else (and for non-finite numbers). Request bodies parse to
    JSON types only; the default writes Django's JSON encoder's types, or raises.

    Iterative rather than recursive, so a structure ``json.loads`` managed to build (or a
    task argument) is never too deep to write. Raises ``_TooDeep`` past ``max_depth``,
    ``ValueError`` for a cycle, ``TypeError`` for a key that is not a str, int, float, bool
    or None, or for keys of types that cannot be sorted together (as ``json.dumps`` does).
    """
    text = _scalar(value, other)
    if text is not None:
        return text.encode("utf-8", "surrogatepass")
    out: list[str] = []
    # The stack holds text ready to write (str), containers still to open, and _Close.
    todo: list[Any] = [value]
    path: set[int] = set()
    while todo:
        item = todo.pop()
        if type(item) is str:
            out.append(item)
            continue
        if type(item) is _Close:
            out.append(item.text)
            path.discard(item.ident)
            continue
        ident = id(item)
        if ident in path:
            raise ValueError("Circular reference detected")
        path.add(ident)
        if max_depth is not None and len(path) > max_depth:
            raise _TooDeep
        parts: list[Any] = []
        if isinstance(item, dict):
            separator = "{"
            for key, member in sorted(item.items(), key=_first):
                head = separator + _key(key) + ":"
                text = _scalar(member, other)
                parts.extend((head, member) if text is None else (head + text,))
                separator = ","
            closing = "}"
        else:
            separator = "["
            for member in item:
                text = _scalar(member, other)
                parts.extend((separator, member) if text is None else (separator + text,))
                separator = ","
            closing = "]"
        if separator != ",":
            parts.append(separator)  # empty: just the opening
        parts.append(_Close(closing, ident))
        parts.reverse()
        todo.extend(parts)
    return "".join(out).encode("utf-8", "surrogatepass")


def _first(item: tuple[Any, Any]) -> Any:
    return item[0]


def _scalar(value: Any, other: Callable[[Any], str]) -> str | None:
    """The text of anything but a container (``None`` for a dict, list or tuple)."""
    kind = type(value)
    if kind is str:
        return encode_basestring(value)
    if kind is dict or kind is list or kind is tuple:
        return None
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, str):
        return encode_basestring(value)
    if isinstance(value, (int, float, Decimal)):
        number = _number(value)
        return number if number is not None else other(value)
    if isinstance(value, (dict, list, tuple)):
        return None
    return other(value)


def _key(key: Any) -> str:
    """An object key: strings quoted, other keys ``json.dumps`` accepts written unquoted, so
    ``{1: …}`` and ``{"1": …}`` stay apart."""
    if isinstance(key, str):
        return encode_basestring(key)
    if key is None or key is True or key is False:
        return "null" if key is None else "true" if key else "false"
    if isinstance(key, (int, float)):
        number = _number(key)
        if number is None:
            raise ValueError(f"Out of range float values are not JSON compliant: {key!r}")
        return number
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")


def _number(value: int | float | Decimal) -> str | None:
    """A number's exact value as ``<digits>`` or ``<digits>e<exponent>``, with no trailing
    zeros in the digits: one spelling per value (``1``, ``1.0``, ``1e0`` → ``1``; ``-0`` →
    ``0``; ``0.1`` → ``1e-1``; ``10**400`` → ``1e400``). ``None`` for NaN and infinities."""
    if isinstance(value, int):
        if value % 10 and -_PLAIN_INT < value < _PLAIN_INT:
            return str(value)  # the common case, already canonical
        value = Decimal(value)  # unlike str(), no limit on the number of digits
    elif isinstance(value, float):
        if not math.isfinite(value):
            return None
        value = Decimal(value)  # exact: the float's binary value
    elif not value.is_finite():
        return None
    # "e" with no precision writes every digit of the coefficient: d.ddd…e±x, exactly.
    mantissa, _, exponent = format(value, "e").partition("e")
    sign = "-" if mantissa.startswith("-") else ""
    digits = mantissa.lstrip("-").replace(".", "")
    significant = digits.rstrip("0")
    if not significant:
        return "0"
    power = int(exponent) - len(significant) + 1
    return f"{sign}{significant}" if power == 0 else f"{sign}{significant}e{power}"


_PLAIN_INT = 10**4000  # below sys.get_int_max_str_digits()'s default of 4300
