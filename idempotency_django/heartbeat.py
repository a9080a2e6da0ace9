"""Lease renewal: one thread per process renews all of that process's in-flight claims.

A claim's lease only has to outlive a *dead* worker, not the slowest honest request:
while a view runs, this thread pushes its lease forward every third of the lease, in
one ``UPDATE`` for all claims of the process. A claim that has run past
``MAX_RUN_SECONDS`` is no longer renewed, so a wedged view eventually lets a retry in.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from functools import reduce
from operator import or_

from django.db import DatabaseError, connections
from django.db.models import Q
from django.utils import timezone

from idempotency_django.engine import Claim, State
from idempotency_django.models import IdempotencyRecord

logger = logging.getLogger("idempotency_django")


@dataclass(frozen=True)
class _Entry:
    claim: Claim
    lease: float
    stop_renewing_at: float


class Heartbeat:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid: int | None = None
        self._stopping = False

    def register(self, claim: Claim, lease: float, max_run: float) -> None:
        with self._lock:
            shortest = min((entry.lease for entry in self._entries.values()), default=None)
            self._entries[claim.token] = _Entry(claim, lease, time.monotonic() + max_run)
            self._ensure_thread()
        if shortest is None or lease < shortest:
            self._wake.set()

    def unregister(self, claim: Claim) -> None:
        with self._lock:
            self._entries.pop(claim.token, None)
            idle = not self._entries
        if idle:
            self._wake.set()  # let the thread drop its database connection now

    def stop(self) -> None:
        """Forget every claim and end the thread (tests, and process shutdown hooks)."""
        with self._lock:
            self._entries.clear()
            self._stopping = True
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        with self._lock:
            self._stopping = False
            self._thread = None

    def renew_once(self) -> int:
        """Renew every live claim once; returns how many records were renewed."""
        now_monotonic = time.monotonic()
        with self._lock:
            overdue = [e for e in self._entries.values() if e.stop_renewing_at <= now_monotonic]
            for entry in overdue:
                del self._entries[entry.claim.token]
            entries = list(self._entries.values())
        for entry in overdue:
            logger.warning(
                "Idempotency claim ran past MAX_RUN_SECONDS; its lease is no longer renewed.",
                extra={"idempotency_key": entry.claim.scope.key},
            )
        groups: dict[tuple[str, float], list[Claim]] = {}
        for entry in entries:
            groups.setdefault((entry.claim.alias, entry.lease), []).append(entry.claim)
        renewed = 0
        now = timezone.now()
        for (alias, lease), claims in groups.items():
            owned = reduce(or_, (Q(token=c.token, **c.scope.lookup()) for c in claims))
            renewed += (
                IdempotencyRecord.objects.using(alias)
                .filter(owned, state=State.IN_PROGRESS)
                .update(lease_expires_at=now + timedelta(seconds=lease))
            )
        return renewed

    def _interval(self) -> float | None:
        with self._lock:
            if not self._entries:
                return None
            return min(entry.lease for entry in self._entries.values()) / 3

    def _ensure_thread(self) -> None:
        # After a fork (gunicorn --preload) the parent's thread does not exist in the child.
        if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
            return
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="idempotency-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        due: float | None = None
        while not self._stopping:
            interval = self._interval()
            if interval is None:
                # Idle: hold no database connection, so tests and restarts can drop it.
                connections.close_all()
                self._wake.wait()
                self._wake.clear()
                due = None
                continue
            now = time.monotonic()
            if due is None or due > now + interval:
                due = now + interval
            if self._wake.wait(max(0.0, due - now)):
                # A claim with a shorter lease arrived: recompute when the next beat is due.
                self._wake.clear()
                continue
            due = None
            try:
                self.renew_once()
            except DatabaseError:
                logger.exception("Idempotency heartbeat could not renew leases; will retry.")
                connections.close_all()
        connections.close_all()


heartbeat = Heartbeat()
