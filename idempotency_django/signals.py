"""Signals for metrics and alerting, and the matching log records.

Every signal is sent with ``sender=IdempotencyRecord`` and ``account``, ``endpoint`` and
``key`` (as its digest, ``key_digest``: a receiver that needs the key itself calls
``raw_key()``), and logged on the ``idempotency_django`` logger with those as ``extra``
fields. Every log record that names a key builds its fields here (``log_fields``,
``log_key``): the one place where ``LOG_KEYS`` is honoured and control characters are
escaped, so no call site can leak a key or forge a line. Each signal: docs/signals.md.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

from django.conf import settings
from django.dispatch import Signal

logger = logging.getLogger("idempotency_django")


class IdempotencySignal(Signal):
    """A Django signal with one more receiver: this package's own metrics and log line.

    Receivers connect as to any signal (``connect``, ``@receiver``) and get what the
    docs say. The metrics (``core/observe.py``) are one receiver among them, held in
    ``observer``, a slot of its own rather than Django's list: a protected request sends
    two signals or more, and with the metrics on, Django's dispatch (the receivers' lookup,
    the call with ``signal`` and ``sender``) and the key's digest (which Django's receivers
    get instead of the key) were most of what the metrics cost a replay
    (docs/observability.md, "Cost"). The observer is called first, with the same
    arguments but the key itself (``send``), and never leaves this package.

    Every one is sent by one sender (``IdempotencyRecord``): ``use_caching`` keeps its
    receivers' list between sends instead of rebuilding it under a lock on each.
    """

    def __init__(self) -> None:
        super().__init__(use_caching=True)
        #: This package's own receiver (``core/observe.py``), or ``None``.
        self.observer: Callable[..., None] | None = None

    @property
    def listened(self) -> bool:
        """Whether sending this signal reaches anyone: the observer or a receiver."""
        return self.observer is not None or bool(self.receivers)


#: A request claimed a key that was absent (or expired) and its view is about to run.
claimed = IdempotencySignal()
#: A completed key was replayed; ``status`` is the stored status code.
replayed = IdempotencySignal()
#: A duplicate arrived while the key's first request was still running.
in_flight = IdempotencySignal()
#: An account had ``MAX_IN_FLIGHT_PER_ACCOUNT`` requests in progress: a new one was refused
#: (429) before its claim.
quota_exceeded = IdempotencySignal()
#: A key was reused with a different request (answered 422).
mismatch = IdempotencySignal()
#: A claim was released because its view failed (exception or unstored status).
released = IdempotencySignal()
#: A claim whose lease had lapsed (its worker died or overran) was taken over.
lease_taken_over = IdempotencySignal()
#: A finished view could not store its outcome: its claim had been taken over.
completion_lost = IdempotencySignal()
#: Work that ran, and may have committed, could not have its outcome stored (the store failed
#: after it, retries included): the key stays in progress until its lease lapses, and a
#: retry after that runs the work again. ``status`` is the response's (``None`` when the
#: client was answered 503). Alert on it.
outcome_not_stored = IdempotencySignal()
#: The store failed while claiming a key; ``policy`` is ``"closed"`` (503) or ``"open"``
#: (the view ran unprotected).
store_unavailable = IdempotencySignal()
#: A request's ``Idempotency-Key`` was missing where one is required, or malformed (400).
#: Sent with ``reason`` (``"missing"`` or ``"malformed"``) and ``endpoint``; no account and no
#: key: neither is known yet.
key_refused = IdempotencySignal()
#: A request with a key came from nobody (no account) under ``ANONYMOUS = "reject"`` (403).
#: Sent with ``endpoint``; no account and no key.
anonymous_refused = IdempotencySignal()
#: A completed key's stored response could not be read back (its codec cannot open it, or
#: it was sealed for another record): the retry is answered 409 and the view does not run.
response_unreadable = IdempotencySignal()
#: A claim's outcome was stored; ``status`` and ``size`` (the stored body's bytes, 0 when
#: only the status was kept).
completed = IdempotencySignal()

# Signals that name no key (sent with plain ``Signal.send``; see each for its arguments).

#: One store operation ran: ``operation`` (``"claim"``, ``"complete"``, ``"release"``,
#: ``"renew"``, ``"read"``), ``store`` (``store_name``) and ``seconds`` (its duration,
#: failures included). Sent only while a receiver is connected: timing costs nothing
#: otherwise.
store_operation = IdempotencySignal()
#: The heartbeat beat (or went idle): ``in_flight`` (the claims of this process it keeps),
#: ``oldest_age`` (seconds since the oldest of them was claimed, 0 when none), ``lag``
#: (seconds since the least recently renewed of them was last renewed, 0 when none) and
#: ``failures`` (the claims whose renewal failed at this beat).
heartbeat_beat = IdempotencySignal()


T = TypeVar("T")


def timed(operation: str, store: object, call: Callable[[], T]) -> T:
    """``call()``, a store operation, timed for ``store_operation`` when anyone listens
    (failures included: a store that times out is a slow store). With no one, this is the
    call alone."""
    if not store_operation.listened:
        return call()
    started = time.perf_counter()
    try:
        return call()
    finally:
        seconds = time.perf_counter() - started
        name = store_name(store)
        observer = store_operation.observer  # ``dispatch``, written out: once per operation
        if observer is not None:
            observer(operation, name, seconds)
        if store_operation.receivers:
            store_operation.send(_sender(), operation=operation, store=name, seconds=seconds)


def dispatch(signal: IdempotencySignal, **named: Any) -> None:
    """Send ``signal``, which names no key, to its observer and its receivers."""
    if signal.observer is not None:
        signal.observer(**named)
    if signal.receivers:
        signal.send(_sender(), **named)


def _sender() -> type:
    """``IdempotencyRecord``, the sender of every signal (imported on first use: the models
    are not ready when this module is imported)."""
    global _record_model
    if _record_model is None:
        from idempotency_django.models import IdempotencyRecord

        _record_model = IdempotencyRecord
    return _record_model


_record_model: type | None = None
_store_names: dict[type, str] = {}


def store_name(store: object) -> str:
    """A store's name for metrics and logs, from its class: ``DatabaseStore`` is
    ``"database"``, ``RedisClusterStore`` ``"redis_cluster"``. One per class: bounded."""
    kind = type(store)
    name = _store_names.get(kind)
    if name is None:
        base = kind.__name__.removesuffix("Store") or kind.__name__
        name = re.sub(r"(?<!^)(?=[A-Z])", "_", base).lower()
        _store_names[kind] = name
    return name


def emit(
    signal: IdempotencySignal,
    level: int,
    message: str,
    account: str,
    endpoint: str,
    key: str,
    **extra: Any,
) -> None:
    """Send ``signal`` and log ``message`` with the scope as structured fields.

    With no receiver connected and the level off (a request's ``claimed`` and ``replayed``
    at DEBUG, in production), this builds nothing: no keyword arguments, no log fields.
    """
    if signal.observer is not None or signal.receivers:
        send(signal, account, endpoint, key, **extra)
    if logger.isEnabledFor(level):
        logger.log(level, message, extra=log_fields(account, endpoint, key, **extra))


#: The prefix of a key's digest (signals, the admin's history, ``LOG_KEYS = "hash"``): names
#: the algorithm, so that a reader (or a later version that changes it) knows what it is.
LOG_KEY_DIGEST_PREFIX = "hmac-sha256:"
# Fixed, so that one deployment (one SECRET_KEY) names a key by the same digest everywhere,
# and distinct from every other use of SECRET_KEY, so the digest is useless elsewhere.
_LOG_KEY_SALT = "idempotency_django.signals.log_key"

# The key of the signal being sent, for a receiver that asks for it (``raw_key``).
_sending: contextvars.ContextVar[str] = contextvars.ContextVar("idempotency_django.key")


def send(signal: IdempotencySignal, account: str, endpoint: str, key: str, **extra: Any) -> None:
    """Send ``signal`` for one key: receivers get ``key`` as its digest (``key_digest``), and
    the key itself from ``raw_key()`` while they run. A receiver that logs or forwards its
    arguments (an error tracker, a metrics label) then never carries the client's key.

    The observer (``IdempotencySignal``) gets the key itself, and keeps only its digest,
    computed when something reads it (the request's log line): a replay counted by
    Prometheus digests nothing."""
    if signal.observer is not None:
        signal.observer(account=account, endpoint=endpoint, key=key, **extra)
    if not signal.receivers:
        return
    sending = _sending.set(key)
    try:
        signal.send(_sender(), account=account, endpoint=endpoint, key=key_digest(key), **extra)
    finally:
        _sending.reset(sending)


def raw_key() -> str:
    """The key, as the client sent it, of the signal being sent: for a receiver that needs
    it (to find the record, to tell the client), which asks for it by calling this. Raises
    ``LookupError`` anywhere else."""
    try:
        return _sending.get()
    except LookupError:
        raise LookupError(
            "signals.raw_key() gives the key to a receiver of an idempotency_django signal, "
            "while the signal is sent."
        ) from None


def key_digest(key: str) -> str:
    """``hmac-sha256:`` and an HMAC-SHA256 of ``key`` keyed with ``SECRET_KEY``: what signals
    and the admin's history name a key by, and logs under ``LOG_KEYS = "hash"``.

    Django's ``salted_hmac``, with its derived key kept per ``SECRET_KEY`` (it would hash
    the salt and the secret again on every call: most of the cost of a digest)."""
    secret = settings.SECRET_KEY
    keyed = _keyed.get(secret)
    if keyed is None:
        keyed = _keyed[secret] = hmac.new(
            hashlib.sha256((_LOG_KEY_SALT + secret).encode()).digest(), digestmod=hashlib.sha256
        )
    digest = keyed.copy()
    digest.update(key.encode())
    return LOG_KEY_DIGEST_PREFIX + digest.hexdigest()


# SECRET_KEY → an HMAC keyed as ``salted_hmac`` keys it, before any message.
_keyed: dict[str, hmac.HMAC] = {}


def log_key(key: str) -> str:
    """``key`` as it may appear in a log: itself, or under ``LOG_KEYS = "hash"`` a digest.

    The digest is an HMAC-SHA256 keyed with ``SECRET_KEY``: the same key gives the same
    digest across processes and hosts of one deployment (logs can be correlated, and an
    operator who holds a key can compute its digest with this function), but a key cannot
    be recovered from logs by hashing guesses without the secret. Plain SHA-256 could: keys
    are often order numbers or UUIDs derived from predictable data. The result is not
    escaped; ``log_fields`` escapes it, and a caller that puts it in a message must too.
    """
    from idempotency_django.conf import conf

    if conf.LOG_KEYS == "hash":
        return key_digest(key)
    return key


def escape_log_text(text: str) -> str:
    r"""``text`` with backslashes and non-printable characters escaped as ``repr`` does.

    The endpoint holds the request path, and accounts and keys come from callers: a CR or
    LF in one of them would let a client start a forged line in a plain-text log, and other
    control or invisible characters (NUL, ESC, U+2028, bidi overrides) can hide or reorder
    what an operator reads. ``\r``, ``\n``, ``\t``, ``\x00``, ``\u2028``… are written as
    those escapes; the backslash itself is doubled so that the escaping stays unambiguous
    (a literal ``\n`` in a path is logged as ``\\n``).
    """
    if text.isprintable() and "\\" not in text:
        return text  # the common case, without building a new string
    return "".join(
        "\\\\" if char == "\\" else char if char.isprintable() else repr(char)[1:-1]
        for char in text
    )


def log_fields(account: str, endpoint: str, key: str, **extra: Any) -> dict[str, Any]:
    """The ``extra`` of a log record about one key: the scope, and ``extra`` prefixed.

    The key goes through ``log_key`` (``LOG_KEYS``), and every string value is escaped
    with ``escape_log_text``. Pass the result as ``logger.log(..., extra=...)``; never put
    a key in ``extra`` or in a message by hand.
    """
    fields = {
        "idempotency_account": account,
        "idempotency_endpoint": endpoint,
        "idempotency_key": log_key(key),
        **{f"idempotency_{name}": value for name, value in extra.items()},
    }
    return {
        name: escape_log_text(value) if isinstance(value, str) else value
        for name, value in fields.items()
    }
