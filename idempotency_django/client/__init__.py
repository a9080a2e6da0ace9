"""The client half of idempotency, Django-free: send one operation until its outcome is
known (``IdempotentClient``, ``AsyncIdempotentClient``; ``http.py``), derive the key of a
downstream call (``downstream_key``), and the key's wire format (``wire.py``). Needs
``httpx`` (the ``client`` extra), not Django: ``downstream_key_for``, which reads a
Django request, stays importable from here, loaded on first use. Guide: docs/client.md.
"""

from __future__ import annotations

from typing import Any

from idempotency_django.client.http import (
    FINAL_PROBLEMS,
    KEY_MAX_LENGTH,
    RETRYABLE_ERRORS,
    AsyncIdempotentClient,
    IdempotentClient,
    IdempotentResult,
    RetriesExhausted,
    RetryPolicy,
    check_key,
    hidden_key,
    is_final_problem,
    is_in_flight_conflict,
    parse_retry_after,
)
from idempotency_django.core.wire import downstream_key

__all__ = [
    "FINAL_PROBLEMS",
    "KEY_MAX_LENGTH",
    "RETRYABLE_ERRORS",
    "AsyncIdempotentClient",
    "IdempotentClient",
    "IdempotentResult",
    "RetriesExhausted",
    "RetryPolicy",
    "check_key",
    "downstream_key",
    "downstream_key_for",
    "hidden_key",
    "is_final_problem",
    "is_in_flight_conflict",
    "parse_retry_after",
]


def __getattr__(name: str) -> Any:
    if name == "downstream_key_for":  # needs Django: imported only when asked for
        from idempotency_django.downstream import downstream_key_for

        return downstream_key_for
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
