"""The fingerprint: what tells a retry from a different request that reuses its key.

``default_fingerprint`` is ``"3:"`` and an HMAC, keyed with a secret derived from
``SECRET_KEY``, of the SHA-256 over the method, endpoint, query string, media type and body,
each in a canonical form, so that what a retry may change (key order, whitespace, a multipart
boundary) does not count and anything the view could act on does. Keyed, because a plain
digest of a short body (a PIN) is undone by guessing. ``task_fingerprint`` does the same for
a task's work; ``custom_fingerprint`` for a project's own value; ``fingerprints_match``
compares across versions of the form and across ``SECRET_KEY_FALLBACKS``. Hostile bodies
get a fingerprint, never an exception, and cost no more than Django's own limits allow.
The canonical form, rule by rule: docs/http-contract.md (The fingerprint); the key and its
rotation: docs/security.md.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import io
import json
import logging
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
from django.utils.crypto import salted_hmac
from django.utils.datastructures import MultiValueDict
from django.utils.duration import duration_iso_string
from django.utils.encoding import force_bytes
from django.utils.functional import Promise

Fingerprinter = Callable[[HttpRequest], "str | bytes | None"]

logger = logging.getLogger("idempotency_django")

# The version of the stored form: stored with each fingerprint so that a later change of the
# form is recognised as such rather than as a different request. 1: a bare SHA-256; 2: "2:"
# and a SHA-256; 3: "3:", the id of the key (8 hex) and an HMAC keyed with it (56 hex).
FINGERPRINT_VERSION = 3

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
    """``"3:"`` and a keyed digest of method, endpoint, query string, media type and body,
    each in the canonical form below.

    The parts are length-prefixed and hashed (SHA-256), and that digest is signed with an
    HMAC-SHA256 keyed with a secret derived from ``SECRET_KEY`` (``salted_hmac``): the
    stored value is ``"3:"``, 8 hex digits naming the key (so a record written under a key
    now in ``SECRET_KEY_FALLBACKS`` is recognised) and 56 hex digits of the HMAC. Without
    the key, nobody holding the value (the admin, a backup, Redis) can test guesses of the
    body against it. The ``3`` is the version of this form; ``"2:"`` and a plain SHA-256
    (version 2), and 64 hex characters alone (version 1), were stored by earlier releases.
    ``fingerprints_match`` compares a stored fingerprint with a fresh one across versions and
    keys. A project's own ``FINGERPRINT`` value is keyed the same way
    (``custom_fingerprint``), never stored as it is.

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
      Numbers are compared as Django would let a view read them at most: a body of more
      values than ``DATA_UPLOAD_MAX_NUMBER_FIELDS`` (every number, string, ``true``,
      ``false``, ``null``, object and array counts, the body itself too) is compared byte for
      byte, so a hostile body costs one parse in C, not a canonical form of a million values.
    - **URL-encoded forms**: field names sorted, each field's values in the order sent; a
      form of more fields than ``DATA_UPLOAD_MAX_NUMBER_FIELDS`` (where Django's
      ``request.POST`` refuses it) is compared byte for byte. The query string likewise.
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
    return _fingerprint(
        _material(
            (request.method or "").encode(),
            endpoint.encode("utf-8", "surrogatepass"),
            _canonical_query(request.META.get("QUERY_STRING", "")),
            media_type(request).encode(),
            body_part,
        )
    )


def task_fingerprint(endpoint: str, work: Any, label: str) -> str:
    """``"3:"`` and a keyed digest (as ``default_fingerprint``'s) of a task's endpoint and
    the canonical form of its work.

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
    return _fingerprint(
        _material(b"task", endpoint.encode("utf-8", "surrogatepass"), kind, payload)
    )


def custom_fingerprint(value: object) -> str:
    """A project's own ``FINGERPRINT`` value as stored: keyed as the library's own
    fingerprints are (``"3:"``, the key's id, an HMAC of the tagged value), so a short value
    (a PIN, an amount) is never kept where it could be read or guessed back.

    Compared by equality only: it matches the same value, including the value as earlier
    releases stored it (``"custom:"`` and the value, ``"custom-sha256:"`` and its SHA-256;
    before that the value itself, or ``"sha256:"`` and its digest), and never a fingerprint
    of the library's canonical form.
    """
    raw = str(value).encode("utf-8", "surrogatepass")
    return _fingerprint(_material(b"custom", raw), custom=hashlib.sha256(raw).hexdigest())


def fingerprints_match(stored: str, current: str) -> bool:
    """Whether ``current`` fingerprints the same request as ``stored``.

    Equal strings match. ``current`` as this release makes it (a ``Fingerprint``) also
    matches ``stored`` when:

    - ``stored`` is the same request keyed with a key in ``SECRET_KEY_FALLBACKS`` (its id
      names the key: the digest is computed again with it);
    - ``stored`` was keyed with a key this server does not hold (``SECRET_KEY`` was rotated
      without keeping the old one in the fallbacks): it cannot be compared, and counts as a
      match, logged once per key and process;
    - ``stored`` is of another version of the canonical form (``"2:"`` and 64 hex
      characters, 64 hex characters alone for version 1, or a later version during a
      rollback): it cannot be compared either, and counts as a match.

    Both "cannot compare" rules exist for one reason: a client retrying across an upgrade or
    a key rotation, with a request the first attempt already claimed or completed, must get
    that outcome (a replay, or a 409), not a 422 for a mismatch that is only a change of
    form or key, which a client would take for a failure and might send again under a new
    key. Neither can run a view twice: the record keeps its key. The window closes on its
    own once the records written before the change expire. A project's own value
    (``custom_fingerprint``) never counts as another version: it matches only the same
    value, in any form a release stored it.

    Plain strings (no ``Fingerprint``) are compared by their form alone: equal, the same
    custom value, or two different versions of the library's form.
    """
    if stored == current:
        return True
    if isinstance(current, Fingerprint):
        return current.matches(stored)
    custom = _custom_digest(current)
    if custom is not None:
        return _same_custom_value(stored, custom)
    stored_version, current_version = _version(stored), _version(current)
    return (
        stored_version is not None
        and current_version is not None
        and stored_version != current_version
    )


class Fingerprint(str):
    """A fingerprint as stored (this string: only the keyed digest is ever written), which
    also remembers what it was computed from, in memory, to recognise the same request in a
    record keyed with a fallback key (``fingerprints_match``).

    Pickled or copied, it is the plain string.
    """

    material: bytes  # the SHA-256 of the canonical parts: never stored
    custom: str | None  # a project's own value: the SHA-256 (hex) of its text

    def __reduce__(self) -> tuple[Any, ...]:
        return (str, (str(self),))

    def matches(self, stored: str) -> bool:
        """``fingerprints_match(stored, self)``, for a fingerprint this release made."""
        if stored == self:
            return True
        version = _version(stored)
        if version == FINGERPRINT_VERSION:
            secret = _secret_named(stored[2:10])
            if secret is None:
                _report_unknown_key(stored[2:10])
                return True
            if hmac.compare_digest(stored, _keyed(self.material, secret)):
                return True
        elif self.custom is None:
            return version is not None
        # A project's value as an earlier release stored it (which may look like anything).
        return self.custom is not None and _same_custom_value(stored, self.custom)


def fingerprint_display(stored: str) -> str:
    """What the admin shows of a stored fingerprint: never the value itself (a plain digest
    of an earlier release can be guessed back), only a short prefix of a keyed one, and the
    key it was keyed with."""
    if _version(stored) != FINGERPRINT_VERSION:
        return "written by an earlier release, unkeyed: not shown"
    key_id, mac = stored[2:10], stored[10:22]
    secret = _secret_named(key_id)
    if secret is None:
        key = "a key this server does not hold"
    elif secret == settings.SECRET_KEY:
        key = "SECRET_KEY"
    else:
        key = "a key in SECRET_KEY_FALLBACKS"
    return f"{mac}… (keyed with {key}, id {key_id})"


_SALT = "idempotency_django.fingerprint"
_KEY_ID_SALT = "idempotency_django.fingerprint.key-id"


def _material(*parts: bytes) -> bytes:
    """SHA-256 over length-prefixed parts (each part's length as 8 bytes, big-endian, then
    the part): what the keyed digest signs."""
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(len(part).to_bytes(8, "big"))
        hasher.update(part)
    return hasher.digest()


def _fingerprint(material: bytes, custom: str | None = None) -> Fingerprint:
    fingerprint = Fingerprint(_keyed(material, settings.SECRET_KEY))
    fingerprint.material = material
    fingerprint.custom = custom
    return fingerprint


def _keyed(material: bytes, secret: str | bytes) -> str:
    """``"3:"``, the key's id and an HMAC-SHA256 of ``material`` (truncated to 224 bits, so
    that the whole is 66 characters like version 2: an earlier release reads it as another
    version, not as a different request). The HMAC is ``salted_hmac(_SALT, material,
    secret, algorithm="sha256")``, with its derived key computed once per secret."""
    key_id, derived = _derived(secret)
    mac = hmac.digest(derived, material, "sha256").hex()
    return f"{FINGERPRINT_VERSION}:{key_id}{mac[:56]}"


@functools.lru_cache(maxsize=16)
def _derived(secret: str | bytes) -> tuple[str, bytes]:
    """The secret's id and the key ``salted_hmac`` derives from it for ``_SALT``."""
    return _key_id(secret), hashlib.sha256(_SALT.encode() + force_bytes(secret)).digest()


def _key_id(secret: str | bytes) -> str:
    """8 hex digits naming a secret key without revealing it (an HMAC of nothing)."""
    return salted_hmac(_KEY_ID_SALT, b"", secret=secret, algorithm="sha256").hexdigest()[:8]


def _secret_named(key_id: str) -> str | bytes | None:
    """The key among ``SECRET_KEY`` and ``SECRET_KEY_FALLBACKS`` whose id is ``key_id``."""
    for secret in (settings.SECRET_KEY, *getattr(settings, "SECRET_KEY_FALLBACKS", ())):
        if _derived(secret)[0] == key_id:
            return secret  # type: ignore[no-any-return]
    return None


_unknown_keys: set[str] = set()


def _report_unknown_key(key_id: str) -> None:
    if key_id in _unknown_keys:
        return
    _unknown_keys.add(key_id)
    logger.warning(
        "A stored fingerprint was keyed with a secret key this server does not hold (key id "
        "%s: neither SECRET_KEY nor one of SECRET_KEY_FALLBACKS). It cannot be compared and "
        "counts as the same request until it expires: keep a rotated key in "
        "SECRET_KEY_FALLBACKS for TTL_SECONDS to keep telling other requests apart.",
        key_id,
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


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _custom_digest(fingerprint: str) -> str | None:
    """The SHA-256 of the project's value that a custom fingerprint of the previous release
    names (``"custom:"`` and the value, or ``"custom-sha256:"`` and its digest), or None."""
    if fingerprint.startswith(_CUSTOM_DIGEST):
        return fingerprint[len(_CUSTOM_DIGEST) :]
    if fingerprint.startswith(_CUSTOM):
        return _sha256(fingerprint[len(_CUSTOM) :])
    return None


def _same_custom_value(stored: str, value_digest: str) -> bool:
    """Whether ``stored`` is the custom value whose SHA-256 is ``value_digest``, in a form an
    earlier release stored it: namespaced (the previous release), or the value itself, or
    ``"sha256:"`` and its digest when over the column's length (``fit``: the one before)."""
    named = _custom_digest(stored)
    if named is not None:
        return named == value_digest
    return stored == "sha256:" + value_digest or _sha256(stored) == value_digest


def digest(*parts: bytes) -> str:
    """SHA-256 (hex) over length-prefixed parts, so no two different part lists collide by
    joining: unkeyed, what version 2 stored (``_material`` is what version 3 keys)."""
    return _material(*parts).hex()


def _canonical_query(query_string: str) -> bytes:
    """The query string's pairs, stable-sorted by name: parameter order doesn't count, the
    order of one name's values does. More pairs than ``DATA_UPLOAD_MAX_NUMBER_FIELDS``
    (Django refuses them in ``request.GET``): the string as it is."""
    if not query_string:
        return b"[]"  # what the general case writes for no pairs, without building it
    try:
        pairs = sorted(_parse_pairs(query_string), key=lambda pair: pair[0])
    except _TooMany:
        return b"raw:" + query_string.encode("latin-1", "backslashreplace")
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
        limit = _max_values()
        # Without fields, every value parsed is written: the parse may stop at the limit.
        parsed = _parse_json(body, limit if fields is None else None)
        if parsed is _UNPARSED:
            return b"raw:" + body
        try:
            return b"json:" + _encode(
                _pick(parsed, fields), max_depth=MAX_JSON_DEPTH, max_values=limit
            )
        except (_TooDeep, _TooMany):
            return b"raw:" + body
    if content_type == "application/x-www-form-urlencoded":
        try:
            form = _pairs_to_dict(_parse_pairs(body.decode("latin-1")))
        except _TooMany:
            return b"raw:" + body
        return b"form:" + _encode(_pick(form, fields))
    return b"raw:" + body


def _max_values() -> int | None:
    """Django's bound on the fields a request may make it parse, which the canonical form
    keeps too (``None``: no bound, as in Django)."""
    limit = settings.DATA_UPLOAD_MAX_NUMBER_FIELDS
    return None if limit is None else int(limit)


def _pick(parsed: Any, fields: Sequence[str] | None) -> Any:
    """The named fields of an object; a field that is absent stays absent (unlike ``null``)."""
    if fields is None or not isinstance(parsed, dict):
        return parsed
    return {name: parsed[name] for name in fields if name in parsed}


# -- JSON -----------------------------------------------------------------------------------

_UNPARSED: Any = object()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _parse_json(body: bytes, limit: int | None = None) -> Any:
    """The body parsed with every number exact, or ``_UNPARSED``. With a ``limit``, a body
    of more numbers and object members than that stops parsing there (``_UNPARSED``): each
    is a value the canonical form would write, so that body would be compared as bytes."""
    try:
        # Strict UTF-8, as RFC 8259 requires: json.loads(bytes) would also take UTF-16, a
        # byte order mark, and encoded surrogates (ED A0 80) as if they were \ud800.
        text = body.decode("utf-8")
    except ValueError:
        return _UNPARSED
    counted = _Counter(limit)
    try:
        try:
            # Integers as int, parsed in C (a Decimal per number cost a 2.5 MiB body
            # seconds); fractions as Decimal, exactly. Equal values write the same.
            return json.loads(
                text,
                parse_float=counted.decimal,
                object_hook=counted.members,
                parse_constant=_reject_constant,
            )
        except ValueError as error:
            if "Exceeds the limit" not in str(error):
                raise
            # An integer longer than this process lets int() read
            # (sys.set_int_max_str_digits): the same values as Decimals, whatever the limit.
            counted = _Counter(limit)
            return json.loads(
                text,
                parse_float=counted.decimal,
                parse_int=counted.decimal,
                object_hook=counted.members,
                parse_constant=_reject_constant,
            )
    # ValueError: not JSON, NaN or Infinity; ArithmeticError: an exponent beyond decimal's
    # range; RecursionError: nesting too deep for the parser; _TooMany: over the limit.
    except (ValueError, ArithmeticError, RecursionError, _TooMany):
        return _UNPARSED


class _TooMany(Exception):
    """More values than ``DATA_UPLOAD_MAX_NUMBER_FIELDS``: the body is compared as bytes."""


class _Counter:
    """Counts the values a JSON parse makes through its hooks, up to a limit."""

    __slots__ = ("left",)

    def __init__(self, limit: int | None) -> None:
        self.left = -1 if limit is None else limit

    def _count(self, n: int) -> None:
        if self.left >= 0:
            self.left -= n
            if self.left < 0:
                raise _TooMany

    def decimal(self, text: str) -> Decimal:
        self._count(1)
        return Decimal(text)

    def members(self, members: dict[str, Any]) -> dict[str, Any]:
        self._count(len(members))
        return members


# -- forms ----------------------------------------------------------------------------------


def _parse_pairs(encoded: str) -> list[tuple[str, str]]:
    """Raises ``_TooMany`` past ``DATA_UPLOAD_MAX_NUMBER_FIELDS`` fields, before parsing any."""
    # Latin-1 maps every percent-escaped byte to one character, so two different invalid
    # UTF-8 values never decode to the same replacement character.
    try:
        return parse_qsl(
            encoded, keep_blank_values=True, encoding="latin-1", max_num_fields=_max_values()
        )
    except ValueError as error:  # "Max number of fields exceeded"
        raise _TooMany from error


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
    max_values: int | None = None,
) -> bytes:
    """Write ``value`` like compact JSON with sorted keys, numbers by exact value, and
    ``other(value)`` for anything else (and for non-finite numbers). Request bodies parse to
    JSON types only; the default writes Django's JSON encoder's types, or raises.

    Iterative rather than recursive, so a structure ``json.loads`` managed to build (or a
    task argument) is never too deep to write. Raises ``_TooDeep`` past ``max_depth``,
    ``_TooMany`` past ``max_values`` values (``value`` and every member and item, counted
    as each container opens, before it is sorted), ``ValueError`` for a cycle,
    ``TypeError`` for a key that is not a str, int, float, bool or None, or for keys of
    types that cannot be sorted together (as ``json.dumps`` does).
    """
    text = _scalar(value, other)
    if text is not None:
        return text.encode("utf-8", "surrogatepass")
    left = -1 if max_values is None else max_values - 1  # the value itself
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
        if left >= 0:
            left -= len(item)
            if left < 0:
                raise _TooMany
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
