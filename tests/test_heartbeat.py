"""Lease renewal: what a beat renews and what it leaves alone, and the thread that beats.

The thread's tests synchronise on events (a wrapper around ``renew_once`` reports each
beat), never on sleeps; the short leases only make the beats come quickly.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from idempotency_django import signals
from idempotency_django.core import claims, shell
from idempotency_django.core import heartbeat as heartbeat_module
from idempotency_django.core.heartbeat import THREAD_NAME, Heartbeat, heartbeat
from idempotency_django.models import IdempotencyRecord
from tests import records
from tests.conftest import another_waits_for_a_row_lock, wait_until
from tests.project.logs import everything_logged

pytestmark = pytest.mark.django_db(transaction=True)

OPTIONS = claims.ClaimPolicy(
    "default", lease=5, ttl=60, in_flight="conflict", wait_seconds=0, retry_after=1
)


def claim(key: str) -> claims.Claim:
    began = shell.claim_or_replay(claims.Scope("1", "POST /x/", key), "f" * 64, OPTIONS)
    assert isinstance(began, claims.Claim)
    return began


def lease_of(key: str) -> object:
    return records.get(key=key).lease_expires_at


@pytest.fixture
def beat() -> Iterator[Heartbeat]:
    heartbeat = Heartbeat()
    yield heartbeat
    heartbeat.stop()


@pytest.mark.database_store("counts SQL UPDATEs (the Redis store's round trips: test_redis_store)")
def test_a_beat_renews_every_registered_claim_in_one_statement(beat: Heartbeat) -> None:
    claims = [claim("a"), claim("b"), claim("c")]
    records.update(lease_expires_at=timezone.now() + timedelta(seconds=1))
    for each in claims:
        beat.register(each, lease=30, max_run=60)
    # The thread sleeps for a third of the lease (10 s) before its first beat; drive one now.
    with CaptureQueriesContext(connections["default"]) as queries:
        assert beat.renew_once() == 3

    # One UPDATE (on PostgreSQL inside a short transaction that sets its timeout; on
    # MariaDB behind SET STATEMENT max_statement_time=… FOR).
    assert len([q for q in queries if "UPDATE " in q["sql"].upper()]) == 1

    for key in "abc":
        assert lease_of(key) > timezone.now() + timedelta(seconds=25)  # type: ignore[operator]


def test_unregistered_claims_are_not_renewed(beat: Heartbeat) -> None:
    done = claim("done")
    beat.register(done, lease=30, max_run=60)
    beat.unregister(done)
    before = lease_of("done")

    assert beat.renew_once() == 0
    assert lease_of("done") == before


def test_a_claim_past_max_run_is_no_longer_renewed(beat: Heartbeat) -> None:
    wedged = claim("wedged")
    beat.register(wedged, lease=30, max_run=0)
    before = lease_of("wedged")

    assert beat.renew_once() == 0
    assert lease_of("wedged") == before
    assert beat.renew_once() == 0  # and it was dropped, not retried


def test_a_beat_never_renews_a_claim_that_was_taken_over(beat: Heartbeat) -> None:
    lost = claim("k")
    beat.register(lost, lease=30, max_run=60)
    records.update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    winner = claim("k")
    assert winner.token != lost.token
    winner_lease = lease_of("k")

    assert beat.renew_once() == 0
    assert lease_of("k") == winner_lease


def test_a_beat_never_renews_a_completed_record(beat: Heartbeat) -> None:
    from idempotency_django.responses import StoredResponse

    finished = claim("k")
    beat.register(finished, lease=30, max_run=60)
    assert shell.complete(finished, StoredResponse(201, b"{}"))

    assert beat.renew_once() == 0
    assert records.get().lease_expires_at is None


def beats(beat: Heartbeat, monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Report every beat of ``beat``'s thread: returns a function that waits for the next
    beat that renewed something and returns how many records it renewed."""
    renewed: list[int] = []
    beat_done = threading.Condition()
    real = beat.renew_once

    def reporting() -> int:
        count = real()
        with beat_done:
            renewed.append(count)
            beat_done.notify_all()
        return count

    monkeypatch.setattr(beat, "renew_once", reporting)

    def next_renewal() -> int:
        with beat_done:
            seen = len(renewed)
            assert beat_done.wait_for(lambda: any(renewed[seen:]), timeout=10), "no beat"
            return next(count for count in renewed[seen:] if count)

    return next_renewal


def test_the_heartbeat_thread_renews_leases_by_itself(
    beat: Heartbeat, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real thread, with a lease of 0.3 s: a beat moves the registered claim's lease
    forward, and only its."""
    next_renewal = beats(beat, monkeypatch)
    live, other = claim("live"), claim("other")
    records.update(lease_expires_at=timezone.now())
    before = {key: lease_of(key) for key in ("live", "other")}

    beat.register(live, lease=0.3, max_run=60)
    assert next_renewal() == 1

    assert lease_of("live") > before["live"]  # type: ignore[operator]
    assert lease_of("other") == before["other"]
    assert other.token not in beat._entries


def test_stop_ends_the_thread(beat: Heartbeat) -> None:
    beat.register(claim("k"), lease=30, max_run=60)
    thread = beat._thread
    assert thread is not None
    assert thread.is_alive()

    beat.stop()

    assert not thread.is_alive()
    assert beat.renew_once() == 0


# --- the thread: stop and start, failures, forks ------------------------------------------------


def heartbeat_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()]


@pytest.fixture
def only_beat(beat: Heartbeat) -> Heartbeat:
    """``beat``, with the process-wide heartbeat stopped: its threads are the only ones."""
    heartbeat.stop()
    assert heartbeat_threads() == []
    return beat


def test_stop_then_register_leaves_one_thread(only_beat: Heartbeat) -> None:
    only_beat.register(claim("a"), lease=30, max_run=60)
    only_beat.stop()
    only_beat.register(claim("b"), lease=30, max_run=60)

    assert heartbeat_threads() == [only_beat._thread]


def test_register_racing_stop_leaves_exactly_one_live_thread(
    only_beat: Heartbeat, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim registered while ``stop()`` waits for the old thread to finish a beat gets a
    thread of its own, and the old thread still ends: one thread, not zero or two."""
    in_renewal, finish_renewal = threading.Event(), threading.Event()
    real = only_beat.renew_once

    def slow_first_beat() -> int:
        if not in_renewal.is_set():
            in_renewal.set()
            assert finish_renewal.wait(10)
        return real()

    monkeypatch.setattr(only_beat, "renew_once", slow_first_beat)
    only_beat.register(claim("a"), lease=0.3, max_run=60)
    assert in_renewal.wait(10)
    old = only_beat._thread
    assert old is not None
    joining = threading.Event()
    real_join = old.join

    def reporting_join(timeout: float | None = None) -> None:
        joining.set()
        real_join(timeout)

    old.join = reporting_join  # type: ignore[method-assign]
    stopper = threading.Thread(target=only_beat.stop)
    stopper.start()
    assert joining.wait(10)  # stop() is waiting for the old thread, mid-beat

    later = claim("b")
    only_beat.register(later, lease=30, max_run=60)
    finish_renewal.set()
    stopper.join(10)

    assert not stopper.is_alive()
    assert not old.is_alive()
    assert only_beat._thread is not None
    assert only_beat._thread is not old
    assert heartbeat_threads() == [only_beat._thread]
    assert list(only_beat._entries) == [later.token]


def test_a_thread_that_died_is_replaced(only_beat: Heartbeat) -> None:
    dead = threading.Thread(target=lambda: None, name=THREAD_NAME)
    dead.start()
    dead.join()
    only_beat._worker = heartbeat_module._Worker(dead, threading.Event(), threading.Event())

    only_beat.register(claim("a"), lease=30, max_run=60)

    assert only_beat._thread is not dead
    assert heartbeat_threads() == [only_beat._thread]


def test_an_unexpected_error_does_not_end_the_renewals(
    only_beat: Heartbeat, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Not only a DatabaseError: whatever a beat raises, the next beat runs."""
    failed = threading.Event()
    real = only_beat.renew_once

    def fails_once() -> int:
        if not failed.is_set():
            failed.set()
            raise RuntimeError("a bug in a beat")
        return real()

    monkeypatch.setattr(only_beat, "renew_once", fails_once)
    next_renewal = beats(only_beat, monkeypatch)
    live = claim("live")
    records.update(lease_expires_at=timezone.now())
    before = lease_of("live")

    with caplog.at_level(logging.ERROR, logger="idempotency_django"):
        only_beat.register(live, lease=0.3, max_run=60)
        assert next_renewal() == 1

    assert failed.is_set()
    assert lease_of("live") > before  # type: ignore[operator]
    assert "a bug in a beat" in caplog.text
    assert heartbeat_threads() == [only_beat._thread]


def test_a_failing_group_does_not_stop_the_others_in_the_same_beat(
    beat: Heartbeat, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    beat.register(claim("short"), lease=20, max_run=60)
    beat.register(claim("long"), lease=30, max_run=60)
    real = heartbeat_module._renew

    def broken_for_short_leases(alias: str, lease: float, *args: Any) -> int:
        if lease == 20:
            raise RuntimeError("cannot renew")
        return real(alias, lease, *args)

    monkeypatch.setattr(heartbeat_module, "_renew", broken_for_short_leases)
    before = lease_of("short")

    assert beat.renew_once() == 1

    assert lease_of("short") == before
    assert lease_of("long") > timezone.now() + timedelta(seconds=25)  # type: ignore[operator]
    assert "cannot renew" in caplog.text


def test_a_failed_statement_for_several_claims_renews_them_one_by_one(
    beat: Heartbeat, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A statement that fails for a group is retried claim by claim: only the claim that
    still fails is left for the next beat."""
    bad, good = claim("bad"), claim("good")
    beat.register(bad, lease=30, max_run=60)
    beat.register(good, lease=30, max_run=60)
    real = heartbeat_module._renew

    def fails_with_bad(alias: str, lease: float, claims: list[claims.Claim], *a: Any) -> int:
        if bad in claims:
            raise RuntimeError("a row that cannot be renewed")
        return real(alias, lease, claims, *a)

    monkeypatch.setattr(heartbeat_module, "_renew", fails_with_bad)
    before = lease_of("bad")

    with caplog.at_level(logging.WARNING, logger="idempotency_django"):
        assert beat.renew_once() == 1

    assert lease_of("bad") == before
    assert lease_of("good") > timezone.now() + timedelta(seconds=25)  # type: ignore[operator]
    failed = [r for r in caplog.records if "could not renew a lease" in r.getMessage()]
    assert [r.idempotency_key for r in failed] == ["bad"]  # type: ignore[attr-defined]


def broken_check() -> bool:
    raise ConnectionResetError("the check itself failed")


@pytest.mark.parametrize("is_usable", [lambda: False, broken_check], ids=["no", "raises"])
@pytest.mark.database_store("a lost Django database connection")
def test_a_lost_connection_is_not_retried_claim_by_claim(
    beat: Heartbeat, monkeypatch: pytest.MonkeyPatch, is_usable: Callable[[], bool]
) -> None:
    from django.db import OperationalError

    beat.register(claim("a"), lease=30, max_run=60)
    beat.register(claim("b"), lease=30, max_run=60)
    calls: list[int] = []

    def lost(alias: str, lease: float, claims: list[claims.Claim], *a: Any) -> int:
        calls.append(len(claims))
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(heartbeat_module, "_renew", lost)
    monkeypatch.setattr(connections["default"], "is_usable", is_usable)

    assert beat.renew_once() == 0
    assert calls == [2]


def test_a_forked_child_starts_empty(beat: Heartbeat) -> None:
    """A real fork, with the parent's lock held and its thread running: the child has no
    claims, no thread, and a lock it can take; registering there starts its own thread."""
    beat.register(claim("parents"), lease=30, max_run=60)
    assert beat._thread is not None
    read_end, write_end = os.pipe()
    lock = beat._lock
    lock.acquire()  # as if another thread of the parent were registering at the fork
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns about fork() in a process with threads: the point here.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    finally:
        if pid:
            lock.release()
    if pid == 0:  # the child: report, and leave without running anything of pytest's
        try:
            took_lock = beat._lock.acquire(timeout=2)
            state = [took_lock, len(beat._entries), beat._thread is None]
            if took_lock:
                beat._lock.release()
                beat.register(claims.Claim(claims.Scope("1", "POST /x/", "c"), "t", "x"), 30, 60)
                state.append(beat._thread is not None and beat._thread.is_alive())
            os.write(write_end, repr(state).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as child:
        reported = child.read()
    os.waitpid(pid, 0)

    assert reported == repr([True, 0, True, True])
    assert list(beat._entries) != []  # the parent keeps its claims
    assert beat._thread is not None
    assert beat._thread.is_alive()


def test_the_fork_reset_forgets_everything(beat: Heartbeat) -> None:
    """What the child runs after a fork, run here: no claims, no thread, a free lock."""
    beat.register(claim("a"), lease=30, max_run=60)
    parents_worker, parents_lock = beat._worker, beat._lock
    parents_lock.acquire()  # held by a thread that, in a child, would not exist

    beat._after_fork_in_child()  # not _reset_after_fork(): that resets every heartbeat

    assert beat._entries == {}
    assert beat._thread is None
    assert beat._lock is not parents_lock
    assert beat._lock.acquire(blocking=False)
    beat._lock.release()
    # Here the "parent's" thread does exist: end it, as the parent's stop() would.
    parents_lock.release()
    assert parents_worker is not None
    parents_worker.stop.set()
    parents_worker.wake.set()
    parents_worker.thread.join(10)
    assert not parents_worker.thread.is_alive()


def test_overdue_claims_are_logged_through_log_fields(
    beat: Heartbeat, caplog: pytest.LogCaptureFixture, settings: Any
) -> None:
    settings.IDEMPOTENCY = {"LOG_KEYS": "hash"}
    beat.register(claim("order-4711"), lease=30, max_run=0)

    with caplog.at_level(logging.DEBUG, logger="idempotency_django"):
        beat.renew_once()

    (record,) = [r for r in caplog.records if "MAX_RUN_SECONDS" in r.getMessage()]
    assert record.idempotency_key == signals.log_key("order-4711")  # type: ignore[attr-defined]
    assert record.idempotency_account == "1"  # type: ignore[attr-defined]
    assert not [text for text in everything_logged(caplog.records) if "order-4711" in text]


@pytest.mark.concurrency
@pytest.mark.database_store("a row lock (SELECT FOR UPDATE)")
def test_a_renewal_blocked_by_a_row_lock_returns_within_its_timeout(beat: Heartbeat) -> None:
    """Another connection holds one claim's row: the beat gives up on that row after its
    statement timeout (a third of the lease) and still renews the other claim."""
    locked, free = claim("locked"), claim("free")
    for each in (locked, free):  # registered without a thread: only this test's beat runs
        beat._entries[each.token] = heartbeat_module._Entry(
            each, 0.9, time.monotonic() + 60, each.since
        )
    records.update(lease_expires_at=timezone.now())
    before = {key: lease_of(key) for key in ("locked", "free")}
    holding, let_go = threading.Event(), threading.Event()

    def hold_the_row() -> None:
        try:
            with transaction.atomic():
                IdempotencyRecord.objects.select_for_update().get(key="locked")
                holding.set()
                let_go.wait(30)  # bounded, so that a hanging renewal still ends the test
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold_the_row)
    holder.start()
    try:
        assert holding.wait(10)
        started = time.monotonic()
        renewed = beat.renew_once()
        elapsed = time.monotonic() - started
    finally:
        let_go.set()
        holder.join(30)

    assert renewed == 1
    assert elapsed < 5  # two statement timeouts of 0.3 s, and some slack
    assert lease_of("free") > before["free"]  # type: ignore[operator]
    assert lease_of("locked") == before["locked"]
    assert beat._thread is None


def test_a_claim_with_a_shorter_lease_wakes_the_sleeping_heartbeat(
    beat: Heartbeat, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread sleeps a third of the shortest lease it knows: 100 s for a 300 s lease. A
    claim with a 0.3 s lease registered meanwhile must be renewed within its own beat, not
    after the long one's: the thread is woken and sleeps on the shorter interval."""
    next_renewal = beats(beat, monkeypatch)
    long_lease, short_lease = claim("long"), claim("short")
    beat.register(long_lease, lease=300, max_run=600)
    assert wait_until(lambda: beat._sleeping == 100)
    records.update({"key": "short"}, lease_expires_at=timezone.now())
    before = lease_of("short")

    beat.register(short_lease, lease=0.3, max_run=60)

    assert next_renewal() >= 1  # within the helper's 10 s, far less than 100
    assert lease_of("short") > before  # type: ignore[operator]
    assert beat._sleeping == pytest.approx(0.1)


@pytest.mark.concurrency
@pytest.mark.database_store("a row lock (SELECT FOR UPDATE)")
def test_a_renewal_waits_out_a_row_lock_shorter_than_its_timeout(beat: Heartbeat) -> None:
    """The renewal's bound is a third of the lease: 10 s for a 30 s lease. A row held for
    less than that (until the renewal is seen waiting for it) delays the renewal and does
    not fail it. Sent to PostgreSQL in seconds where it takes milliseconds, the bound
    would be 10 ms, and every lock a moment long would cost the claim its renewal."""
    held = claim("held")
    beat._entries[held.token] = heartbeat_module._Entry(
        held, 30, time.monotonic() + 60, time.monotonic()
    )
    records.update(lease_expires_at=timezone.now())
    before = lease_of("held")
    holding, let_go = threading.Event(), threading.Event()
    renewed: list[int] = []

    def hold_the_row() -> None:
        try:
            with transaction.atomic():
                IdempotencyRecord.objects.select_for_update().get(key="held")
                holding.set()
                let_go.wait(30)
        finally:
            connections.close_all()

    def renew() -> None:
        try:
            renewed.append(beat.renew_once())
        finally:
            connections.close_all()

    holder, renewal = threading.Thread(target=hold_the_row), threading.Thread(target=renew)
    holder.start()
    try:
        assert holding.wait(10)
        renewal.start()
        waited = wait_until(another_waits_for_a_row_lock, timeout=8)
    finally:
        let_go.set()
        holder.join(30)
        if renewal.ident is not None:
            renewal.join(30)

    assert waited, "the renewal never waited for the row: it gave up at once"
    assert renewed == [1]
    assert lease_of("held") > before  # type: ignore[operator]
