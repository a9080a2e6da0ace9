"""Lease renewal: one thread per process renews all of that process's in-flight claims.

A claim's lease only has to outlive a *dead* worker, not the slowest honest request: while
a view runs, and until its outcome is stored, this thread pushes its lease forward every
third of the lease, in one statement for all claims of the process. A claim that has run
past ``MAX_RUN_SECONDS`` is no longer renewed, so a wedged view eventually lets a retry in.
Every claim of the process depends on this thread, so it keeps beating whatever happens to
one renewal (``Heartbeat``). It also knows when each claim was last renewed, so that a
completion the store refuses is retried until the lease may lapse, and no longer
(``lapses_at``). The long story: ``docs/transactions.md``, ``docs/store.md`` and
``docs/performance.md``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace

from django.db import connections

from idempotency_django import signals
from idempotency_django.core.claims import Claim
from idempotency_django.store.base import Store

logger = logging.getLogger("idempotency_django")

THREAD_NAME = "idempotency-heartbeat"


@dataclass(frozen=True)
class _Entry:
    claim: Claim
    lease: float
    stop_renewing_at: float
    # ``time.monotonic()`` when the claim, or its last renewal that succeeded, was sent.
    renewed_at: float
    # False once past MAX_RUN_SECONDS: kept (its ``lapses_at`` still counts), not renewed.
    renewing: bool = True


@dataclass(frozen=True)
class HeartbeatStatus:
    """What one process's heartbeat can say of itself (``Heartbeat.status``): the health
    check's "heartbeat alive", and the admin overview's view of a Redis store."""

    #: This process's claims whose work has not ended, and those of them still renewed
    #: (the others ran past ``MAX_RUN_SECONDS``).
    claims: int
    renewing: int
    #: Whether the renewing thread runs (it starts with the first claim, ends when stopped).
    thread_alive: bool
    #: Seconds since the oldest of these claims was made (None: no claim).
    oldest_claim_age: float | None
    #: Seconds since the renewing claim renewed longest ago was last renewed (None: none).
    renewal_age: float | None
    #: Renewing claims whose last renewal that succeeded is more than two beats old (two
    #: thirds of their lease): one more missed beat and the lease lapses under a live view.
    late: int

    @property
    def alive(self) -> bool:
        """Nothing to renew, or a running thread that keeps every lease ahead of its lapse."""
        return self.renewing == 0 or (self.thread_alive and self.late == 0)


@dataclass(frozen=True)
class _Worker:
    """One heartbeat thread and the events that only it waits on."""

    thread: threading.Thread
    stop: threading.Event
    wake: threading.Event


class Heartbeat:
    """The process's renewals. The thread must keep beating whatever happens to one
    renewal, because every claim of the process depends on it:

    - a renewal is bounded by one beat (the store's statement timeout on PostgreSQL and
      MariaDB, its socket timeout on Redis), so a row lock held elsewhere cannot hold every
      other lease past its expiry; when a renewal for several claims fails, each claim is
      renewed on its own, so one locked row costs only its own renewal (``_renew_group``);
    - any exception is logged and the next beat runs;
    - ``stop()`` ends exactly the thread it found (each thread has its own stop event), so a
      ``register()`` racing it starts one new thread and never leaves zero or two;
    - a forked child (``gunicorn --preload``, ``multiprocessing``) starts empty, with a fresh
      lock and no thread: the parent's claims are the parent's to renew.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._worker: _Worker | None = None
        # The interval the thread is sleeping on (None: idle, or about to look again).
        # A claim whose beat is no shorter needs no wake-up: the thread's next beat comes
        # soon enough for it, so a request costs no thread switch.
        self._sleeping: float | None = None
        _instances.add(self)

    @property
    def _thread(self) -> threading.Thread | None:
        """The current thread, if any (for tests and debugging)."""
        worker = self._worker
        return worker.thread if worker is not None else None

    def register(self, claim: Claim, lease: float, max_run: float) -> None:
        with self._lock:
            stop = time.monotonic() + max_run
            self._entries[claim.token] = _Entry(claim, lease, stop, claim.since)
            worker = self._ensure_worker()
            sleeping = self._sleeping
        if sleeping is None or lease / 3 < sleeping:
            worker.wake.set()

    def unregister(self, claim: Claim) -> None:
        """Forget ``claim``. The thread is not woken: at its next beat it finds nothing to
        renew, drops its database connection and goes idle."""
        with self._lock:
            self._entries.pop(claim.token, None)

    def lapses_at(self, claim: Claim) -> float | None:
        """The ``time.monotonic()`` before which ``claim``'s lease cannot lapse on the store:
        a lease after the claim, or its last renewal that succeeded, was *sent* (the store
        wrote it later, and counts the lease from then). ``None``: not registered.

        A renewal that succeeded renewed every claim it named whose record is still that
        claim's and in progress; one that it did not renew is completed (its lease no longer
        matters) or lost to a take-over (its completion is fenced out whatever the time)."""
        with self._lock:
            entry = self._entries.get(claim.token)
        return None if entry is None else entry.renewed_at + entry.lease

    def status(self) -> HeartbeatStatus:
        """This process's claims and how recently each was renewed (``HeartbeatStatus``).
        Another process's heartbeat is its own: a health probe sees the process it hits."""
        now = time.monotonic()
        with self._lock:
            entries = list(self._entries.values())
            worker = self._worker
        renewing = [entry for entry in entries if entry.renewing]
        alive = worker is not None and worker.thread.is_alive() and not worker.stop.is_set()
        return HeartbeatStatus(
            claims=len(entries),
            renewing=len(renewing),
            thread_alive=alive,
            oldest_claim_age=now - min(e.claim.since for e in entries) if entries else None,
            renewal_age=now - min(e.renewed_at for e in renewing) if renewing else None,
            late=sum(now - e.renewed_at > e.lease * 2 / 3 for e in renewing),
        )

    def _renewed(self, claims: Sequence[Claim], sent: float) -> None:
        with self._lock:
            for claim in claims:
                entry = self._entries.get(claim.token)
                if entry is not None and entry.renewed_at < sent:
                    self._entries[claim.token] = replace(entry, renewed_at=sent)

    def stop(self, timeout: float | None = 5) -> None:
        """Forget every claim and end the thread (tests, and process shutdown hooks).

        The thread is told to stop through its own event and forgotten at once, under the
        lock: a ``register()`` that comes while it finishes a renewal starts a new thread
        with a new event, which nothing here can stop by mistake. Waits up to ``timeout``
        seconds for the old thread to end (a renewal is bounded by its statement timeout).
        """
        with self._lock:
            self._entries.clear()
            worker, self._worker = self._worker, None
        if worker is None:
            return
        worker.stop.set()
        worker.wake.set()
        if worker.thread is not threading.current_thread():
            worker.thread.join(timeout)

    def renew_once(self) -> int:
        """Renew every live claim once; returns how many records were renewed.

        Never raises: a failure is logged, and costs only the claims it concerns.
        """
        now_monotonic = time.monotonic()
        with self._lock:
            overdue = [
                e
                for e in self._entries.values()
                if e.renewing and e.stop_renewing_at <= now_monotonic
            ]
            for entry in overdue:
                # Kept until its run ends: its completion is still retried until the lease
                # it was last renewed for may lapse (``lapses_at``).
                self._entries[entry.claim.token] = replace(entry, renewing=False)
            entries = [e for e in self._entries.values() if e.renewing]
        for entry in overdue:
            logger.warning(
                "Idempotency claim ran past MAX_RUN_SECONDS; its lease is no longer renewed.",
                extra=signals.log_fields(**entry.claim.scope.lookup()),
            )
        if not entries:
            self._report()
            return 0
        # No statement may take longer than a beat: the next beat is due by then.
        timeout = min(entry.lease for entry in entries) / 3
        groups: dict[tuple[int, str, float], list[Claim]] = {}
        for entry in entries:
            claim = entry.claim
            groups.setdefault((id(claim.store), claim.alias, entry.lease), []).append(claim)
        renewed = 0
        failures = [0]
        for (_, alias, lease), claims in groups.items():
            renewed += self._renew_group(alias, lease, claims, timeout, failures)
        self._report(failures[0])
        return renewed

    def _report(self, failures: int = 0) -> None:
        """Send ``heartbeat_beat``: what the metrics sample of this process's claims (how
        many, the oldest's age, the stalest lease) and its renewals that failed."""
        if not signals.heartbeat_beat.listened:
            return
        now = time.monotonic()
        with self._lock:
            entries = list(self._entries.values())
        renewing = [entry.renewed_at for entry in entries if entry.renewing]
        signals.dispatch(
            signals.heartbeat_beat,
            in_flight=len(entries),
            oldest_age=now - min(entry.claim.since for entry in entries) if entries else 0.0,
            lag=now - min(renewing) if renewing else 0.0,
            failures=failures,
        )

    def _renew_group(
        self,
        alias: str,
        lease: float,
        claims: list[Claim],
        timeout: float,
        failures: list[int] | None = None,
    ) -> int:
        """Renew ``claims`` in one statement, or one by one if that statement fails.

        The one statement waits for every row it touches: one row locked by another
        transaction (an operator's, a long purge batch) would fail all of them at the
        statement timeout, beat after beat, until every lease had lapsed. One by one, only
        the locked row waits. A connection that is gone is not tried once per claim.
        ``failures[0]`` counts the claims whose renewal failed.
        """
        failed = failures if failures is not None else [0]
        try:
            sent = time.monotonic()
            renewed = _renew(alias, lease, claims, timeout)
            self._renewed(claims, sent)
            return renewed
        except Exception:
            if len(claims) == 1 or not claims[0].store.bind(alias).usable():
                logger.exception(
                    "Idempotency heartbeat could not renew %d lease(s); will retry.",
                    len(claims),
                )
                failed[0] += len(claims)
                return 0
        renewed = 0
        for claim in claims:
            try:
                sent = time.monotonic()
                renewed += _renew(alias, lease, [claim], timeout)
                self._renewed([claim], sent)
            except Exception:
                failed[0] += 1
                logger.warning(
                    "Idempotency heartbeat could not renew a lease; will retry.",
                    exc_info=True,
                    extra=signals.log_fields(**claim.scope.lookup()),
                )
        return renewed

    def _interval(self) -> float | None:
        """The interval to sleep on, recorded for ``register`` (under the same lock)."""
        with self._lock:
            leases = [entry.lease for entry in self._entries.values() if entry.renewing]
            self._sleeping = min(leases) / 3 if leases else None
            return self._sleeping

    def _ensure_worker(self) -> _Worker:
        """The running worker, or a new one. Called with the lock held."""
        worker = self._worker
        if worker is not None and worker.thread.is_alive() and not worker.stop.is_set():
            return worker
        if worker is not None:
            worker.stop.set()  # it died (or is ending): make sure it stays ended
            worker.wake.set()
        self._sleeping = None
        stop, wake = threading.Event(), threading.Event()
        thread = threading.Thread(
            target=self._run, args=(stop, wake), name=THREAD_NAME, daemon=True
        )
        self._worker = worker = _Worker(thread, stop, wake)
        thread.start()
        return worker

    def _run(self, stop: threading.Event, wake: threading.Event) -> None:
        due: float | None = None
        try:
            while not stop.is_set():
                interval = self._interval()
                if interval is None:
                    # Idle: hold no database connection, so tests and restarts can drop it.
                    self._report()  # nothing in flight any more
                    connections.close_all()
                    wake.wait()
                    wake.clear()
                    due = None
                    continue
                now = time.monotonic()
                if due is None or due > now + interval:
                    due = now + interval
                if wake.wait(max(0.0, due - now)):
                    # A claim with a shorter lease arrived, or stop(): look again.
                    wake.clear()
                    continue
                due = None
                try:
                    self.renew_once()
                except Exception:  # renew_once logs its own failures; this is a backstop
                    logger.exception("Idempotency heartbeat failed; will retry.")
                    connections.close_all()
        finally:
            connections.close_all()

    def _after_fork_in_child(self) -> None:
        """Start the child empty: no claims, a lock nobody holds, no thread.

        The parent's thread does not exist in the child, and its lock or events may have
        been held by a thread that no longer exists either. The claims are the parent's:
        it renews them, and it alone knows when they end.
        """
        self._lock = threading.Lock()
        self._entries = {}
        self._worker = None
        self._sleeping = None


def _renew(alias: str, lease: float, claims: list[Claim], timeout: float) -> int:
    """Renew ``claims`` (all of one store) for ``lease`` seconds, bounded by ``timeout``."""
    store: Store = claims[0].store.bind(alias)
    named = [(c.scope, c.token) for c in claims]
    return signals.timed("renew", store, lambda: store.renew(named, lease, timeout))


# Every Heartbeat of the process, reset in a forked child (weakly held: tests make many).
_instances: weakref.WeakSet[Heartbeat] = weakref.WeakSet()


def _reset_after_fork() -> None:
    for instance in list(_instances):
        instance._after_fork_in_child()


if hasattr(os, "register_at_fork"):  # POSIX; there is no fork() elsewhere
    os.register_at_fork(after_in_child=_reset_after_fork)


heartbeat = Heartbeat()
