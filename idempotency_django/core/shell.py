"""The I/O shell: one protected run against the store, the transactions and the heartbeat.

``decisions.py`` says what a request does about its key; this module does it, in order,
once: claim the key or read its record (``claim_or_replay``: the store, then ``decide``),
open the request's transactions around the work (``transactions.py``), register the claim
with the heartbeat, then store the outcome or release the key, and commit. Every adapter
(``@idempotent`` on sync and async views, the DRF mixin, django-ninja, the middleware, the
task API) comes here through ``protect.py`` or ``tasks.py``; none decides a policy. Each
store operation is timed at one place (``_timed``), and each outcome is told at one place
(``_report``: its signal and its log line). The long story: ``docs/guarantees.md``,
``docs/transactions.md``, ``docs/store.md`` ("When the store fails") and
``docs/decorator.md`` (async views and disconnects).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.utils import timezone

from idempotency_django import signals
from idempotency_django.conf import conf
from idempotency_django.core import codecs
from idempotency_django.core.claims import Claim, ClaimPolicy, Scope, new_token
from idempotency_django.core.codecs import ResponseUnreadable
from idempotency_django.core.decisions import (
    IN_FLIGHT,
    MISMATCH,
    RACE,
    REPLAY,
    Resume,
    TakeOver,
    contended,
    decide,
    fits,
    in_flight_retry_after,
    keep_waiting,
    may_pass_on_retry,
    outcome_unknown,
    races_left,
    store_failure,
)
from idempotency_django.core.heartbeat import heartbeat
from idempotency_django.core.keys import fingerprints_match
from idempotency_django.core.responses import StoredResponse
from idempotency_django.core.transactions import (
    CommitFailed,
    Transactions,
    commit_inside_transaction,
    to_reopen,
    unprotected,
)
from idempotency_django.exceptions import (
    IdempotencyError,
    InFlight,
    KeyMismatch,
    QuotaExceeded,
    ResponseNotStored,
    StoreUnavailable,
    WorkNotCommitted,
)
from idempotency_django.models import IdempotencyRecord
from idempotency_django.store.base import (
    CLAIMED,
    Completion,
    CountsInUse,
    Snapshot,
    Store,
    Stored,
    Write,
    duration,
    lock_wait,
)

logger = logging.getLogger("idempotency_django")

State = IdempotencyRecord.State
V = TypeVar("V")
R = TypeVar("R")
T = TypeVar("T")

# A completion that the store failed is sent again after RETRY_FIRST_SECONDS, doubling up to
# RETRY_MAX_SECONDS (each pause jittered down to half, so that the processes a store outage
# hit do not all come back at once), until the claim's lease may lapse, less LEASE_MARGIN of
# the lease: room for the last attempt to reach the store, and for its clock to run a little
# faster than ours.
RETRY_FIRST_SECONDS = 0.05
RETRY_MAX_SECONDS = 0.5
LEASE_MARGIN = 0.05

# How long a claim made inside a transaction (atomic mode) waits for a row lock under the
# "conflict" policy: long enough for the store's own short writes on the key (a renewal, a
# purge batch), never for a duplicate's view. MariaDB/MySQL count whole seconds: 1 s there.
CONFLICT_LOCK_WAIT = 0.1


@dataclass(frozen=True)
class Policy:
    """Everything that decides how one protected run goes, resolved for this call."""

    claiming: ClaimPolicy
    mode: str
    max_run: float
    on_store_error: str
    on_disconnect: str = "finish"
    label: str = "view"  # names the view or task in warnings
    max_response_bytes: int = 1024 * 1024  # a larger outcome is kept without its body

    @property
    def alias(self) -> str:
        return self.claiming.alias

    @property
    def store(self) -> Store:
        return self.claiming.store


@dataclass(frozen=True)
class Outcome:
    """What to keep of a finished run: ``response`` is stored (its body only when
    ``body_stored``); ``None`` releases the key (a failure that a retry may fix), unless
    ``unknown``: the error the work failed with, answered by its framework (a DRF or ninja
    exception handler), that leaves its outcome unknown (``outcome_unknown``)."""

    response: StoredResponse | None
    body_stored: bool = True
    unknown: BaseException | None = None


def definitive(
    status: int,
    body: bytes | None,
    headers: Callable[[], list[tuple[str, str]]],
    policy: Policy,
    scope: Scope,
) -> Outcome:
    """The outcome to store for a definitive answer (``body`` ``None``: it was streamed).
    One rule for views and tasks (``decisions.fits``): a body larger than
    ``max_response_bytes`` (or streamed) is not stored, only that the work ran, so a repeat
    of the key is told so (``ResponseNotStored``) and never runs it again."""
    if body is not None and fits(body, policy.max_response_bytes):
        return Outcome(StoredResponse(status, body, headers()))
    _report(
        scope,
        logging.WARNING,
        "%s: idempotency response not stored (streamed, or over MAX_RESPONSE_BYTES: %d "
        "bytes); a repeat of the key will be told the work ran, not run it again.",
        policy.label,
        policy.max_response_bytes,
    )
    return Outcome(StoredResponse(status, b""), body_stored=False)


@dataclass(frozen=True)
class Replayed:
    stored: StoredResponse


@dataclass(frozen=True)
class Refused:
    error: IdempotencyError


@dataclass(frozen=True)
class Ran(Generic[V]):
    value: V


Result = Replayed | Refused | Ran[V]


class _StoreError(Exception):
    """The store failed inside an open transaction: carried out of it before it is handled."""

    def __init__(self, error: BaseException, *, claiming: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.claiming = claiming


# -- telling: each outcome at one place, each store operation timed at one place ------------


def _report(
    scope: Scope,
    level: int | None,
    message: str,
    *args: Any,
    signal: signals.IdempotencySignal | None = None,
    exc_info: BaseException | bool | None = None,
    **extra: Any,
) -> None:
    """Tell what happened to ``scope``'s key: send ``signal`` (with ``extra``) and log
    ``message`` at ``level``, the scope (and ``extra``) as structured fields (``signals``:
    ``LOG_KEYS`` and escaping). With no receiver and the level off (``claimed`` and
    ``replayed`` at DEBUG, in production), this builds nothing."""
    sending = signal is not None and signal.listened
    logging_on = level is not None and logger.isEnabledFor(level)
    if not (sending or logging_on):
        return
    lookup = scope.lookup()
    if sending:
        assert signal is not None
        signals.send(signal, **lookup, **extra)
    if logging_on:
        assert level is not None
        logger.log(
            level, message, *args, exc_info=exc_info, extra=signals.log_fields(**lookup, **extra)
        )


def _timed(operation: str, store: Store, call: Callable[[], T]) -> T:
    """``call()``, one store operation, timed for ``store_operation`` when a receiver is
    connected (``signals.timed``; with none, this is the call alone)."""
    if not signals.store_operation.listened:
        return call()
    return signals.timed(operation, store, call)


def reconnecting(alias: str, operation: Callable[[], T], store: Store) -> T:
    """Run a store operation, and once more on a fresh connection if the store could not
    be reached.

    A connection lost between requests (the server restarted, a pooler or an operator
    dropped it) costs one reconnect instead of a 503 or an unstored outcome. Every store
    operation can run twice: the claim is an insert-if-absent, the others are fenced by the
    claim's token. Inside a transaction nothing can be retried: the error propagates. Nor is
    contention (a deadlock, a lock timeout): a new connection would not change it.
    """
    store = store.bind(alias)
    try:
        return operation()
    except store.errors as error:
        if store.in_transaction() or store.failure_kind(error) != "unreachable":
            raise
        logger.warning("Idempotency store connection failed; retrying once on a new one.")
        store.reset()
        return operation()


# -- the run, for a callable ----------------------------------------------------------------


def run(
    scope: Scope,
    fingerprint: str,
    policy: Policy,
    work: Callable[[], V],
    record: Callable[[V], Outcome],
    request_transactions: Sequence[str] = (),
) -> Result[V]:
    """Run ``work`` at most once for ``scope``; ``record`` says what of its value to keep.

    ``request_transactions``: the aliases whose ``ATOMIC_REQUESTS`` transaction the adapter
    took off the view, to be given back around ``work``.
    """
    protected = Run(scope, fingerprint, policy, request_transactions)
    started = protected.start()
    if started is not None:
        return started
    if not protected.claimed:
        return Ran(unprotected(protected.reopen, work))  # failed open
    try:
        value = work()
        outcome = record(value)
    except BaseException as error:
        protected.fail(error)
        raise
    refused = protected.finish(outcome)
    return refused if refused is not None else Ran(value)


async def arun(
    scope: Scope,
    fingerprint: str,
    policy: Policy,
    work: Callable[[], Awaitable[V]],
    record: Callable[[V], Outcome],
) -> Result[V]:
    """``run`` for coroutines: always ``commit`` mode (Django has no async transactions),
    every store call off the event loop, and the disconnect policy applied.

    A cancellation (the client went away) releases the key only while the work runs, and
    only under ON_DISCONNECT "release". Before the work, the claim is released; once the
    work has returned, its outcome is recorded and stored whatever the policy (a release
    then would let the retry do the work again); either way the cancellation is re-raised
    when that is done.
    """
    protected = Run(scope, fingerprint, policy, (), mode="commit")
    started, cancelled = await _outliving_cancellation(_in_thread(protected.start))
    if cancelled is not None:
        if started is None and protected.claimed:
            # The claim committed in its thread, but nobody will run the work: free the key
            # (and its heartbeat entry) now, not when MAX_RUN_SECONDS ends its renewal.
            await _outliving_cancellation(_in_thread(protected.fail, cancelled))
        raise cancelled
    if started is not None:
        return started
    if not protected.claimed:
        return Ran(await work())
    try:
        if policy.on_disconnect == "finish":
            value, cancelled = await _outliving_cancellation(work)
        else:
            value = await work()
    except BaseException as error:
        # Includes CancelledError under ON_DISCONNECT "release": the client went away
        # mid-flight. Run to its end, so the release completes even if cancelled again.
        await _outliving_cancellation(_in_thread(protected.fail, error))
        raise
    # The work has returned: a cancellation from here on waits until its outcome is stored.
    try:
        outcome, late = await _outliving_cancellation(_in_thread(record, value))
    except BaseException as error:  # the capture failed (a template that raised)
        await _outliving_cancellation(_in_thread(protected.fail, error))
        raise
    refused, later = await _outliving_cancellation(_in_thread(protected.finish, outcome))
    cancelled = cancelled or late or later
    if cancelled is not None:
        raise cancelled
    return refused if refused is not None else Ran(value)


def _in_thread(func: Callable[..., R], *args: Any) -> Callable[[], Awaitable[R]]:
    """``func(*args)`` as a step for ``_outliving_cancellation``, off the event loop."""
    return functools.partial(sync_to_async(func), *args)


# -- claim or replay: the decision table against the store ----------------------------------


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

    The claim is one insert-if-absent: whoever inserts the row owns the key, and the unique
    index decides between concurrent inserts in any number of processes. Only a loser reads
    the row (and asks ``decide`` what to do about it), so a first request costs one
    statement to claim and one to complete, and a replay, conflict or mismatch costs two.
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
            if not contended(store.failure_kind(error)):
                raise
            # A concurrent duplicate's transaction holds the key (atomic mode), or the
            # database gave up on a lock for it: that is a request in flight, never a
            # reason to run unprotected.
            _report(scope, logging.INFO, "Idempotency key contended.", signal=signals.in_flight)
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
            # dates the claim. The earlier attempt told nothing (its reply never came): the
            # view is about to run under a new claim, so this is ``claimed``.
            _report(scope, logging.DEBUG, "Idempotency key claimed.", signal=signals.claimed)
            return _claim(scope, token, options, min(sent, sent + decision.left - options.lease))
        if isinstance(decision, TakeOver):
            if _take_over(record, scope, fingerprint, token, now, options):
                if decision.expired:
                    _report(scope, logging.DEBUG, "Expired key claimed.", signal=signals.claimed)
                else:
                    _report(
                        scope,
                        logging.WARNING,
                        "Idempotency lease lapsed; the key was taken over by a retry.",
                        signal=signals.lease_taken_over,
                    )
                return _claim(scope, token, options, sent)
            races = _count_race(races, options)
            continue
        if decision == MISMATCH:
            _report(
                scope,
                logging.INFO,
                "Idempotency key reused with a different request.",
                signal=signals.mismatch,
            )
            raise KeyMismatch("This Idempotency-Key was already used with a different request.")
        if decision == REPLAY:
            stored = record.stored or _timed(
                "read", store, functools.partial(store.read_stored, record.pk)
            )
            if stored is None:
                races = _count_race(races, options)
                continue
            return _replay(stored, scope, waited=reported_in_flight)
        assert decision == IN_FLIGHT
        if not reported_in_flight:
            _report(
                scope,
                logging.INFO,
                "Duplicate of a request still in flight.",
                signal=signals.in_flight,
            )
            reported_in_flight = True
        remaining = deadline - time.monotonic()
        if not keep_waiting(seconds_left=remaining, place=place.take):
            raise InFlight(
                "A request with this Idempotency-Key is still being processed.",
                retry_after=in_flight_retry_after(
                    record, now, lease=options.lease, retry_after=options.retry_after
                ),
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
    _report(
        scope,
        logging.WARNING,
        "Idempotency: the account has MAX_IN_FLIGHT_PER_ACCOUNT requests in progress.",
        signal=signals.quota_exceeded,
    )
    raise QuotaExceeded(
        f"This account has {limit} requests in progress, the most allowed at once; retry "
        "when one of them has completed.",
        retry_after=options.retry_after,
    )


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
    with lock_wait(store, bound):
        if read:
            claimed = _timed("claim", store, lambda: store.claim_or_read(write))
        else:  # ``claim_again``: the key is claimed if absent, and nothing is read
            inserted = _timed("claim", store, lambda: store.claim(write))
            claimed = CLAIMED if inserted else None
    if claimed == CLAIMED:
        if read:
            _report(scope, logging.DEBUG, "Idempotency key claimed.", signal=signals.claimed)
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
    if not races_left(races):
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
    return _timed("claim", store, lambda: store.take_over(record, write))


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
    if _timed(
        "complete", store, lambda: store.complete(claim.scope, claim.token, completion)
    ) or _timed(
        # a retried completion whose first attempt committed unacknowledged
        "complete",
        store,
        lambda: store.is_completed(claim.scope, claim.token),
    ):
        _report(
            claim.scope,
            logging.DEBUG,
            "Idempotency outcome stored.",
            signal=signals.completed,
            status=outcome.status,
            size=len(outcome.body) if body_stored else 0,
        )
        return True
    _report(
        claim.scope,
        logging.ERROR,
        "Idempotency claim lost before completion: the view ran, but its lease lapsed and "
        "another request took the key over; the outcome was not stored.",
        signal=signals.completion_lost,
        status=outcome.status,
    )
    return False


def release(claim: Claim) -> None:
    """Delete the claim's record so that the next retry runs the view."""
    store = claim.store
    _timed("release", store, lambda: store.release(claim.scope, claim.token))
    _report(claim.scope, logging.INFO, "Idempotency key released.", signal=signals.released)


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
        # codecs.unseal logged it
        _report(scope, None, "", signal=signals.response_unreadable, status=stored.status)
        raise
    # ``waited``: the key was in flight when this request came, and it waited (IN_FLIGHT
    # "wait") for the outcome it now replays.
    _report(
        scope,
        logging.DEBUG,
        "Idempotency key replayed.",
        signal=signals.replayed,
        status=stored.status,
        waited=waited,
    )
    return response


# -- one run: start, the work, finish or fail -----------------------------------------------


class Run:
    """One protected run, step by step: ``start``, then the work, then ``finish`` or ``fail``.

    ``run`` and ``arun`` drive it for callables; ``claim_once`` drives it for a block of
    code (a ``with`` statement), which is why the steps are separate.
    """

    def __init__(
        self,
        scope: Scope,
        fingerprint: str,
        policy: Policy,
        request_transactions: Sequence[str] = (),
        *,
        mode: str | None = None,
    ) -> None:
        self.scope = scope
        self.fingerprint = fingerprint
        self.policy = policy
        self.alias = policy.alias
        self.store = policy.store
        self.reopen = to_reopen(request_transactions) if request_transactions else []
        self.mode = mode or policy.mode
        if (
            mode is None
            and self.mode == "commit"
            and self.store.transactional
            and self.store.in_transaction()
        ):
            self.mode = commit_inside_transaction(policy.label, self.alias)
        self.claim: Claim | None = None
        self._transactions = Transactions()
        self._store_transaction = False  # the store's transaction is open around the work

    @property
    def claimed(self) -> bool:
        return self.claim is not None

    # -- start ------------------------------------------------------------------------------

    def start(self) -> Replayed | Refused | None:
        """Claim the key. ``None``: run the work (``claimed``), or run it unprotected (the
        store is unreachable and the policy fails open); otherwise answer with the result."""
        if self.mode == "atomic":
            return self._start_atomic()
        try:
            began = self._claim_or_replay(reconnect=True)
        except self.store.errors as error:
            return self._store_failed(error)
        if not isinstance(began, Claim):
            return began
        self.claim = began
        heartbeat.register(began, self.policy.claiming.lease, self.policy.max_run)
        try:
            # The store's transaction outermost: the work's databases commit before it.
            self._transactions.open(sorted(self.reopen, key=lambda alias: alias != self.alias))
        except BaseException as error:
            self.fail(error)
            raise
        self._store_transaction = self.store.transactional and self.alias in self.reopen
        return None

    def _start_atomic(self) -> Replayed | Refused | None:
        try:
            # Connect first, so that a store that is down is told apart from a failure
            # inside the transaction.
            reconnecting(self.alias, connections[self.alias].ensure_connection, self.store)
        except self.store.errors as error:
            return self._store_failed(error)
        self._transactions.open([self.alias])
        try:
            began = self._claim_or_replay(reconnect=False)  # a refusal comes back as one
        except self.store.errors as error:
            self._transactions.discard(self.alias)
            return self._store_failed(error)
        except BaseException:
            self._transactions.leave(sys.exc_info()[1])
            raise
        if not isinstance(began, Claim):
            self._transactions.discard(self.alias)
            return began
        self.claim = began
        self._store_transaction = True
        try:
            self._transactions.open([alias for alias in self.reopen if alias != self.alias])
        except BaseException as error:
            self.fail(error)
            raise
        return None

    def _claim_or_replay(self, *, reconnect: bool) -> Claim | Replayed | Refused:
        token = new_token()  # the same on a reconnected retry: see claim_or_replay

        def attempt() -> Claim | StoredResponse:
            return claim_or_replay(self.scope, self.fingerprint, self.policy.claiming, token)

        try:
            began = reconnecting(self.alias, attempt, self.store) if reconnect else attempt()
        except IdempotencyError as error:
            return Refused(error)
        if isinstance(began, StoredResponse):
            return Replayed(began)
        return began

    def _store_failed(self, error: BaseException) -> Refused | None:
        """Fail open only when the store cannot be reached; otherwise 503. (Contention never
        gets here: ``claim_or_replay`` answers it as a request in flight.)"""
        kind = self.store.failure_kind(error)
        policy = store_failure(kind, self.policy.on_store_error)
        _report(
            self.scope,
            logging.ERROR,
            "Idempotency store failed while claiming a key (%s; fail %s).",
            kind,
            policy,
            signal=signals.store_unavailable,
            exc_info=error,
            policy=policy,
            kind=kind,
        )
        if policy == "open":
            return None
        return Refused(self._unavailable("The request was not processed"))

    # -- finish -----------------------------------------------------------------------------

    def finish(self, outcome: Outcome) -> Refused | None:
        """Store the outcome (or release the key) and commit. ``None``: the work committed
        and its value can be sent; otherwise the refusal to send instead."""
        claim = self.claim
        assert claim is not None
        if outcome.unknown is not None:
            self.fail(outcome.unknown)
            return None  # the framework's answer to the error is sent
        try:
            return self._finish(claim, outcome)
        finally:
            # Only now: the lease stays renewed until the outcome is stored (or given up).
            heartbeat.unregister(claim)

    def _finish(self, claim: Claim, outcome: Outcome) -> Refused | None:
        store_after = outcome.response is not None
        lost = False
        try:
            try:
                if self._store_transaction:
                    if outcome.response is None:
                        if self.mode == "atomic":
                            # A failed outcome rolls back with its work and its claim, so
                            # that a retry starts clean.
                            self._transactions.roll_back([self.alias])
                            _report(
                                self.scope,
                                logging.INFO,
                                "Idempotency key released (rolled back).",
                                signal=signals.released,
                            )
                            store_after = False
                    elif not self._transactions.failed(self.alias):
                        store_after = False
                        lost = not self._complete(claim, outcome)
                        if lost:
                            self._transactions.roll_back()
            except _StoreError as failure:
                self._transactions.leave(failure)
                raise
            self._transactions.commit()
        except (_StoreError, CommitFailed) as failure:
            return self._not_committed(claim, failure)
        if lost:
            return Refused(
                InFlight(
                    "This request lost its claim to a retry and was rolled back.",
                    retry_after=self.policy.claiming.retry_after,
                )
            )
        if outcome.response is None:
            if self.mode == "commit":
                _release_quietly(claim)
        elif store_after:
            self._complete_after(claim, outcome)
        return None

    def fail(self, error: BaseException) -> None:
        """The work raised: roll back what is open, and release the key unless the work's
        outcome is unknown."""
        claim = self.claim
        try:
            self._transactions.leave(error)
        finally:
            if claim is not None:
                heartbeat.unregister(claim)
        if claim is None or self.mode == "atomic":
            return  # the claim rolled back with the work
        if outcome_unknown(error):
            # Releasing would let the retry do again what may have committed. The key stays
            # claimed until its lease lapses, as a crashed worker's.
            _report(
                claim.scope,
                logging.ERROR,
                "Idempotency key kept after a database connection error in the view: its work "
                "may have committed. A retry runs after the lease lapses.",
            )
            return
        _release_quietly(claim)

    def _complete(self, claim: Claim, outcome: Outcome) -> bool:
        assert outcome.response is not None
        try:
            return complete(claim, outcome.response, body_stored=outcome.body_stored)
        except self.store.errors as error:
            raise _StoreError(error, claiming=False) from error

    def _complete_after(self, claim: Claim, outcome: Outcome) -> None:
        """Store the outcome of work that committed already (or ran without a transaction
        of ours): the answer stands whatever happens here. The store failing is retried
        (``_store_outcome``) until the claim's lease may lapse."""
        response = outcome.response
        assert response is not None
        try:
            if self.mode == "atomic":
                # The work asked for its transaction to be rolled back, and the claim went
                # with it: claim the key again to store the (definitive) outcome. If a
                # duplicate claimed it in between, that one runs: this work rolled back.
                again = reconnecting(
                    claim.alias,
                    lambda: claim_again(self.scope, self.fingerprint, self.policy.claiming),
                    self.store,
                )
                if again is None:
                    return
                claim = again
            self._store_outcome(claim, response, outcome.body_stored)
        except self.store.errors as error:
            _report(
                claim.scope,
                logging.ERROR,
                "Idempotency store failed while completing a key.",
                exc_info=error,
            )
            if self.mode == "commit":  # in atomic mode the work and its claim rolled back
                _outcome_not_stored(
                    claim,
                    "Idempotency outcome NOT stored: the work committed and its response is "
                    "sent, but the store failed every completion sent (or, under "
                    "WAIT_REPLICAS, no replica acknowledged it) until the claim's lease may "
                    "lapse. The key stays in progress until its lease lapses; a retry after "
                    "that runs the work again.",
                    response.status,
                )

    def _store_outcome(self, claim: Claim, response: StoredResponse, body_stored: bool) -> bool:
        """``complete``, sent again after a store failure until it is answered, or until
        the claim's lease may lapse on the store, or a lease has passed since it was first
        sent (``_deadline``): then the last failure is raised. Each resend is fenced by the
        claim's token, and one whose first attempt committed unacknowledged finds its own
        completed record. A failure that a resend cannot fix (the database refusing the
        statement itself: ``decisions.may_pass_on_retry``) is raised at once.

        The caller waits: its answer is sent once the outcome is stored (or given up). A
        retry in the background would die with the process, and processes are recycled
        all the time (docs/store.md, "When the store fails")."""
        store = claim.store
        delay = RETRY_FIRST_SECONDS
        attempts = 0
        started = time.monotonic()
        while True:
            attempts += 1
            try:
                stored = reconnecting(
                    claim.alias,
                    lambda: complete(claim, response, body_stored=body_stored),
                    store,
                )
            except store.errors as error:
                if not may_pass_on_retry(error) or store.in_transaction():
                    raise
                pause = delay * random.uniform(0.5, 1.0)  # apart from the other processes
                remaining = self._deadline(claim, started) - time.monotonic()
                if pause >= remaining:
                    raise
                if attempts == 1:
                    _report(
                        claim.scope,
                        logging.WARNING,
                        "Idempotency store failed while completing a key; sending the "
                        "completion again until the claim's lease may lapse (%.1f s).",
                        remaining,
                        exc_info=error,
                    )
                time.sleep(pause)
                delay = min(delay * 2, RETRY_MAX_SECONDS)
                continue
            if attempts > 1 and stored:
                _report(
                    claim.scope,
                    logging.WARNING,
                    "Idempotency outcome stored after %d attempts.",
                    attempts,
                )
            return stored

    def _deadline(self, claim: Claim, started: float) -> float:
        """The ``time.monotonic()`` after which no completion is sent again: the earliest
        the claim's lease can lapse on the store (the heartbeat knows its last renewal that
        succeeded; a claim it does not renew lapses a lease after it was made), less a
        margin. MAX_RUN_SECONDS ends renewals, not this: it counts from the last one. And
        never more than a lease after ``started``: a store that takes the renewals but
        keeps failing the completion (one that no replica acknowledges) would otherwise
        hold the answer until MAX_RUN_SECONDS end the renewals."""
        lease = self.policy.claiming.lease
        lapses = heartbeat.lapses_at(claim)
        if lapses is None:
            lapses = claim.since + lease
        return min(lapses, started + lease) - lease * LEASE_MARGIN

    def _not_committed(self, claim: Claim, failure: _StoreError | CommitFailed) -> Refused:
        """The work's transaction did not commit, or the store's failed after it: never a
        2xx. Three cases:

        - the store's commit failed after the work's committed (``committed``: the store in
          a database of its own): the work stands, its outcome was not stored; a 503, and
          the key is kept until its lease lapses (docs/guarantees.md: this run lost its store);
        - the connection broke during a commit (``outcome_unknown``): maybe committed; a
          503, and the key is kept;
        - otherwise the rollback is certain and the key is released: a completion that
          failed in the transaction is the store's failure (503, retry at once); a commit
          refused for the work's own reason (a deferred constraint, a serialization
          failure) is ``WorkNotCommitted`` (500): the same request would fail the same way,
          so it is not presented as a store to wait for.
        """
        error = failure.error
        committed = isinstance(failure, CommitFailed) and bool(failure.committed)
        unknown = committed or (isinstance(failure, CommitFailed) and outcome_unknown(error))
        _report(
            claim.scope,
            logging.ERROR,
            "Idempotency: %s.",
            "the store's transaction failed to commit after the work's committed"
            if committed
            else "the work's transaction may not have committed"
            if unknown
            else "the work's transaction was rolled back",
            exc_info=error,
        )
        if unknown:
            if self.mode == "commit":
                _outcome_not_stored(
                    claim,
                    "Idempotency key kept: the work may have committed, and its outcome may "
                    "not be stored; a retry runs after the lease lapses.",
                    None,
                )
            if committed:
                return Refused(
                    self._unavailable(
                        "The request may have been carried out, but its outcome could not "
                        "be recorded"
                    )
                )
            return Refused(self._unavailable("The request's work may not have been committed"))
        if self.mode == "commit":
            _release_quietly(claim)
        if isinstance(failure, CommitFailed):
            return Refused(
                WorkNotCommitted(
                    "The request's work failed to commit and was rolled back; sending it "
                    "again with the same Idempotency-Key runs it again."
                )
            )
        return Refused(self._unavailable("The request's work was not committed"))

    def _unavailable(self, what: str) -> StoreUnavailable:
        return StoreUnavailable(
            f"{what}; retry it with the same Idempotency-Key.",
            retry_after=self.policy.claiming.retry_after,
        )


def _outcome_not_stored(claim: Claim, message: str, status: int | None) -> None:
    """Work that may have committed, and whose outcome is not stored: the key is kept (not
    released), and operators are told loudly (``outcome_not_stored``)."""
    _report(claim.scope, logging.ERROR, message, signal=signals.outcome_not_stored, status=status)


def _release_quietly(claim: Claim) -> None:
    try:
        reconnecting(claim.alias, lambda: release(claim), claim.store)
    except claim.store.errors:
        _report(
            claim.scope,
            logging.ERROR,
            "Idempotency store unavailable while releasing a key; it frees itself when its "
            "lease lapses.",
            exc_info=True,
        )


async def _outliving_cancellation(
    step: Callable[[], Awaitable[V]],
) -> tuple[V, asyncio.CancelledError | None]:
    """Run ``step`` to its end even if the request is cancelled (its client went away), and
    return the cancellation with its value, for the caller to re-raise once it is safe.

    Cancelling a view cannot call back work it already started, such as a database write
    running in a thread: releasing the key then would let the retry do it twice. So the work
    finishes, its outcome is stored, and the retry gets the replay. The same holds for the
    store's own steps (a claim committing in its thread, the capture of the outcome).
    """
    task: asyncio.Future[V] = asyncio.ensure_future(step())
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            return await asyncio.shield(task), cancelled
        except asyncio.CancelledError as error:
            if task.cancelled():
                raise  # the step itself was cancelled: it did not finish
            # Done or not: a step that returned as the cancel came is still a step that ran.
            cancelled = error
