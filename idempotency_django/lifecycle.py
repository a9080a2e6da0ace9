"""The one lifecycle of a protected unit of work: claim → run → complete or release.

Every adapter (``@idempotent`` on sync and async views, the DRF mixin, django-ninja, the
middleware, the task API) translates its own inputs and outputs and calls this; none of them
decides a policy. Every policy that decides an outcome lives here, written once: the
transaction modes and request transactions, never a 2xx for work that did not commit, the
unknown-outcome rule, the store-error policy and the disconnect policy. The long story is in
the docs: ``docs/transactions.md``, ``docs/store.md`` ("When the store fails") and
``docs/decorator.md`` (async views and disconnects).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from asgiref.sync import sync_to_async
from django.db import (
    DatabaseError,
    DataError,
    IntegrityError,
    InterfaceError,
    NotSupportedError,
    OperationalError,
    ProgrammingError,
    connections,
    transaction,
)

from idempotency_django import claims, signals
from idempotency_django.exceptions import (
    IdempotencyError,
    InFlight,
    StoreUnavailable,
    WorkNotCommitted,
)
from idempotency_django.heartbeat import heartbeat
from idempotency_django.responses import StoredResponse
from idempotency_django.store.base import Store
from idempotency_django.store.database import rolled_back

logger = logging.getLogger("idempotency_django")

V = TypeVar("V")
R = TypeVar("R")

# A completion that the store failed is sent again after RETRY_FIRST_SECONDS, doubling up to
# RETRY_MAX_SECONDS (each pause jittered down to half, so that the processes a store outage
# hit do not all come back at once), until the claim's lease may lapse, less LEASE_MARGIN of
# the lease: room for the last attempt to reach the store, and for its clock to run a little
# faster than ours.
RETRY_FIRST_SECONDS = 0.05
RETRY_MAX_SECONDS = 0.5
LEASE_MARGIN = 0.05


@dataclass(frozen=True)
class Policy:
    """Everything that decides how one protected run goes, resolved for this call."""

    claiming: claims.ClaimPolicy
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
    scope: claims.Scope,
) -> Outcome:
    """The outcome to store for a definitive answer (``body`` ``None``: it was streamed).
    One rule for views and tasks: a body larger than ``max_response_bytes`` (or streamed)
    is not stored, only that the work ran, so a repeat of the key is told so
    (``ResponseNotStored``) and never runs it again."""
    if body is not None and len(body) <= policy.max_response_bytes:
        return Outcome(StoredResponse(status, body, headers()))
    logger.warning(
        "%s: idempotency response not stored (streamed, or over MAX_RESPONSE_BYTES: %d "
        "bytes); a repeat of the key will be told the work ran, not run it again.",
        policy.label,
        policy.max_response_bytes,
        extra=signals.log_fields(**scope.lookup()),
    )
    return Outcome(StoredResponse(status, b""), body_stored=False)


def _may_pass_on_retry(error: BaseException) -> bool:
    """Whether sending a failed completion again may succeed: not when the database
    refused the statement itself (its data, its SQL), which it would refuse again. A lost
    connection, a timeout, a lock, a Redis failure may all be gone on the next attempt."""
    return not isinstance(error, (DataError, IntegrityError, ProgrammingError, NotSupportedError))


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


class _CommitFailed(Exception):
    """A transaction failed to commit; ``committed``: the aliases whose transactions had
    committed before it (the work's, when only the store's commit failed)."""

    def __init__(self, error: DatabaseError, committed: Sequence[str]) -> None:
        super().__init__(str(error))
        self.error = error
        self.committed = tuple(committed)


def run(
    scope: claims.Scope,
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
    protected = Protected(scope, fingerprint, policy, request_transactions)
    started = protected.start()
    if started is not None:
        return started
    if not protected.claimed:
        return Ran(_in_transactions(protected.reopen, work))  # failed open
    try:
        value = work()
        outcome = record(value)
    except BaseException as error:
        protected.fail(error)
        raise
    refused = protected.finish(outcome)
    return refused if refused is not None else Ran(value)


async def arun(
    scope: claims.Scope,
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
    protected = Protected(scope, fingerprint, policy, (), mode="commit")
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


class Protected:
    """One run, step by step: ``start``, then the work, then ``finish`` or ``fail``.

    ``run`` and ``arun`` drive it for callables; ``claim_once`` drives it for a block of
    code (a ``with`` statement), which is why the steps are separate.
    """

    def __init__(
        self,
        scope: claims.Scope,
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
        self.reopen = [
            alias for alias in request_transactions if not connections[alias].in_atomic_block
        ]
        self.mode = mode or self._mode()
        self.claim: claims.Claim | None = None
        self._stack = ExitStack()
        self._opened: list[str] = []
        self._committed: list[str] = []  # left without an error, in order
        self._store_transaction = False  # the store's transaction is open around the work

    @property
    def claimed(self) -> bool:
        return self.claim is not None

    def _mode(self) -> str:
        if (
            self.policy.mode == "commit"
            and self.store.transactional
            and self.store.in_transaction()
        ):
            # The claim cannot commit on its own inside somebody else's transaction. The
            # unique index still serialises duplicates (they wait for that transaction), so
            # single flight holds, with the semantics of atomic mode.
            _warn_once(self.policy.label, self.alias)
            return "atomic"
        return self.policy.mode

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
        if not isinstance(began, claims.Claim):
            return began
        self.claim = began
        heartbeat.register(began, self.policy.claiming.lease, self.policy.max_run)
        try:
            # The store's transaction outermost: the work's databases commit before it.
            self._open(sorted(self.reopen, key=lambda alias: alias != self.alias))
        except BaseException as error:
            self.fail(error)
            raise
        self._store_transaction = self.store.transactional and self.alias in self.reopen
        return None

    def _start_atomic(self) -> Replayed | Refused | None:
        try:
            # Connect first, so that a store that is down is told apart from a failure
            # inside the transaction.
            claims.reconnecting(self.alias, connections[self.alias].ensure_connection, self.store)
        except self.store.errors as error:
            return self._store_failed(error)
        self._open([self.alias])
        try:
            began = self._claim_or_replay(reconnect=False)
        except IdempotencyError as error:
            self._discard()
            return Refused(error)
        except self.store.errors as error:
            self._discard()
            return self._store_failed(error)
        except BaseException:
            self._stack.__exit__(*sys.exc_info())
            raise
        if not isinstance(began, claims.Claim):
            self._discard()
            return began
        self.claim = began
        self._store_transaction = True
        try:
            self._open([alias for alias in self.reopen if alias != self.alias])
        except BaseException as error:
            self.fail(error)
            raise
        return None

    def _claim_or_replay(self, *, reconnect: bool) -> claims.Claim | Replayed | Refused:
        token = claims.new_token()  # the same on a reconnected retry: see claims.claim_or_replay

        def attempt() -> claims.Claim | StoredResponse:
            return claims.claim_or_replay(self.scope, self.fingerprint, self.policy.claiming, token)

        try:
            began = claims.reconnecting(self.alias, attempt, self.store) if reconnect else attempt()
        except IdempotencyError as error:
            return Refused(error)
        if isinstance(began, StoredResponse):
            return Replayed(began)
        return began

    def _store_failed(self, error: BaseException) -> Refused | None:
        """Fail open only when the store cannot be reached; otherwise 503. (Contention never
        gets here: ``claims.claim_or_replay`` answers it as a request in flight.)"""
        kind = self.store.failure_kind(error)
        policy = self.policy.on_store_error if kind == "unreachable" else "closed"
        logger.error(
            "Idempotency store failed while claiming a key (%s; fail %s).",
            kind,
            policy,
            exc_info=error,
            extra=signals.log_fields(**self.scope.lookup()),
        )
        signals.send(signals.store_unavailable, policy=policy, kind=kind, **self.scope.lookup())
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

    def _finish(self, claim: claims.Claim, outcome: Outcome) -> Refused | None:
        store_after = outcome.response is not None
        lost = False
        try:
            try:
                if self._store_transaction:
                    if outcome.response is None:
                        if self.mode == "atomic":
                            # A failed outcome rolls back with its work and its claim, so
                            # that a retry starts clean.
                            transaction.set_rollback(True, using=self.alias)
                            self._emit_released("Idempotency key released (rolled back).")
                            store_after = False
                    elif not connections[self.alias].needs_rollback:
                        store_after = False
                        lost = not self._complete(claim, outcome)
                        if lost:
                            for alias in self._opened:
                                transaction.set_rollback(True, using=alias)
            except _StoreError:
                self._stack.__exit__(*sys.exc_info())
                raise
            self._commit()
        except (_StoreError, _CommitFailed) as failure:
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
            self._stack.__exit__(type(error), error, error.__traceback__)
        finally:
            if claim is not None:
                heartbeat.unregister(claim)
        if claim is None or self.mode == "atomic":
            return  # the claim rolled back with the work
        if outcome_unknown(error):
            # Releasing would let the retry do again what may have committed. The key stays
            # claimed until its lease lapses, as a crashed worker's.
            logger.error(
                "Idempotency key kept after a database connection error in the view: its work "
                "may have committed. A retry runs after the lease lapses.",
                extra=signals.log_fields(**claim.scope.lookup()),
            )
            return
        _release_quietly(claim)

    def _complete(self, claim: claims.Claim, outcome: Outcome) -> bool:
        assert outcome.response is not None
        try:
            return claims.complete(claim, outcome.response, body_stored=outcome.body_stored)
        except self.store.errors as error:
            raise _StoreError(error, claiming=False) from error

    def _complete_after(self, claim: claims.Claim, outcome: Outcome) -> None:
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
                again = claims.reconnecting(
                    claim.alias,
                    lambda: claims.claim_again(self.scope, self.fingerprint, self.policy.claiming),
                    self.store,
                )
                if again is None:
                    return
                claim = again
            self._store_outcome(claim, response, outcome.body_stored)
        except self.store.errors as error:
            logger.error(
                "Idempotency store failed while completing a key.",
                exc_info=error,
                extra=signals.log_fields(**claim.scope.lookup()),
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

    def _store_outcome(
        self, claim: claims.Claim, response: StoredResponse, body_stored: bool
    ) -> bool:
        """``claims.complete``, sent again after a store failure until it is answered, or
        until the claim's lease may lapse on the store, or a lease has passed since it was
        first sent (``_deadline``): then the last failure is raised. Each resend is fenced
        by the claim's token, and one whose first attempt committed unacknowledged finds its
        own completed record. A failure that a resend cannot fix (the database refusing the
        statement itself) is raised at once.

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
                stored = claims.reconnecting(
                    claim.alias,
                    lambda: claims.complete(claim, response, body_stored=body_stored),
                    store,
                )
            except store.errors as error:
                if not _may_pass_on_retry(error) or store.in_transaction():
                    raise
                pause = delay * random.uniform(0.5, 1.0)  # apart from the other processes
                remaining = self._deadline(claim, started) - time.monotonic()
                if pause >= remaining:
                    raise
                if attempts == 1:
                    logger.warning(
                        "Idempotency store failed while completing a key; sending the "
                        "completion again until the claim's lease may lapse (%.1f s).",
                        remaining,
                        exc_info=error,
                        extra=signals.log_fields(**claim.scope.lookup()),
                    )
                time.sleep(pause)
                delay = min(delay * 2, RETRY_MAX_SECONDS)
                continue
            if attempts > 1 and stored:
                logger.warning(
                    "Idempotency outcome stored after %d attempts.",
                    attempts,
                    extra=signals.log_fields(**claim.scope.lookup()),
                )
            return stored

    def _deadline(self, claim: claims.Claim, started: float) -> float:
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

    def _not_committed(self, claim: claims.Claim, failure: _StoreError | _CommitFailed) -> Refused:
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
        committed = isinstance(failure, _CommitFailed) and bool(failure.committed)
        unknown = committed or (isinstance(failure, _CommitFailed) and outcome_unknown(error))
        logger.error(
            "Idempotency: %s.",
            "the store's transaction failed to commit after the work's committed"
            if committed
            else "the work's transaction may not have committed"
            if unknown
            else "the work's transaction was rolled back",
            exc_info=error,
            extra=signals.log_fields(**claim.scope.lookup()),
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
        if isinstance(failure, _CommitFailed):
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

    def _emit_released(self, message: str) -> None:
        signals.emit(signals.released, logging.INFO, message, **self.scope.lookup())

    # -- transactions -----------------------------------------------------------------------

    def _open(self, aliases: Sequence[str]) -> None:
        for alias in aliases:
            self._stack.push(self._left(alias))  # runs after that transaction is left
            self._stack.enter_context(transaction.atomic(using=alias))
            self._opened.append(alias)

    def _left(self, alias: str) -> Callable[..., bool]:
        def left(exc_type: type[BaseException] | None, *exc_info: object) -> bool:
            if exc_type is None:
                self._committed.append(alias)
            return False  # never swallows an error

        return left

    def _commit(self) -> None:
        """Leave the open transactions: the work's databases commit before the store's."""
        try:
            self._stack.close()
        except DatabaseError as error:
            raise _CommitFailed(error, self._committed) from error

    def _discard(self) -> None:
        """Leave the transaction of a claim that was not made: nothing to keep."""
        transaction.set_rollback(True, using=self.alias)
        self._stack.close()


def unprotected(aliases: Sequence[str], work: Callable[[], V]) -> V:
    """Run work that is not protected in the request transactions it was opted out of."""
    return _in_transactions(aliases, work)


def _in_transactions(aliases: Sequence[str], work: Callable[[], V]) -> V:
    with ExitStack() as stack:
        for alias in aliases:
            stack.enter_context(transaction.atomic(using=alias))
        return work()


def _outcome_not_stored(claim: claims.Claim, message: str, status: int | None) -> None:
    """Work that may have committed, and whose outcome is not stored: the key is kept (not
    released), and operators are told loudly (``outcome_not_stored``)."""
    signals.emit(
        signals.outcome_not_stored, logging.ERROR, message, status=status, **claim.scope.lookup()
    )


def _release_quietly(claim: claims.Claim) -> None:
    try:
        claims.reconnecting(claim.alias, lambda: claims.release(claim), claim.store)
    except claim.store.errors:
        logger.exception(
            "Idempotency store unavailable while releasing a key; it frees itself when its "
            "lease lapses.",
            extra=signals.log_fields(**claim.scope.lookup()),
        )


_warned: set[tuple[str, str]] = set()


def _warn_once(label: str, alias: str) -> None:
    if (label, alias) in _warned:
        return
    _warned.add((label, alias))
    logger.warning(
        "Idempotency MODE 'commit' for %s inside an open transaction on %r: it runs in atomic "
        "mode (claim, work and outcome in that transaction). %s In a test, use a "
        "transactional test case (TransactionTestCase, or django_db(transaction=True)) to "
        "test commit mode.",
        label,
        alias,
        _advice(label),
    )


def _advice(label: str) -> str:
    """What gives commit mode back, outside tests: it depends on who opened the transaction.
    ninja's view is inside ``ATOMIC_REQUESTS`` before the operation runs, and
    ``non_atomic_requests`` on the operation's function does not reach it."""
    if "ninja" in label or label.startswith("IdempotentRouter"):
        return (
            "Outside tests, put the store on a database alias of its own (IDEMPOTENCY "
            "'DATABASE'), outside the request transaction, or use MODE 'atomic'."
        )
    if label.startswith("Task "):
        return "Outside tests, call the task outside any transaction, or use mode 'atomic'."
    return "Outside tests, use @transaction.non_atomic_requests or MODE 'atomic'."


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
