"""The decision table (docs/guarantees.md): claim a key, or tell why not, over the store interface.

This module knows nothing of HTTP or of transactions: ``lifecycle.py`` decides how a
claim is run, completed or released; the store (``store/``) keeps the records, and tells
what kind of failure its errors are.

The claim is one insert-if-absent: whoever inserts the row owns the key, and the unique
index decides between concurrent inserts in any number of processes. Only a loser reads
the row, so a first request costs one statement to claim and one to complete, and a
replay, conflict or mismatch costs two.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from idempotency_django import codecs, signals
from idempotency_django.codecs import ResponseUnreadable
from idempotency_django.conf import conf
from idempotency_django.decisions import (
    IN_FLIGHT,
    MISMATCH,
    RACE,
    REPLAY,
    Resume,
    TakeOver,
    decide,
    keep_waiting,
)
from idempotency_django.exceptions import InFlight, KeyMismatch, QuotaExceeded, ResponseNotStored
from idempotency_django.keys import fingerprints_match
from idempotency_django.models import IdempotencyRecord
from idempotency_django.responses import StoredResponse
from idempotency_django.signals import emit
from idempotency_django.store.base import (
    CLAIMED,
    Completion,
    CountsInUse,
    Scope,
    Snapshot,
    Store,
    Stored,
    Write,
    duration,
    get_store,
    lease_left,
    lock_wait,
    store_alias,
)

# re-exported: they lived here before the store package
__all__ = ["Scope", "store_alias"]

logger = logging.getLogger("idempotency_django")

State = IdempotencyRecord.State

# How often one request retries when the row it lost to changes under it (released, or
# taken over by another request, between its read and its write). Past this, the
# caller is told to retry later rather than spin.
MAX_RACES = 5

# How long a claim made inside a transaction (atomic mode) waits for a row lock under the
# "conflict" policy: long enough for the store's own short writes on the key (a renewal, a
# purge batch), never for a duplicate's view. MariaDB/MySQL count whole seconds: 1 s there.
CONFLICT_LOCK_WAIT = 0.1


class Waiters:
    """The requests of this process that wait for a duplicate right now (``IN_FLIGHT =
    "wait"``), at most ``MAX_WAITERS``: past that, a duplicate is answered 409 at once, so
    that duplicates of one slow request cannot hold every worker thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def enter(self) -> bool:
        """Take a place among the waiters, or ``False`` when they are all taken."""
        limit = conf.MAX_WAITERS
        with self._lock:
            if self.count >= limit:
                return False
            self.count += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.count -= 1


waiters = Waiters()


class _Place:
    """One request's place among the ``waiters``: taken at its first wait, given back when
    it is answered."""

    def __init__(self) -> None:
        self.held = False

    def take(self) -> bool:
        self.held = self.held or waiters.enter()
        return self.held

    def give_back(self) -> None:
        if self.held:
            waiters.leave()
            self.held = False


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
    ttl: float | None = None  # counted from completion: see ``complete``
    store: Store = field(default_factory=get_store, compare=False)
    # ``time.monotonic()`` no later than the write that set the claim's lease was sent: the
    # lease lapses on the store no sooner than a lease after it (``heartbeat.lapses_at``).
    since: float = field(default_factory=time.monotonic, compare=False)


T = TypeVar("T")


def reconnecting(alias: str, operation: Callable[[], T], store: Store | None = None) -> T:
    """Run a store operation, and once more on a fresh connection if the store could not
    be reached.

    A connection lost between requests (the server restarted, a pooler or an operator
    dropped it) costs one reconnect instead of a 503 or an unstored outcome. Every store
    operation can run twice: the claim is an insert-if-absent, the others are fenced by the
    claim's token. Inside a transaction nothing can be retried: the error propagates. Nor is
    contention (a deadlock, a lock timeout): a new connection would not change it.
    """
    store = (store or get_store()).bind(alias)
    try:
        return operation()
    except store.errors as error:
        if store.in_transaction() or store.failure_kind(error) != "unreachable":
            raise
        logger.warning("Idempotency store connection failed; retrying once on a new one.")
        store.reset()
        return operation()


def new_token() -> str:
    return uuid.uuid4().hex


def claim_or_replay(
    scope: Scope, fingerprint: str, options: ClaimPolicy, token: str | None = None
) -> Claim | StoredResponse:
    """Claim ``scope`` for this request, or return the stored outcome of an earlier one.

    Raises ``KeyMismatch`` when the key belongs to a different request, ``InFlight`` when
    its first request is still running (after waiting, under the ``wait`` policy) or a
    concurrent transaction holds it (a lock timeout, a deadlock), ``ResponseNotStored``
    when it completed without a storable response, and ``QuotaExceeded`` (before any claim)
    when the account has ``account_limit`` requests in progress. Any other store error
    propagates.

    Give the same ``token`` when calling again for the same request (after a lost
    connection): a claim whose commit the first call never heard of is then recognised as
    this request's own, not reported as a duplicate in flight.
    """
    token = token or new_token()
    if options.account_limit is not None:
        _within_quota(scope, options, options.account_limit)
    place = _Place()
    try:
        return _claim_or_replay(scope, fingerprint, options, token, place)
    finally:
        place.give_back()


def _claim_or_replay(
    scope: Scope, fingerprint: str, options: ClaimPolicy, token: str, place: _Place
) -> Claim | StoredResponse:
    store = options.store
    deadline = time.monotonic() + (options.wait_seconds if options.in_flight == "wait" else 0)
    delay = 0.05
    races = 0
    reported_in_flight = False
    while True:
        sent = time.monotonic()  # before ``now``: every lease written below counts from later
        now = timezone.now()
        bound = None
        if store.in_transaction():
            # Atomic mode: a duplicate's insert waits on the first transaction's row until
            # it commits or rolls back; the policy bounds that wait.
            bound = CONFLICT_LOCK_WAIT
            if options.in_flight == "wait" and place.take():
                bound = max(bound, deadline - time.monotonic())
        try:
            claimed = _claim_or_read(
                scope, fingerprint, token, now, options, bound=bound, sent=sent
            )
        except store.errors as error:
            if store.failure_kind(error) != "contention":
                raise
            # A concurrent duplicate's transaction holds the key (atomic mode), or the
            # database gave up on a lock for it: that is a request in flight, never a
            # reason to run unprotected.
            emit(signals.in_flight, logging.INFO, "Idempotency key contended.", **scope.lookup())
            if not keep_waiting(
                seconds_left=deadline - time.monotonic(),
                place=place.take,
                in_transaction=store.in_transaction(),
            ):
                raise InFlight(
                    "A request with this Idempotency-Key is still being processed.",
                    retry_after=options.retry_after,
                ) from error
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)
            continue
        if isinstance(claimed, Claim):
            return claimed
        record = claimed
        decision = decide(
            record,
            token=token,
            now=now,
            same=lambda stored: fingerprints_match(stored, fingerprint),
        )
        if decision == RACE:
            races = _count_race(races, options)
            continue
        assert record is not None
        if isinstance(decision, Resume):
            # Ours, unacknowledged (the Redis store's claim answers this itself, rewritten
            # and replicated). Its lease was set by the earlier attempt: what is left of it
            # dates the claim.
            return _claim(scope, token, options, min(sent, sent + decision.left - options.lease))
        if isinstance(decision, TakeOver):
            if _take_over(record, scope, fingerprint, token, now, options):
                if decision.expired:
                    emit(signals.claimed, logging.DEBUG, "Expired key claimed.", **scope.lookup())
                else:
                    emit(
                        signals.lease_taken_over,
                        logging.WARNING,
                        "Idempotency lease lapsed; the key was taken over by a retry.",
                        **scope.lookup(),
                    )
                return _claim(scope, token, options, sent)
            races = _count_race(races, options)
            continue
        if decision == MISMATCH:
            emit(
                signals.mismatch,
                logging.INFO,
                "Idempotency key reused with a different request.",
                **scope.lookup(),
            )
            raise KeyMismatch("This Idempotency-Key was already used with a different request.")
        if decision == REPLAY:
            stored = record.stored or signals.timed(
                "read", store, functools.partial(store.read_stored, record.pk)
            )
            if stored is None:
                races = _count_race(races, options)
                continue
            return _replay(stored, scope, waited=reported_in_flight)
        assert decision == IN_FLIGHT
        if not reported_in_flight:
            emit(
                signals.in_flight,
                logging.INFO,
                "Duplicate of a request still in flight.",
                **scope.lookup(),
            )
            reported_in_flight = True
        remaining = deadline - time.monotonic()
        if not keep_waiting(seconds_left=remaining, place=place.take):
            raise InFlight(
                "A request with this Idempotency-Key is still being processed.",
                retry_after=in_flight_retry_after(record, now, options),
            )
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.5)


def _within_quota(scope: Scope, options: ClaimPolicy, limit: int) -> None:
    """Refuse a request of an account that has ``limit`` requests in progress already
    (``MAX_IN_FLIGHT_PER_ACCOUNT``), before it claims anything. A bound, not an exact
    count: requests of one account that claim at the same instant may each see room."""
    store = options.store
    if not isinstance(store, CountsInUse):
        raise ImproperlyConfigured(
            f"IDEMPOTENCY MAX_IN_FLIGHT_PER_ACCOUNT: {type(store).__name__} cannot count an "
            "account's requests in progress (the database store can)."
        )
    if store.count_in_use(scope.account, timezone.now(), limit) < limit:
        return
    emit(
        signals.quota_exceeded,
        logging.WARNING,
        "Idempotency: the account has MAX_IN_FLIGHT_PER_ACCOUNT requests in progress.",
        **scope.lookup(),
    )
    raise QuotaExceeded(
        f"This account has {limit} requests in progress, the most allowed at once; retry "
        "when one of them has completed.",
        retry_after=options.retry_after,
    )


def in_flight_retry_after(record: Snapshot, now: datetime, options: ClaimPolicy) -> int:
    """``Retry-After`` for a duplicate of a request in flight, from what is left of its lease.

    A worker renews its lease every third of it, so a live one keeps more than half of it:
    its request may end any moment, and the answer is ``RETRY_AFTER_SECONDS``. With half or
    less left, the lease has missed its renewals (its worker died, lost the store or ran
    past ``MAX_RUN_SECONDS``), and nothing changes for the key until it lapses: the seconds
    left, rounded up, never fewer than ``RETRY_AFTER_SECONDS``. ``docs/http-contract.md``.
    """
    left = lease_left(record, now)
    if left > options.lease / 2:
        return options.retry_after
    return max(options.retry_after, math.ceil(left))


def claim_again(scope: Scope, fingerprint: str, options: ClaimPolicy) -> Claim | None:
    """Claim an absent key outright, or ``None``: for an outcome whose transaction rolled
    back with its claim, but which is definitive and so must still be stored."""
    token = new_token()
    sent = time.monotonic()
    claimed = _claim_or_read(
        scope, fingerprint, token, timezone.now(), options, read=False, sent=sent
    )
    return claimed if isinstance(claimed, Claim) else None


def _claim_or_read(
    scope: Scope,
    fingerprint: str,
    token: str,
    now: datetime,
    options: ClaimPolicy,
    *,
    read: bool = True,
    bound: float | None = None,
    sent: float,
) -> Claim | Snapshot | None:
    write = _write(scope, fingerprint, token, now, options)
    store = options.store
    if not read:
        inserted = signals.timed("claim", store, lambda: store.claim(write))
        return _claim(scope, token, options, sent) if inserted else None
    with lock_wait(store, bound):
        claimed = signals.timed("claim", store, lambda: store.claim_or_read(write))
    if claimed == CLAIMED:
        emit(signals.claimed, logging.DEBUG, "Idempotency key claimed.", **scope.lookup())
        return _claim(scope, token, options, sent)
    return claimed


def _write(
    scope: Scope, fingerprint: str, token: str, now: datetime, options: ClaimPolicy
) -> Write:
    """What a claim or a take-over writes."""
    return Write(
        scope, token, fingerprint, now, timedelta(seconds=options.lease), duration(options.ttl)
    )


def _claim(scope: Scope, token: str, options: ClaimPolicy, since: float) -> Claim:
    return Claim(scope, token, options.alias, options.ttl, options.store, since)


def _count_race(races: int, options: ClaimPolicy) -> int:
    if races >= MAX_RACES:
        raise InFlight(
            "The record for this Idempotency-Key is changing under heavy contention.",
            retry_after=options.retry_after,
        )
    return races + 1


def _take_over(
    record: Snapshot, scope: Scope, fingerprint: str, token: str, now: Any, options: ClaimPolicy
) -> bool:
    write = _write(scope, fingerprint, token, now, options)
    store = options.store
    return signals.timed("claim", store, lambda: store.take_over(record, write))


def complete(claim: Claim, outcome: StoredResponse, *, body_stored: bool = True) -> bool:
    """Store the outcome for ``claim``: fenced, so it never overwrites a newer claim.

    The TTL counts from here: a stored response is replayed for ``TTL_SECONDS`` after it
    was produced, however long its view ran. Returns False (and reports
    ``completion_lost``) when the claim was lost: its lease lapsed and another request
    took the key over, which now owns the record.
    """
    now = timezone.now()
    lookup = claim.scope.lookup()
    outcome = codecs.seal(outcome, **lookup)
    completion = Completion(
        outcome.status,
        outcome.headers,
        outcome.body if body_stored else None,
        now,
        duration(claim.ttl),
    )
    store = claim.store
    if signals.timed(
        "complete", store, lambda: store.complete(claim.scope, claim.token, completion)
    ) or signals.timed(
        # a retried completion whose first attempt committed unacknowledged
        "complete",
        store,
        lambda: store.is_completed(claim.scope, claim.token),
    ):
        emit(
            signals.completed,
            logging.DEBUG,
            "Idempotency outcome stored.",
            status=outcome.status,
            size=len(outcome.body) if body_stored else 0,
            **lookup,
        )
        return True
    emit(
        signals.completion_lost,
        logging.ERROR,
        "Idempotency claim lost before completion: the view ran, but its lease lapsed and "
        "another request took the key over; the outcome was not stored.",
        status=outcome.status,
        **lookup,
    )
    return False


def release(claim: Claim) -> None:
    """Delete the claim's record so that the next retry runs the view."""
    store = claim.store
    signals.timed("release", store, lambda: store.release(claim.scope, claim.token))
    emit(signals.released, logging.INFO, "Idempotency key released.", **claim.scope.lookup())


def _replay(stored: Stored, scope: Scope, *, waited: bool = False) -> StoredResponse:
    if stored.body is None:
        raise ResponseNotStored(
            f"The first request with this Idempotency-Key completed with status "
            f"{stored.status}, but its response was not stored "
            "(it was streamed or larger than MAX_RESPONSE_BYTES)."
        )
    # Opened first: a record the codec cannot open is refused, never reported as replayed.
    try:
        response = codecs.unseal(
            StoredResponse(status=stored.status, body=stored.body, headers=stored.headers),
            **scope.lookup(),
        )
    except ResponseUnreadable:
        if signals.response_unreadable.receivers:
            signals.send(signals.response_unreadable, status=stored.status, **scope.lookup())
        raise  # codecs.unseal logged it
    # ``waited``: the key was in flight when this request came, and it waited (IN_FLIGHT
    # "wait") for the outcome it now replays.
    emit(
        signals.replayed,
        logging.DEBUG,
        "Idempotency key replayed.",
        status=stored.status,
        waited=waited,
        **scope.lookup(),
    )
    return response
