"""The store interface as docs/stores.md shows it ("Writing another store"): the suite
checks that it is ``idempotency_django.store.base.Store``, member for member
(tests/store/test_contract.py)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, ClassVar, Protocol

from idempotency_django.store.base import (
    ClaimOrRead,
    Completion,
    FailureKind,
    Scope,
    Snapshot,
    Stored,
    Write,
)


# docs:start
class Store(Protocol):
    errors: ClassVar[tuple[type[BaseException], ...]]  # raised by a failing call
    transactional: ClassVar[bool]  # a claim can live in the work's transaction
    needs_purge: ClassVar[bool]  # expired records wait for purge_idempotency_keys
    alias: str  # the database alias it works on (read-only)

    def bind(self, alias: str) -> Store:
        """This store, working on alias."""

    def claim_or_read(self, write: Write) -> ClaimOrRead:
        """Insert write if its scope is absent (CLAIMED), else read the record."""

    def claim(self, write: Write) -> bool:
        """Insert write if its scope is absent: whether this call inserted it."""

    def read_stored(self, pk: Any) -> Stored | None:
        """The stored response of the completed record pk."""

    def take_over(self, record: Snapshot, write: Write) -> bool:
        """Replace record if it is unchanged, and expired or lapsed."""

    def complete(self, scope: Scope, token: str, completion: Completion) -> bool:
        """Store the outcome, if token still holds the claim in progress."""

    def is_completed(self, scope: Scope, token: str) -> bool:
        """Whether token's claim completed (a completion sent again)."""

    def release(self, scope: Scope, token: str) -> int:
        """Delete the claim in progress, if token still holds it."""

    def renew(
        self, claims: Sequence[tuple[Scope, str]], lease: float, timeout: float
    ) -> int:
        """Push each claim's lease to lease seconds from now, within timeout."""

    def oldest_expired(self) -> datetime | None:
        """The expiry of the oldest expired record still present (the purge lag)."""

    def failure_kind(self, error: BaseException) -> FailureKind:
        """unreachable (may fail open), contention (409) or other (503)."""

    def in_transaction(self) -> bool:
        """Whether a call now runs inside an open transaction (never retried)."""

    def reset(self) -> None:
        """Drop the connection: the next call opens a new one."""

    def usable(self) -> bool:
        """Whether the connection still works."""


# Scope(account, endpoint, key)
# Write(scope, token, fingerprint, created_at, lease, ttl): a claim or a take-over
# Completion(status, headers, body, completed_at, ttl)
# docs:end
