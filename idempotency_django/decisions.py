"""The decision table of docs/guarantees.md, as pure functions: no I/O, no signals, no sleep.

``claims.py`` is the shell around them: it reads the record through the store, asks
``decide`` what to do, does it (claims, takes over, replays, waits, refuses) and reports
each outcome once. Keeping the rules here, apart from the round trips, lets every branch
of the table be tested without a database (``tests/test_decisions.py``), and lets a
reader see the whole table in one screen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Final, Literal, TypeAlias

from idempotency_django.models import IdempotencyRecord
from idempotency_django.store.base import Snapshot, is_expired, is_in_use, is_lapsed, lease_left

State = IdempotencyRecord.State


@dataclass(frozen=True)
class Resume:
    """The record is this request's own claim, whose acknowledgement was lost (a resent
    claim with the same token): run under it. ``left``: seconds its lease has left."""

    left: float


@dataclass(frozen=True)
class TakeOver:
    """Take the record over and run: it ``expired`` (past its TTL, not in use: the key
    counts as absent), or its lease lapsed and it is the same request (its worker died)."""

    expired: bool


Action: TypeAlias = Literal["race", "mismatch", "replay", "in-flight"]
#: The record vanished between the claim and the read (released, or taken over and gone
#: again): claim again.
RACE: Final = "race"
#: Another request under the same key: 422.
MISMATCH: Final = "mismatch"
#: Completed by the same request: replay its stored outcome.
REPLAY: Final = "replay"
#: The same request is in progress under a live lease: 409, or wait and look again.
IN_FLIGHT: Final = "in-flight"

Decision: TypeAlias = Resume | TakeOver | Action


def decide(
    record: Snapshot | None, *, token: str, now: datetime, same: Callable[[str], bool]
) -> Decision:
    """What a request that lost its claim does about the ``record`` it read.

    ``token``: the request's own claim token; ``now``: the moment, on the clock the record
    was moved onto; ``same(fingerprint)``: whether the record's fingerprint is of the same
    request, asked only where the table needs it.
    """
    if record is None:
        return RACE
    if record.token == token and is_in_use(record, now):
        return Resume(lease_left(record, now))
    # Ours too when its lease lapsed while the acknowledgement was lost: taken over, which
    # renews the lease, rather than run under a lease anyone may take.
    expired = is_expired(record, now)
    lapsed = is_lapsed(record, now)
    matches = same(record.fingerprint)
    if expired or (lapsed and matches):
        return TakeOver(expired=expired)
    if not matches:
        return MISMATCH
    if record.state == State.COMPLETED:
        return REPLAY
    return IN_FLIGHT


def keep_waiting(
    *, seconds_left: float, place: Callable[[], bool], in_transaction: bool = False
) -> bool:
    """Whether a request that met a duplicate in flight (or a lock it holds) waits and looks
    again, rather than answer 409: only under the ``wait`` policy with time left
    (``seconds_left``), never inside a transaction (a claim there cannot be retried: the
    transaction itself waits on the lock), and only if it gets a waiter's place in this
    process (``place()``, asked last: it takes the place)."""
    return not in_transaction and seconds_left > 0 and place()
