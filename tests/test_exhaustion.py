"""Exhaustion: what one slow request, its duplicates, or one account can hold of a server.

Duplicates of a held request are real requests in threads against PostgreSQL and MariaDB
(an atomic-mode claim waits on a real row lock); what a client sees is asserted: the status,
when it came, and how many times the work ran.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.utils import timezone

from idempotency_django import checks, signals
from idempotency_django.conf import MAX_WAIT_SECONDS, conf
from idempotency_django.core import claims, shell
from idempotency_django.decorators import idempotent
from idempotency_django.exceptions import InFlight
from idempotency_django.models import IdempotencyRecord
from idempotency_django.store import database
from idempotency_django.store.base import get_store
from idempotency_django.tasks import idempotent_task
from tests.conftest import Post, effects, post_from_thread, wait_until
from tests.project.views import gate

State = IdempotencyRecord.State
SCOPE = claims.Scope(account="acct", endpoint="POST /exhaustion/", key="k1")
FINGERPRINT = "1:" + "0" * 64


def problem(response: Any) -> dict[str, Any]:
    assert response["Content-Type"] == "application/problem+json"
    return json.loads(response.content)  # type: ignore[no-any-return]


def send(path: str, body: dict[str, Any], user: str = "alice", key: str = "k1") -> Any:
    return post_from_thread(path, body, {"Idempotency-Key": key, "X-User": user})


def held(path: str) -> tuple[queue.Queue[Any], threading.Thread]:
    """A request to ``path`` held inside its view (its claim made), answered once let go."""
    answers: queue.Queue[Any] = queue.Queue()
    thread = threading.Thread(target=lambda: answers.put(send(path, {"gate": True})))
    thread.start()
    assert gate.entered.wait(20)
    return answers, thread


def timed(path: str) -> tuple[queue.Queue[tuple[Any, float]], threading.Thread]:
    """A duplicate of the held request, sent from a thread: its answer and how long it took
    (a thread, so that a duplicate that waits for the held one cannot hang the test)."""
    answers: queue.Queue[tuple[Any, float]] = queue.Queue()

    def run() -> None:
        started = time.monotonic()
        response = send(path, {"gate": True})
        answers.put((response, time.monotonic() - started))

    thread = threading.Thread(target=run)
    thread.start()
    return answers, thread


def let_go(*threads: threading.Thread) -> None:
    gate.release.set()
    for thread in threads:
        thread.join(30)


# --- atomic mode: a duplicate's claim waits on a row lock, bounded by the policy ------------

# MariaDB/MySQL count lock waits in whole seconds (the conflict bound is 1 s there).
SLACK = 4.0


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@pytest.mark.database_store("atomic mode: the claim waits on a row lock")
def test_atomic_mode_conflict_answers_a_duplicate_409_without_waiting_for_the_first(
    alice: User,
) -> None:
    first, holder = held("/atomic/")
    duplicate, sender = timed("/atomic/")
    try:
        response, took = duplicate.get(timeout=SLACK)
    except queue.Empty:
        response, took = None, SLACK
    let_go(holder, sender)

    assert response is not None, "the duplicate waited for the first request's transaction"
    assert response.status_code == 409
    assert response["Retry-After"] == "1"
    assert problem(response)["type"].endswith(":in-flight")
    assert took < SLACK
    assert first.get(timeout=5).status_code == 201
    assert effects("atomic") == 1


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@pytest.mark.database_store("atomic mode: the claim waits on a row lock")
def test_atomic_mode_wait_bounds_a_duplicates_wait_by_wait_seconds(alice: User) -> None:
    """``/atomic-short-wait/`` waits 1 s: the duplicate is told 409 after about that long,
    while the first request is still held, and never runs the view."""
    first, holder = held("/atomic-short-wait/")
    duplicate, sender = timed("/atomic-short-wait/")
    try:
        response, took = duplicate.get(timeout=1 + SLACK)
    except queue.Empty:
        response, took = None, 1 + SLACK
    let_go(holder, sender)

    assert response is not None, "the duplicate waited past WAIT_SECONDS"
    assert response.status_code == 409
    assert problem(response)["type"].endswith(":in-flight")
    assert 0.9 <= took < 1 + SLACK
    assert first.get(timeout=5).status_code == 201
    assert effects("atomic") == 1


def lock_timeout_setting() -> str:
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SHOW lock_timeout")
        else:
            cursor.execute("SELECT @@SESSION.innodb_lock_wait_timeout")
        return str(cursor.fetchone()[0])


@pytest.mark.django_db(transaction=True)
@pytest.mark.database_store("the database store's lock-wait bound")
@pytest.mark.parametrize("flavour", ["own", "session"])
def test_the_claims_lock_wait_bound_is_given_back_to_the_view(
    flavour: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bound is the claim's alone: the view's own statements after it wait for locks
    as the connection always did. ``session``: the MySQL way (the session's variable, put
    back after), run on MariaDB."""
    if connection.vendor not in ("postgresql", "mysql"):
        pytest.skip("SQLite has no row locks to bound")
    if flavour == "session":
        if connection.vendor != "mysql":
            pytest.skip("MySQL's way, tried on MariaDB")
        monkeypatch.setattr(database, "_set_statement", lambda connection: False)
    store = get_store()
    with transaction.atomic():
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute("SET LOCAL lock_timeout = '7s'")
            else:
                cursor.execute("SET SESSION innodb_lock_wait_timeout = 7")
        with database._lock_timeout("default", 0.1):
            inside = lock_timeout_setting()
        after = lock_timeout_setting()
    if connection.vendor == "mysql":
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION innodb_lock_wait_timeout = DEFAULT")

    assert store is not None
    if connection.vendor == "postgresql":
        assert inside == "100ms"
    elif flavour == "session":
        assert inside == "1"  # whole seconds, rounded up
    else:
        assert inside == "7"  # SET STATEMENT bounds the claim's INSERT alone
    assert after == ("7s" if connection.vendor == "postgresql" else "7")


# --- the "wait" policy: a bound per wait, and per process --------------------------------------


def options(**overrides: Any) -> claims.ClaimPolicy:
    values: dict[str, Any] = {
        "alias": "default",
        "lease": 10,
        "ttl": 60,
        "in_flight": "wait",
        "wait_seconds": 30,
        "retry_after": 1,
    }
    return claims.ClaimPolicy(**{**values, **overrides})


@pytest.mark.django_db(transaction=True)
def test_with_every_waiter_place_taken_a_duplicate_is_told_409_at_once(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.IDEMPOTENCY = {**getattr(settings, "IDEMPOTENCY", {}), "MAX_WAITERS": 3}
    first = shell.claim_or_replay(SCOPE, FINGERPRINT, options())
    assert isinstance(first, claims.Claim)
    monkeypatch.setattr(shell.waiters, "count", 3)  # three requests wait already

    started = time.monotonic()
    with pytest.raises(InFlight):
        shell.claim_or_replay(SCOPE, FINGERPRINT, options())

    assert time.monotonic() - started < 5  # not the 30 s the policy would wait
    assert shell.waiters.count == 3  # nothing taken, nothing given back


@pytest.mark.django_db(transaction=True)
def test_a_waiter_gives_its_place_back(settings: Any) -> None:
    settings.IDEMPOTENCY = {**getattr(settings, "IDEMPOTENCY", {}), "MAX_WAITERS": 1}
    first = shell.claim_or_replay(SCOPE, FINGERPRINT, options())
    assert isinstance(first, claims.Claim)

    for _ in range(2):  # the second could not wait if the first kept its place
        started = time.monotonic()
        with pytest.raises(InFlight):
            shell.claim_or_replay(SCOPE, FINGERPRINT, options(wait_seconds=0.3))
        assert time.monotonic() - started >= 0.3

    assert shell.waiters.count == 0


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_duplicates_past_max_waiters_are_told_409_while_the_waiting_one_replays(
    alice: User, settings: Any
) -> None:
    settings.IDEMPOTENCY = {**getattr(settings, "IDEMPOTENCY", {}), "MAX_WAITERS": 1}
    first, holder = held("/waiting/")  # waits up to 20 s for a duplicate
    waiting, waiter = timed("/waiting/")
    assert wait_until(lambda: shell.waiters.count == 1)

    started = time.monotonic()
    turned_away = send("/waiting/", {"gate": True})
    took = time.monotonic() - started
    let_go(holder, waiter)

    assert turned_away.status_code == 409
    assert problem(turned_away)["type"].endswith(":in-flight")
    assert took < 5
    assert first.get(timeout=5).status_code == 201
    replay, _ = waiting.get(timeout=5)
    assert replay.status_code == 201
    assert replay["Idempotent-Replayed"] == "true"
    assert effects("waiting") == 1
    assert shell.waiters.count == 0


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@pytest.mark.database_store("atomic mode: the claim waits on a row lock")
def test_in_atomic_mode_a_duplicate_past_max_waiters_waits_no_longer_than_conflict(
    alice: User, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.IDEMPOTENCY = {**getattr(settings, "IDEMPOTENCY", {}), "MAX_WAITERS": 2}
    monkeypatch.setattr(shell.waiters, "count", 2)
    first, holder = held("/atomic-waiting/")  # would wait 20 s
    duplicate, sender = timed("/atomic-waiting/")
    try:
        response, took = duplicate.get(timeout=SLACK)
    except queue.Empty:
        response, took = None, SLACK
    let_go(holder, sender)

    assert response is not None
    assert response.status_code == 409
    assert took < SLACK
    assert first.get(timeout=5).status_code == 201
    assert effects("atomic") == 1


def test_wait_seconds_has_a_maximum(settings: Any) -> None:
    settings.IDEMPOTENCY = {"WAIT_SECONDS": MAX_WAIT_SECONDS + 1}

    assert [e.id for e in checks.check_settings()] == ["idempotency_django.E040"]
    with pytest.raises(ImproperlyConfigured, match="at most 60"):
        idempotent(in_flight="wait", wait_seconds=MAX_WAIT_SECONDS + 1)(lambda request: None)
    with pytest.raises(ImproperlyConfigured, match="WAIT_SECONDS"):
        conf.checked("WAIT_SECONDS")

    settings.IDEMPOTENCY = {"WAIT_SECONDS": MAX_WAIT_SECONDS}
    assert checks.check_settings() == []


def test_max_waiters_is_a_number(settings: Any) -> None:
    settings.IDEMPOTENCY = {"MAX_WAITERS": "many"}

    assert [e.id for e in checks.check_settings()] == ["idempotency_django.E003"]
    with pytest.raises(ImproperlyConfigured, match="MAX_WAITERS"):
        shell.waiters.enter()


# --- a quota of requests in progress per account ---------------------------------------------


def in_progress(account: str, key: str, *, lease: timedelta = timedelta(seconds=30)) -> None:
    now = timezone.now()
    IdempotencyRecord.objects.create(
        account=account,
        endpoint="POST /elsewhere/",
        key=key,
        fingerprint=FINGERPRINT,
        state=State.IN_PROGRESS,
        token=key.ljust(32, "0")[:32],
        lease_expires_at=now + lease,
        created_at=now,
        expires_at=now + timedelta(days=1),
    )


@pytest.fixture
def quota(settings: Any) -> Callable[[int], None]:
    def set_quota(limit: int) -> None:
        settings.IDEMPOTENCY = {**getattr(settings, "IDEMPOTENCY", {})}
        settings.IDEMPOTENCY["MAX_IN_FLIGHT_PER_ACCOUNT"] = limit

    return set_quota


@pytest.mark.django_db
@pytest.mark.database_store("the quota counts through the database store")
def test_an_account_at_its_quota_is_told_429_before_any_claim(
    alice: User, bob: User, post: Post, quota: Callable[[int], None]
) -> None:
    quota(2)
    in_progress(str(alice.pk), "running-1")
    in_progress(str(alice.pk), "running-2")
    refused: list[dict[str, Any]] = []

    def receiver(signal: Any, sender: Any, **kwargs: Any) -> None:
        refused.append(kwargs)

    signals.quota_exceeded.connect(receiver)
    try:
        response = post("/effect/", {"amount": 1})
    finally:
        signals.quota_exceeded.disconnect(receiver)

    assert response.status_code == 429
    assert response["Retry-After"] == "1"
    body = problem(response)
    assert body["type"] == "urn:idempotency-django:problem:quota-exceeded"
    assert body["status"] == 429
    assert effects() == 0
    assert not IdempotencyRecord.objects.filter(key="k1").exists()
    assert [r["account"] for r in refused] == [str(alice.pk)]

    other = post("/effect/", {"amount": 1}, user="bob")  # another account has room
    assert other.status_code == 201
    assert effects() == 1


@pytest.mark.django_db
@pytest.mark.database_store("the quota counts through the database store")
def test_completed_and_lapsed_records_do_not_count_toward_the_quota(
    alice: User, post: Post, quota: Callable[[int], None]
) -> None:
    quota(1)
    in_progress(str(alice.pk), "dead-worker", lease=timedelta(seconds=-1))
    first = post("/effect/", {"amount": 1}, key="done")  # completed: not in progress

    second = post("/effect/", {"amount": 1}, key="next")

    assert first.status_code == 201
    assert second.status_code == 201
    assert effects() == 2


@pytest.mark.django_db(transaction=True)
@pytest.mark.database_store("the quota counts through the database store")
def test_tasks_are_not_held_to_the_account_quota(alice: User, quota: Callable[[int], None]) -> None:
    quota(1)
    in_progress("tenant-1", "running")
    ran: list[int] = []

    @idempotent_task(scope="tenant-1", key="message_id")
    def charge(amount: int, message_id: str) -> int:
        ran.append(amount)
        return amount

    assert charge(5, message_id="job-1") == 5
    assert ran == [5]


@pytest.mark.django_db
@pytest.mark.database_store("the quota counts through the database store")
def test_the_quota_is_refused_when_it_is_not_a_whole_number(
    settings: Any, quota: Callable[[int], None]
) -> None:
    for wrong in (0, 2.5, "20", True):
        settings.IDEMPOTENCY = {"MAX_IN_FLIGHT_PER_ACCOUNT": wrong}
        assert "idempotency_django.E041" in [e.id for e in checks.check_settings()], wrong

    settings.IDEMPOTENCY = {"MAX_IN_FLIGHT_PER_ACCOUNT": None}
    assert checks.check_settings() == []
    quota(20)
    assert checks.check_settings() == []


def test_the_quota_needs_a_store_that_can_count(settings: Any) -> None:
    pytest.importorskip("redis")
    settings.IDEMPOTENCY = {
        "STORE": "idempotency_django.store.redis.RedisStore",
        "MAX_IN_FLIGHT_PER_ACCOUNT": 5,
    }

    assert "idempotency_django.E042" in [e.id for e in checks.check_settings()]


def test_the_published_contract_names_429_while_a_quota_is_set(settings: Any) -> None:
    from idempotency_django.core import contract

    settings.IDEMPOTENCY = {"MAX_IN_FLIGHT_PER_ACCOUNT": 5}
    limited = contract.document({}, required=True, ttl=60, stored=lambda status: False)
    settings.IDEMPOTENCY = {}
    unlimited = contract.document({}, required=True, ttl=60, stored=lambda status: False)

    assert "Retry-After" in limited["responses"]["429"]["headers"]
    assert "quota-exceeded" in limited["responses"]["429"]["description"]
    assert "429" not in unlimited["responses"]


@pytest.mark.django_db
@pytest.mark.database_store("the PostgreSQL plan of the quota's count")
def test_the_quota_is_counted_through_the_partial_index_on_postgresql(alice: User) -> None:
    """The store's own statement, explained: it reads the partial index of in-progress
    records, whose condition it must spell out for the planner to use it."""
    if connection.vendor != "postgresql":
        pytest.skip("a partial index: PostgreSQL (and SQLite, which plans without statistics)")
    for number in range(50):
        in_progress(f"account-{number}", "k")
    sent: list[tuple[str, Any]] = []

    def keep(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
        sent.append((sql, params))
        return execute(sql, params, many, context)

    store: Any = get_store()
    with connection.execute_wrapper(keep):
        assert store.count_in_use("account-7", timezone.now(), 5) == 1
    ((sql, params),) = sent
    with connection.cursor() as cursor:
        cursor.execute("SET enable_seqscan = off")  # a small table: as it would plan a large one
        cursor.execute(f"EXPLAIN {sql}", params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute("RESET enable_seqscan")

    assert "idempotency_record_in_use" in plan
