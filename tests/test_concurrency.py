"""Single flight under real concurrency: threads with their own database connections,
released together by a barrier, against PostgreSQL and MariaDB."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection, connections

from idempotency_django import signals
from idempotency_django.models import IdempotencyRecord
from tests import records
from tests.conftest import effects, post_from_thread, wait_until
from tests.project.views import gate
from tools.threads import start_together

pytestmark = [pytest.mark.concurrency, pytest.mark.django_db(transaction=True)]

THREADS = 8


def send(path: str, body: dict[str, Any], key: str = "k1") -> Any:
    return post_from_thread(path, body, {"Idempotency-Key": key, "X-User": "alice"})


def run_together(
    path: str, body: dict[str, Any], count: int = THREADS
) -> tuple[queue.Queue[Any], list[threading.Thread]]:
    return start_together(count, lambda: send(path, body))


def collect(results: queue.Queue[Any], count: int, timeout: float = 20) -> list[Any]:
    deadline = time.monotonic() + timeout
    collected = []
    while len(collected) < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            collected.append(results.get(timeout=remaining))
        except queue.Empty:
            break
    return collected


def finish(threads: list[threading.Thread]) -> None:
    gate.release.set()
    for thread in threads:
        thread.join(timeout=30)


@pytest.fixture
def in_flight_reports() -> Iterator[Callable[[int], bool]]:
    """Wait until the engine has reported ``n`` duplicates in flight (or time runs out)."""
    seen = threading.Semaphore(0)

    def receiver(**kwargs: Any) -> None:
        seen.release()

    signals.in_flight.connect(receiver)

    def wait_for(count: int) -> bool:
        return all(seen.acquire(timeout=20) for _ in range(count))

    yield wait_for
    signals.in_flight.disconnect(receiver)


def test_conflict_policy_one_execution_and_409s(alice: User) -> None:
    results, threads = run_together("/effect/", {"gate": True})
    losers = collect(results, THREADS - 1)
    finish(threads)
    responses = losers + collect(results, THREADS - len(losers))

    assert effects() == 1
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [201] + [409] * (THREADS - 1)
    for response in responses:
        if response.status_code == 409:
            assert response["Retry-After"] == "1"
            assert response["Content-Type"] == "application/problem+json"
    assert send("/effect/", {"gate": True})["Idempotent-Replayed"] == "true"


def test_wait_policy_duplicates_wait_and_get_the_replay(
    alice: User, in_flight_reports: Callable[[int], bool]
) -> None:
    results, threads = run_together("/waiting/", {"gate": True})
    assert gate.entered.wait(20)
    assert in_flight_reports(THREADS - 1)
    finish(threads)
    responses = collect(results, THREADS)

    assert effects() == 1
    assert [r.status_code for r in responses] == [201] * THREADS
    assert len({r.content for r in responses}) == 1
    assert sum(r.get("Idempotent-Replayed") == "true" for r in responses) == THREADS - 1


def test_wait_policy_gives_409_when_the_bound_passes(alice: User) -> None:
    results, threads = run_together("/short-wait/", {"gate": True})
    losers = collect(results, THREADS - 1)
    finish(threads)

    assert effects() == 1
    assert [r.status_code for r in losers] == [409] * (THREADS - 1)


def lock_waiters() -> int:
    """How many transactions wait on a row lock right now, as the database reports it."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()"
            )
        else:
            # innodb_trx lags behind here; the process list shows each waiting statement
            # (a claim in a transaction with its lock wait bound in front).
            cursor.execute(
                "SELECT count(*) FROM information_schema.processlist "
                "WHERE info LIKE 'INSERT INTO `idempotency_django_idempotencyrecord`%' "
                "OR info LIKE 'SET STATEMENT innodb_lock_wait_timeout=% FOR INSERT INTO "
                "`idempotency_django_idempotencyrecord`%'"
            )
        return int(cursor.fetchone()[0])


@pytest.mark.database_store("atomic mode: the claim in the work's transaction")
def test_atomic_mode_duplicates_block_on_the_unique_index_then_replay(alice: User) -> None:
    """Under "wait", up to WAIT_SECONDS (under "conflict" they are answered 409: see
    test_lifecycle's lock-wait tests)."""
    results, threads = run_together("/atomic-waiting/", {"gate": True})
    assert gate.entered.wait(20)
    assert wait_until(lambda: lock_waiters() >= THREADS - 1)
    finish(threads)
    responses = collect(results, THREADS)

    assert effects() == 1
    assert [r.status_code for r in responses] == [201] * THREADS
    assert len({r.content for r in responses}) == 1


@pytest.mark.database_store("atomic mode: the claim in the work's transaction")
def test_atomic_mode_rollback_lets_a_waiting_duplicate_run(alice: User) -> None:
    """The first attempt fails after its side effect: both roll back, and a waiter runs."""
    first: queue.Queue[Any] = queue.Queue()
    thread = threading.Thread(
        target=lambda: first.put(send("/atomic-waiting/", {"gate": True, "status": 503}))
    )
    thread.start()
    assert gate.entered.wait(20)
    second: queue.Queue[Any] = queue.Queue()
    waiter = threading.Thread(
        target=lambda: second.put(send("/atomic-waiting/", {"gate": True, "status": 503}))
    )
    waiter.start()
    assert wait_until(lambda: lock_waiters() >= 1)
    finish([thread, waiter])

    assert first.get(timeout=5).status_code == 503
    assert second.get(timeout=5).status_code == 503
    assert effects() == 0
    assert not records.exists()


def test_atomic_requests_keeps_claim_commit_work(
    alice: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ATOMIC_REQUESTS the claim still commits first: a duplicate sees it at once."""
    monkeypatch.setitem(connections["default"].settings_dict, "ATOMIC_REQUESTS", True)
    first: queue.Queue[Any] = queue.Queue()
    thread = threading.Thread(target=lambda: first.put(send("/effect/", {"gate": True})))
    thread.start()
    assert gate.entered.wait(20)

    duplicate = send("/effect/", {"gate": True})
    finish([thread])

    assert duplicate.status_code == 409
    assert first.get(timeout=5).status_code == 201
    assert effects() == 1


def test_heartbeat_keeps_a_view_longer_than_its_lease(alice: User, settings: Any) -> None:
    settings.IDEMPOTENCY = {"LEASE_SECONDS": 1}
    first: queue.Queue[Any] = queue.Queue()
    thread = threading.Thread(target=lambda: first.put(send("/effect/", {"gate": True})))
    thread.start()
    assert gate.entered.wait(20)

    statuses = []
    end = time.monotonic() + 3  # three leases
    while time.monotonic() < end:
        statuses.append(send("/effect/", {"gate": True}).status_code)
        time.sleep(0.25)
    finish([thread])

    assert set(statuses) == {409}
    assert first.get(timeout=5).status_code == 201
    assert effects() == 1


@pytest.mark.database_store("atomic mode: the claim in the work's transaction")
def test_atomic_requests_view_that_lost_its_claim_rolls_back(
    alice: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A view whose lease lapsed and was taken over must not commit its work (409 instead)."""
    from datetime import timedelta

    from django.utils import timezone

    from idempotency_django.core import claims, shell

    monkeypatch.setitem(connections["default"].settings_dict, "ATOMIC_REQUESTS", True)
    first: queue.Queue[Any] = queue.Queue()
    thread = threading.Thread(target=lambda: first.put(send("/effect/", {"gate": True})))
    thread.start()
    assert gate.entered.wait(20)
    record = records.get()
    records.update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    options = claims.ClaimPolicy(
        "default", lease=30, ttl=60, in_flight="conflict", wait_seconds=0, retry_after=1
    )
    scope = claims.Scope(record.account, record.endpoint, record.key)
    assert isinstance(shell.claim_or_replay(scope, record.fingerprint, options), claims.Claim)
    finish([thread])

    response = first.get(timeout=5)
    assert response.status_code == 409
    assert effects() == 0
    assert records.get().state == IdempotencyRecord.State.IN_PROGRESS
