"""What happens to a response between the view and the store, and back: the
``RESPONSE_CODEC`` (encryption at rest) and the ``REDACT_RESPONSE`` hook.

``seal`` runs once per completed request, ``unseal`` once per replay; with neither setting
they are identities. A sealed body is bound to its record (status, account, endpoint, key),
so one copied into another record is refused, never replayed; one the codec cannot open is a
409, never garbage and never a second run. A response that cannot be redacted or encoded is
not stored (``UNSTORABLE``), and its key keeps its outcome: the view already ran.
Details: docs/stored-responses.md; resealing: docs/operations.md.
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from idempotency_django.conf import conf
from idempotency_django.core.keys import digest
from idempotency_django.core.responses import StoredResponse
from idempotency_django.exceptions import ResponseNotStored

if TYPE_CHECKING:
    from cryptography.fernet import MultiFernet
    from django.db.models import QuerySet

    from idempotency_django.models import IdempotencyRecord

logger = logging.getLogger("idempotency_django")

#: The prefix of a body stored through a codec. The NUL byte keeps it out of any text
#: response; the version tells the framings apart. Version 2 binds the frame to its record.
SEALED = b"\x00idempotency-django:sealed:2\n"
#: The prefix of a body sealed before frames were bound to their record (version 1): still
#: opened, without the check, until it expires or ``reseal_records`` binds it.
SEALED_UNBOUND = b"\x00idempotency-django:sealed:1\n"
#: The whole body of a record whose response could not be redacted or encoded.
UNSTORABLE = b"\x00idempotency-django:unstorable:1\n"

HOOKS = ("REDACT_RESPONSE", "REPLAY_HOOK", "ACCOUNT_DISPLAY", "ACCOUNT_SEARCH")


@runtime_checkable
class ResponseCodec(Protocol):
    """What ``RESPONSE_CODEC`` names: bytes in, bytes out, and back.

    ``decode`` must raise (any exception) on bytes it did not produce or cannot open:
    authenticated encryption such as Fernet does. A codec that returns garbage instead
    would have that garbage replayed only if it also parses as the framing around it.
    """

    def encode(self, data: bytes, /) -> bytes: ...

    def decode(self, data: bytes, /) -> bytes: ...


class ResponseUnreadable(ResponseNotStored):
    """The key's request completed and its response was stored sealed, but the configured
    ``RESPONSE_CODEC`` cannot open it. The view does not run again."""

    slug = "response-unreadable"
    title = "The request was processed but its stored response cannot be read"
    #: True when the response opens but was sealed for another record (another account,
    #: endpoint, key or status): a row was copied or altered. Answered all the same.
    misbound = False
    #: True when the response is bound to no record (stored in clear, or sealed before
    #: binding) and ``REQUIRE_BOUND_RESPONSES`` refuses such responses.
    unbound = False


class _Misbound(ValueError):
    """A bound frame whose binding is not its record's."""


@dataclass(frozen=True)
class Record:
    """What a sealed frame is bound to: the columns of its record the store keeps in clear."""

    status: int
    account: str
    endpoint: str
    key: str

    def binding(self) -> bytes:
        """A digest of the record's scope and status (hex, one line of the frame)."""
        return digest(
            b"idempotency-django:record",
            str(self.status).encode(),
            *(
                part.encode("utf-8", "surrogatepass")
                for part in (self.account, self.endpoint, self.key)
            ),
        ).encode()


class CryptographyMissing(ImproperlyConfigured):
    """``FernetCodec`` without the ``cryptography`` package."""


class EncryptionKeysInvalid(ImproperlyConfigured):
    """``ENCRYPTION_KEYS`` is missing, empty, or holds something that is not a Fernet key."""


# -- the codecs -------------------------------------------------------------------------------


class FernetCodec:
    """Fernet (AES-128-CBC with HMAC-SHA256, from ``cryptography``) under ``ENCRYPTION_KEYS``.

    The first key encrypts, every key decrypts (``MultiFernet``): to rotate, put a new key
    first and keep the old ones until every record they sealed has expired (``TTL_SECONDS``
    after the last process that still encrypted with them was restarted). A token sealed by
    a key no longer listed fails its HMAC: ``ResponseUnreadable``, never garbage.

    ``keys`` overrides the setting (for a codec built in code); by default the setting is
    read at each use, so ``override_settings`` applies.
    """

    def __init__(self, keys: Sequence[str | bytes] | None = None) -> None:
        self.keys = keys

    def encode(self, data: bytes, /) -> bytes:
        return self.fernet().encrypt(data)

    def decode(self, data: bytes, /) -> bytes:
        return self.fernet().decrypt(data)

    def fernet(self) -> MultiFernet:
        keys = conf.ENCRYPTION_KEYS if self.keys is None else self.keys
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            raise EncryptionKeysInvalid(
                "IDEMPOTENCY ENCRYPTION_KEYS must be a list of Fernet keys, newest first "
                f"(got a {type(keys).__name__})."
            )
        for index, key in enumerate(keys):
            if not isinstance(key, (str, bytes)):
                raise EncryptionKeysInvalid(
                    f"IDEMPOTENCY ENCRYPTION_KEYS[{index}] is a {type(key).__name__}, not a "
                    "Fernet key (a string)."
                )
        return _multi_fernet(tuple(keys))


@functools.lru_cache(maxsize=8)
def _multi_fernet(keys: tuple[Any, ...]) -> MultiFernet:
    """Built once per list of keys: a Fernet decodes and checks its key when built."""
    try:
        from cryptography.fernet import Fernet, MultiFernet
    except ImportError as error:
        raise CryptographyMissing(
            "IDEMPOTENCY RESPONSE_CODEC is the FernetCodec, which needs the cryptography "
            'package: pip install "idempotency-django[encryption]".'
        ) from error
    if not keys:
        raise EncryptionKeysInvalid(
            "IDEMPOTENCY ENCRYPTION_KEYS is empty: the FernetCodec needs at least one key."
        )
    fernets = []
    for index, key in enumerate(keys):
        try:
            fernets.append(Fernet(key))
        except (TypeError, ValueError) as error:
            # Never the key itself in a message: it may be nearly right, and it is a secret.
            raise EncryptionKeysInvalid(
                f"IDEMPOTENCY ENCRYPTION_KEYS[{index}] is not a Fernet key (32 bytes in "
                "url-safe base64, as Fernet.generate_key() makes)."
            ) from error
    return MultiFernet(fernets)


def get_codec() -> ResponseCodec | None:
    """The configured codec, or ``None`` (store the bytes as they are).

    ``RESPONSE_CODEC`` may be a codec object, a codec class (built with no arguments), or
    the dotted path of either; a path is resolved and built once per process.
    """
    value = conf.RESPONSE_CODEC
    if value is None:
        return None
    if isinstance(value, str):
        return _codec_at(value)
    return _as_codec(value, repr(value))


@functools.lru_cache(maxsize=8)
def _codec_at(path: str) -> ResponseCodec:
    try:
        value = import_string(path)
    except ImportError as error:
        raise ImproperlyConfigured(
            f"IDEMPOTENCY RESPONSE_CODEC: cannot import {path!r}: {error}"
        ) from error
    return _as_codec(value, repr(path))


def _as_codec(value: Any, name: str) -> ResponseCodec:
    codec = value() if isinstance(value, type) else value
    if not isinstance(codec, ResponseCodec):
        raise ImproperlyConfigured(
            f"IDEMPOTENCY RESPONSE_CODEC: {name} is not a codec (it needs encode(bytes) -> "
            "bytes and decode(bytes) -> bytes methods)."
        )
    return codec


# -- seal and unseal --------------------------------------------------------------------------


def seal(outcome: StoredResponse, *, account: str, endpoint: str, key: str) -> StoredResponse:
    """The outcome as it will be stored in the record of ``account``, ``endpoint`` and
    ``key``: redacted, then encoded, bound to that record."""
    user = conf.raw()  # one settings read on every completion (both default to None)
    if user.get("REDACT_RESPONSE") is None and user.get("RESPONSE_CODEC") is None:
        return outcome
    try:
        redact = conf.optional_callable("REDACT_RESPONSE")
        if redact is not None:
            outcome = _redacted(redact, outcome)
        codec = get_codec()
        if codec is None:
            return outcome
        record = Record(outcome.status, account, endpoint, key)
        return StoredResponse(outcome.status, _sealed(codec, outcome, record), [])
    except Exception:
        logger.exception(
            "Idempotency response not stored: REDACT_RESPONSE or RESPONSE_CODEC failed. "
            "The first client got its response; a retry with its key will be told the "
            "request was processed (409), and the view will not run again."
        )
        return StoredResponse(outcome.status, UNSTORABLE, [])


def unseal(stored: StoredResponse, *, account: str, endpoint: str, key: str) -> StoredResponse:
    """A stored outcome of the record of ``account``, ``endpoint`` and ``key``, as it will
    be replayed. Raises ``ResponseNotStored`` for a record whose response could not be
    stored, ``ResponseUnreadable`` for one the codec cannot open or that was sealed for
    another record (``misbound``); replays a record stored without a codec as it is, and
    one sealed before binding unchecked, unless ``REQUIRE_BOUND_RESPONSES`` refuses both
    (``unbound``)."""
    body = stored.body if isinstance(stored.body, bytes) else bytes(stored.body)
    if not body.startswith(b"\x00"):  # the common case, in one comparison
        if bound_required():
            raise _unbound(stored.status)
        return stored
    if body == UNSTORABLE:
        raise ResponseNotStored(
            f"The first request with this Idempotency-Key completed with status "
            f"{stored.status}, but its response could not be prepared for storage "
            "(redaction or encoding failed)."
        )
    bound = body.startswith(SEALED)
    if not bound and bound_required():
        raise _unbound(stored.status)
    if not (bound or body.startswith(SEALED_UNBOUND)):
        return stored
    try:
        codec = get_codec()
        if codec is None:
            raise ImproperlyConfigured("IDEMPOTENCY RESPONSE_CODEC is not set.")
        frame = codec.decode(body[len(SEALED) :])  # both prefixes have one length
        if bound:
            frame = _unbind(frame, Record(stored.status, account, endpoint, key))
        return _unframe(stored.status, frame)
    except Exception as error:
        if isinstance(error, _Misbound):
            logger.error(
                "Idempotency stored response was sealed for another record (its account, "
                "endpoint, key or status differ): the row was copied or altered. It is not "
                "replayed; its retries get a 409 problem and the view does not run again."
            )
        else:
            logger.error(
                "Idempotency stored response cannot be decoded with the configured "
                "RESPONSE_CODEC (%s): a key it was sealed with may have been dropped. Its "
                "retries get a 409 problem; the view does not run again.",
                type(error).__name__,
            )
        unreadable = ResponseUnreadable(
            f"The first request with this Idempotency-Key completed with status "
            f"{stored.status}, but its stored response cannot be read back."
        )
        unreadable.misbound = isinstance(error, _Misbound)
        raise unreadable from error


def bound_required() -> bool:
    """Whether only responses bound to their record may be replayed: a codec is set and
    ``REQUIRE_BOUND_RESPONSES`` is on (anything but ``False`` counts as on: E014)."""
    user = conf.raw()
    return (
        user.get("RESPONSE_CODEC") is not None
        and user.get("REQUIRE_BOUND_RESPONSES", False) is not False
    )


def _unbound(status: int) -> ResponseUnreadable:
    logger.error(
        "Idempotency stored response is bound to no record (stored in clear, or sealed "
        "before responses were bound), and REQUIRE_BOUND_RESPONSES refuses it: it may have "
        "been copied from another record. Its retries get a 409 problem; the view does not "
        "run again."
    )
    unreadable = ResponseUnreadable(
        f"The first request with this Idempotency-Key completed with status {status}, but "
        "its stored response cannot be read back."
    )
    unreadable.unbound = True
    return unreadable


def is_sealed(body: bytes | None) -> bool:
    """Whether ``body`` was stored through a codec (or in place of a failed one)."""
    return body is not None and (
        body.startswith(SEALED) or body.startswith(SEALED_UNBOUND) or body == UNSTORABLE
    )


_BINDING = re.compile(rb"[0-9a-f]{64}")


def _sealed(codec: ResponseCodec, outcome: StoredResponse, record: Record) -> bytes:
    """The bound frame, sealed: the record's binding on the first line, then the frame."""
    return SEALED + codec.encode(record.binding() + b"\n" + _frame(outcome))


def _unbind(frame: bytes, record: Record) -> bytes:
    """The frame inside a bound one; ``_Misbound`` if it was sealed for another record."""
    binding, separator, rest = frame.partition(b"\n")
    if not (separator and _BINDING.fullmatch(binding)):
        raise ValueError("the decoded response is not framed as this app frames it")
    if not hmac.compare_digest(binding, record.binding()):
        raise _Misbound("the response was sealed for another record")
    return rest


def _frame(outcome: StoredResponse) -> bytes:
    """Headers as one line of JSON, then the body: a JSON string never holds a raw newline."""
    headers = json.dumps([[name, value] for name, value in outcome.headers])
    return headers.encode() + b"\n" + outcome.body


def _unframe(status: int, frame: bytes) -> StoredResponse:
    line, separator, body = frame.partition(b"\n")
    headers = json.loads(line) if separator else None
    if not (
        isinstance(headers, list)
        and all(
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)
            for pair in headers
        )
    ):
        raise ValueError("the decoded response is not framed as this app frames it")
    return StoredResponse(status, body, [(name, value) for name, value in headers])


def _redacted(redact: Callable[..., Any], outcome: StoredResponse) -> StoredResponse:
    redacted = redact(outcome)
    if not isinstance(redacted, StoredResponse):
        raise TypeError(
            f"REDACT_RESPONSE returned {type(redacted).__name__}, not a StoredResponse."
        )
    return redacted


# -- re-sealing stored records ----------------------------------------------------------------


@dataclass(frozen=True)
class Resealed:
    """What ``reseal_records`` did: records sealed again under the codec's current key,
    records it could not open (left as they are), records it skipped (not stored), and
    records it left unbound because ``REQUIRE_BOUND_RESPONSES`` is on."""

    resealed: int
    unreadable: int
    skipped: int
    unbound: int = 0


def reseal_records(*, using: str | None = None, batch_size: int = 100) -> Resealed:
    """Seal every stored response again with the configured codec: under a rotated codec,
    the first key; a record stored in clear before the codec was set, sealed for the
    first time; every record bound to itself (one sealed before binding existed too).
    After it, keys that only old records needed can be dropped at once, without waiting
    ``TTL_SECONDS`` (and with ``TTL_SECONDS = None``, ever). A record whose sealed
    response is bound to another record counts as unreadable and is left as it is.

    Each response is bound to the record it is read from, in the same ``SELECT``, and
    written back to that record only. A bound response proves where it came from; an
    unbound one (in clear, or sealed before binding) cannot, so it is bound only while
    ``REQUIRE_BOUND_RESPONSES`` is off, the one-time step before turning it on. Once it is
    on, the app writes nothing unbound: an unbound response found then was put there by
    something else (a row copied from another record), and is left as it is (``unbound``),
    refused on replay, never given a binding it could not earn.

    Redaction is not applied again: it already was, or the record predates it. Each
    record is read and written on its own (a body can be ``MAX_RESPONSE_BYTES``), and the
    write is fenced by the record's claim token and state: a record taken over since it
    was read belongs to its new claim and is left alone. Safe while traffic flows.
    """
    from idempotency_django.models import IdempotencyRecord
    from idempotency_django.store.base import store_alias

    codec = get_codec()
    if codec is None:
        raise ImproperlyConfigured("IDEMPOTENCY RESPONSE_CODEC is not set: nothing to seal with.")
    alias = using or store_alias()
    records = IdempotencyRecord.objects.using(alias).filter(
        state=IdempotencyRecord.State.COMPLETED, response_body__isnull=False
    )
    counts = {"resealed": 0, "unreadable": 0, "skipped": 0, "gone": 0, "unbound": 0}
    last = 0
    while True:
        batch = list(
            records.filter(pk__gt=last).order_by("pk").values_list("pk", "token")[:batch_size]
        )
        if not batch:
            return Resealed(
                counts["resealed"], counts["unreadable"], counts["skipped"], counts["unbound"]
            )
        for pk, token in batch:
            last = pk
            counts[reseal_one(records, pk, token, codec)] += 1


def reseal_one(
    records: QuerySet[IdempotencyRecord], pk: int, token: str, codec: ResponseCodec
) -> str:
    """Seal one record again; say what became of it: ``"resealed"``, ``"unreadable"`` (left
    as it is), ``"unbound"`` (left as it is: ``REQUIRE_BOUND_RESPONSES``), ``"skipped"``
    (never stored) or ``"gone"`` (deleted or claimed again since it was listed; the write
    is fenced the same way)."""
    found = (
        records.filter(pk=pk, token=token)
        .values_list(
            "response_status", "response_headers", "response_body", "account", "endpoint", "key"
        )
        .first()
    )
    if found is None:
        return "gone"
    status, headers, body, account, endpoint, key = found
    stored = StoredResponse(
        int(status or 0), bytes(body or b""), [(str(name), str(value)) for name, value in headers]
    )
    if stored.body == UNSTORABLE:
        return "skipped"
    record = Record(stored.status, account, endpoint, key)
    try:
        opened = unseal(stored, account=account, endpoint=endpoint, key=key)
    except ResponseUnreadable as error:
        return "unbound" if error.unbound else "unreadable"
    sealed = _sealed(codec, opened, record)
    written = records.filter(pk=pk, token=token).update(response_body=sealed, response_headers=[])
    return "resealed" if written else "gone"


# -- a redaction hook to start from -----------------------------------------------------------


def drop_json_fields(*paths: str) -> Callable[[StoredResponse], StoredResponse]:
    """A ``REDACT_RESPONSE`` hook that removes fields from a JSON body before it is stored.

    Each path names a member of the top-level object, or of nested objects with dots
    (``"card.number"``); a path into a list applies to each object in it. A body that is
    not JSON (by its ``Content-Type``) or does not parse is stored as it is.
    """
    split = [path.split(".") for path in paths]

    def redact(outcome: StoredResponse) -> StoredResponse:
        content_type = next(
            (value for name, value in outcome.headers if name.lower() == "content-type"), ""
        )
        media_type = content_type.split(";", 1)[0].strip().lower()
        if not (media_type == "application/json" or media_type.endswith("+json")):
            return outcome
        try:
            document = json.loads(outcome.body)
        except ValueError:
            return outcome
        for path in split:
            _drop(document, path)
        return replace(outcome, body=json.dumps(document, separators=(",", ":")).encode())

    return redact


def _drop(document: Any, path: list[str]) -> None:
    if isinstance(document, list):
        for item in document:
            _drop(item, path)
    elif isinstance(document, dict):
        if len(path) == 1:
            document.pop(path[0], None)
        elif path[0] in document:
            _drop(document[path[0]], path[1:])
