"""The decision table of docs/guarantees.md, as pure functions: no I/O, no signals, no sleep.

``shell.py`` is the shell around them: it reads the record through the store, asks
``decide`` what to do, does it (claims, takes over, replays, waits, refuses) and reports
each outcome once. What the table reads lives here too: whether a record read at ``now``
is in use, expired or lapsed, and how much of its lease is left (``is_in_use``, ...). So do
the rules around it: what a store failure means (``store_failure``), when a duplicate's
``Retry-After`` is more than the setting (``in_flight_retry_after``), which outcomes are
too big to store (``fits``), which failed work may have committed (``outcome_unknown``)
and which failed completion is worth sending again (``may_pass_on_retry``). Keeping the
rules here, apart from the round trips, lets every branch be tested without a database
(``tests/test_decisions.py``), and lets a reader see the whole table in one screen.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Final, Literal, TypeAlias

from django.db import (
    DataError,
    IntegrityError,
    InterfaceError,
    NotSupportedError,
    OperationalError,
    ProgrammingError,
)

from idempotency_django.models import IdempotencyRecord
from idempotency_django.store.base import Snapshot
from idempotency_django.store.database import rolled_back

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


# -- what a record read at ``now`` is: the table's inputs ----------------------------------
#
# The engine's side of the record states whose SQL side is ``store.base`` (``in_use_q``,
# ``expired_q``, ``lapsed_q``: what the stores count, purge and inspect). The two must agree;
# ``tests/test_store_hot_path.py`` holds them to it.


def is_in_use(record: Snapshot, now: datetime) -> bool:
    """In progress under a lease that has not lapsed: its request may still be running."""
    return record.state == State.IN_PROGRESS and (
        record.lease_expires_at is not None and record.lease_expires_at > now
    )


def is_expired(record: Snapshot, now: datetime) -> bool:
    """Past its TTL and not in use: the key counts as absent."""
    return record.expires_at <= now and not is_in_use(record, now)


def is_lapsed(record: Snapshot, now: datetime) -> bool:
    """In progress with a lease that nobody renews any more: its worker died or lost the
    store."""
    return record.state == State.IN_PROGRESS and not is_in_use(record, now)


def lease_left(record: Snapshot, now: datetime) -> float:
    """Seconds until ``record``'s lease lapses (0 when it has, or it has none)."""
    if not is_in_use(record, now):
        return 0.0
    assert record.lease_expires_at is not None
    return (record.lease_expires_at - now).total_seconds()


# -- the table ------------------------------------------------------------------------------


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


#: How often one request retries when the row it lost to changes under it (released, or
#: taken over by another request, between its read and its write). Past this, the caller
#: is told to retry later rather than spin.
MAX_RACES = 5


def races_left(races: int) -> bool:
    """Whether a request that has lost ``races`` races for its record may try once more."""
    return races < MAX_RACES


def in_flight_retry_after(
    record: Snapshot, now: datetime, *, lease: float, retry_after: int
) -> int:
    """``Retry-After`` for a duplicate of a request in flight, from what is left of its lease.

    A worker renews its lease every third of it, so a live one keeps more than half of it:
    its request may end any moment, and the answer is ``retry_after``
    (``RETRY_AFTER_SECONDS``). With half or less left, the lease has missed its renewals
    (its worker died, lost the store or ran past ``MAX_RUN_SECONDS``), and nothing changes
    for the key until it lapses: the seconds left, rounded up, never fewer than
    ``retry_after``. ``docs/http-contract.md``.
    """
    left = lease_left(record, now)
    if left > lease / 2:
        return retry_after
    return max(retry_after, math.ceil(left))


def contended(kind: str) -> bool:
    """Whether a store failure of ``kind`` (``Store.failure_kind``) met by a claim is a
    request in flight: a concurrent duplicate's transaction holds the key (atomic mode), or
    the database gave up on a lock for it. Never a reason to run unprotected."""
    return kind == "contention"


def store_failure(kind: str, on_store_error: str) -> str:
    """How a claim that the store failed with ``kind`` goes on: ``"open"`` (the work runs
    unprotected) only when the store cannot be reached and ``ON_STORE_ERROR`` says so
    (``on_store_error``); otherwise ``"closed"``: 503."""
    policy = on_store_error if kind == "unreachable" else "closed"
    return policy


def fits(body: bytes | None, max_response_bytes: int) -> bool:
    """Whether a definitive answer's ``body`` is stored (``None``: it was streamed). A body
    larger than ``max_response_bytes`` (or streamed) is not: only that the work ran is,
    so that a repeat of the key is told so (``ResponseNotStored``) and never runs it
    again."""
    return body is not None and len(body) <= max_response_bytes


def outcome_unknown(error: BaseException) -> bool:
    """Whether work that failed with ``error`` may have committed all the same: a database
    connection lost while it ran may have lost the acknowledgement of a write that
    committed. Its key is kept until its lease lapses, as a crashed worker's.

    Not every ``OperationalError`` is that: a deadlock, a serialization failure or a lock
    timeout is the database saying it rolled the work back (``rolled_back``, by SQLSTATE
    or MySQL error code). That is a known failure, and the key is released for the retry,
    as after any other exception. An error without such a code stays unknown."""
    if isinstance(error, InterfaceError):
        return True
    return isinstance(error, OperationalError) and not rolled_back(error)


def may_pass_on_retry(error: BaseException) -> bool:
    """Whether sending a failed completion again may succeed: not when the database
    refused the statement itself (its data, its SQL), which it would refuse again. A lost
    connection, a timeout, a lock, a Redis failure may all be gone on the next attempt."""
    return not isinstance(error, (DataError, IntegrityError, ProgrammingError, NotSupportedError))
