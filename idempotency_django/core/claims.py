"""What a claim is: the scope it names, the policy it is made under, the claim itself.

Plain values, shared by the shell that makes and ends claims (``shell.py``), the heartbeat
that renews them (``heartbeat.py``) and the adapters that name them (``protect.py``,
``tasks.py``). Nothing here talks to a store.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from idempotency_django.store.base import Scope, Store, get_store, store_alias

# Scope and store_alias are re-exported: they lived here before the store package.
__all__ = ["Claim", "ClaimPolicy", "Scope", "new_token", "store_alias"]


@dataclass(frozen=True)
class ClaimPolicy:
    """How one claim is made: the store, its lease and TTL, and the in-flight policy."""

    alias: str
    lease: float
    ttl: float | None  # None: keep records forever
    in_flight: str
    wait_seconds: float
    retry_after: int
    store: Store = field(default_factory=get_store)  # IDEMPOTENCY["STORE"] unless given
    # MAX_IN_FLIGHT_PER_ACCOUNT for requests (None: no bound; tasks have none).
    account_limit: int | None = None

    def __post_init__(self) -> None:
        # The store works on ``alias``: bound once here, never per call.
        object.__setattr__(self, "store", self.store.bind(self.alias))


@dataclass(frozen=True)
class Claim:
    scope: Scope
    token: str
    alias: str
    ttl: float | None = None  # counted from completion: see ``shell.complete``
    store: Store = field(default_factory=get_store, compare=False)
    # ``time.monotonic()`` no later than the write that set the claim's lease was sent: the
    # lease lapses on the store no sooner than a lease after it (``heartbeat.lapses_at``).
    since: float = field(default_factory=time.monotonic, compare=False)


def new_token() -> str:
    return uuid.uuid4().hex
