"""Signals sent by the engine, for metrics and alerting, and the matching log records.

Every signal is sent with ``sender=IdempotencyRecord`` and the keyword arguments
``account``, ``endpoint`` and ``key``; see the README for what each one means. Each is
also logged on the ``idempotency_django`` logger with those three as ``extra`` fields
(``idempotency_account``, ``idempotency_endpoint``, ``idempotency_key``; the key as a
digest when ``LOG_KEYS`` is ``"hash"``).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from django.dispatch import Signal

logger = logging.getLogger("idempotency_django")

#: A request claimed a key that was absent (or expired) and its view is about to run.
claimed = Signal()
#: A completed key was replayed; ``status`` is the stored status code.
replayed = Signal()
#: A duplicate arrived while the key's first request was still running.
in_flight = Signal()
#: A key was reused with a different request (answered 422).
mismatch = Signal()
#: A claim was released because its view failed (exception or unstored status).
released = Signal()
#: A claim whose lease had lapsed (its worker died or overran) was taken over.
lease_taken_over = Signal()
#: A finished view could not store its outcome: its claim had been taken over.
completion_lost = Signal()
#: The store failed while claiming a key; ``policy`` is ``"closed"`` (503) or ``"open"``
#: (the view ran unprotected).
store_unavailable = Signal()


def emit(
    signal: Signal, level: int, message: str, account: str, endpoint: str, key: str, **extra: Any
) -> None:
    """Send ``signal`` and log ``message`` with the scope as structured fields."""
    from idempotency_django.models import IdempotencyRecord

    signal.send(IdempotencyRecord, account=account, endpoint=endpoint, key=key, **extra)
    if logger.isEnabledFor(level):
        logger.log(level, message, extra=log_fields(account, endpoint, key, **extra))


def log_fields(account: str, endpoint: str, key: str, **extra: Any) -> dict[str, Any]:
    from idempotency_django.conf import conf

    if conf.LOG_KEYS == "hash":
        key = "sha256:" + hashlib.sha256(key.encode()).hexdigest()[:32]
    fields = {f"idempotency_{name}": value for name, value in extra.items()}
    return {
        "idempotency_account": account,
        "idempotency_endpoint": endpoint,
        "idempotency_key": key,
        **fields,
    }
