"""The record stores: every query on records, and the record states in SQL.

``base`` holds the interface (``Store``, and the ``Write``, ``Completion`` and ``Scope`` it
is given), the record's states and the failure kinds;
``database`` the default store (rows of ``IdempotencyRecord``); ``redis`` the Redis/Valkey
store. ``IDEMPOTENCY["STORE"]`` (or a view's ``store=``) selects one by dotted path. The
names below stay importable from ``idempotency_django.store`` as before the package.
"""

from __future__ import annotations

from idempotency_django.store.base import (
    CLAIMED,
    DEFAULT_STORE,
    Bindable,
    ClaimOrRead,
    Completion,
    FailureKind,
    Inspects,
    Record,
    Scope,
    Snapshot,
    Store,
    Stored,
    StoreError,
    Times,
    Write,
    expired_q,
    expiry,
    get_store,
    in_use_q,
    lapsed_q,
    never,
    store_alias,
)
from idempotency_django.store.database import TIMESTAMPTZ_OID, DatabaseStore, store

# The record predicates the engine decides with live in ``core/decisions.py``; ``store.base``
# still hands them out (loaded on first use), and so does this package, through it.


def __getattr__(name: str) -> object:
    from idempotency_django.store import base

    if name in base.IN_DECISIONS:
        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CLAIMED",
    "DEFAULT_STORE",
    "TIMESTAMPTZ_OID",
    "Bindable",
    "ClaimOrRead",
    "Completion",
    "DatabaseStore",
    "FailureKind",
    "Inspects",
    "Record",
    "Scope",
    "Snapshot",
    "Store",
    "StoreError",
    "Stored",
    "Times",
    "Write",
    "expired_q",
    "expiry",
    "get_store",
    "in_use_q",
    "is_expired",
    "is_in_use",
    "is_lapsed",
    "lapsed_q",
    "never",
    "store",
    "store_alias",
]
