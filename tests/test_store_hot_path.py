"""The store's hot path in raw SQL (``store.DatabaseStore``): the same answers as the ORM
on every backend, the same definitions of in use / expired / lapsed as the purge, and the
claim-or-read statement's one hard case (a row committed after its snapshot)."""

from __future__ import annotations

import queue
import threading
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from idempotency_django.core import decisions
from idempotency_django.core.decisions import is_expired, is_in_use, is_lapsed
from idempotency_django.models import IdempotencyRecord
from idempotency_django.store import (
    CLAIMED,
    DatabaseStore,
    expired_q,
    in_use_q,
    lapsed_q,
    store,
)
from idempotency_django.store.base import Scope, Write
from tests import writes
from tests.conftest import Post, effects, wait_until
from tests.project.views import gate
from tests.test_concurrency import finish, lock_waiters, send

State = IdempotencyRecord.State

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.database_store("the database store's SQL (the Redis store's: test_redis_store)"),
]


def _record(**fields: Any) -> IdempotencyRecord:
    now = timezone.now()
    values: dict[str, Any] = {
        "account": "7",
        "endpoint": "POST /x/",
        "key": "k",
        "fingerprint": "2:" + "a" * 64,
        "token": "t" * 32,
        "state": State.COMPLETED,
        "response_status": 201,
        "response_headers": [["Location", "/x/1"]],
        "response_body": b'{"id": 1}',
        "created_at": now - timedelta(seconds=5),
        "completed_at": now - timedelta(seconds=1),
        "lease_expires_at": None,
        "expires_at": now + timedelta(days=1),
    }
    values.update(fields)
    return IdempotencyRecord.objects.create(**values)


LOOKUP = Scope("7", "POST /x/", "k")


def _write(token: str, now: datetime) -> Write:
    return writes.write(
        token, account="7", endpoint="POST /x/", key="k", lease=10, ttl=86400, now=now
    )


@pytest.mark.parametrize("use_tz", [True, False])
def test_the_raw_read_returns_what_the_orm_returns(settings: Any, use_tz: bool) -> None:
    """Datetimes (aware or naive, MariaDB's naive columns, SQLite's text), the JSON headers
    (text on MariaDB) and the body bytes come back as the ORM gives them."""
    settings.USE_TZ = use_tz
    now = timezone.now()
    _record(
        state=State.IN_PROGRESS,
        lease_expires_at=now + timedelta(seconds=30),
        expires_at=now + timedelta(hours=1),
    )
    orm = IdempotencyRecord.objects.get()
    read = store.read(LOOKUP, orm.fingerprint)

    assert read is not None
    assert (read.pk, read.state, read.token, read.fingerprint) == (
        orm.pk,
        orm.state,
        orm.token,
        orm.fingerprint,
    )
    # Moved onto this process's clock by what separates it from the database's, read in
    # the same statement: both times by as much, a few milliseconds on one machine.
    assert read.lease_expires_at is not None
    shift = read.lease_expires_at - orm.lease_expires_at
    assert read.expires_at - orm.expires_at == shift
    assert abs(shift) < timedelta(seconds=1)
    assert (read.expires_at.tzinfo is not None) is use_tz
    assert read.stored is None  # in progress: nothing to replay, no body loaded


@pytest.mark.parametrize("use_tz", [True, False])
@pytest.mark.parametrize("zone", ["UTC", "America/New_York", "Asia/Kolkata"])
def test_the_databases_clock_writes_times_in_the_zone_django_keeps_them_in(
    settings: Any, use_tz: bool, zone: str
) -> None:
    """Without USE_TZ, MariaDB and SQLite hold naive local times of TIME_ZONE (PostgreSQL
    converts them); with it, UTC. The times a claim and its completion write from the
    database's clock read back as this process's now there, the lease and the TTL to the
    microsecond."""
    settings.USE_TZ = use_tz
    settings.TIME_ZONE = zone
    now = timezone.now()

    assert store.claim_or_read(_write("a" * 32, now)) == CLAIMED

    claimed = IdempotencyRecord.objects.get()
    assert abs(claimed.created_at - timezone.now()) < timedelta(seconds=5)
    assert claimed.lease_expires_at == claimed.created_at + timedelta(seconds=10)
    assert claimed.expires_at == claimed.created_at + timedelta(days=1)
    completion = writes.completion(201, b"{}", headers=(), ttl=3600)
    assert store.complete(LOOKUP, "a" * 32, completion)
    completed = IdempotencyRecord.objects.get()
    assert completed.completed_at is not None
    assert abs(completed.completed_at - timezone.now()) < timedelta(seconds=5)
    assert completed.expires_at == completed.completed_at + timedelta(hours=1)


def test_a_completed_record_is_read_with_its_response_only_for_the_same_fingerprint() -> None:
    _record()

    same = store.read(LOOKUP, "2:" + "a" * 64)
    other = store.read(LOOKUP, "2:" + "b" * 64)

    assert same is not None
    assert same.stored is not None
    assert same.stored.body == b'{"id": 1}'
    assert same.stored.headers == [("Location", "/x/1")]
    assert other is not None
    assert other.stored is None  # a 422 never loads the body
    assert other.response_status == 201


def test_claim_or_read_claims_once_then_reads_the_record() -> None:
    now = timezone.now()

    first = store.claim_or_read(_write("a" * 32, now))
    second = store.claim_or_read(_write("b" * 32, now))

    assert first == CLAIMED
    assert second != CLAIMED
    assert second is not None
    assert second.token == "a" * 32
    assert second.state == State.IN_PROGRESS
    assert IdempotencyRecord.objects.get().token == "a" * 32


def test_completion_and_release_are_fenced_by_the_token() -> None:
    _record(state=State.IN_PROGRESS, lease_expires_at=timezone.now() + timedelta(seconds=10))
    values = writes.completion(200, b"x", headers=(), ttl=86400)

    assert not store.complete(LOOKUP, "x" * 32, values)
    assert store.release(LOOKUP, "x" * 32) == 0
    assert IdempotencyRecord.objects.get().state == State.IN_PROGRESS
    assert store.complete(LOOKUP, "t" * 32, values)
    record = IdempotencyRecord.objects.get()
    assert (record.state, record.response_status, bytes(record.response_body)) == (
        State.COMPLETED,
        200,
        b"x",
    )
    assert record.lease_expires_at is None
    assert not store.complete(LOOKUP, "t" * 32, values)  # only once
    # Fenced by the state too: a late release (its first reply lost) keeps the outcome.
    assert store.release(LOOKUP, "t" * 32) == 0
    assert IdempotencyRecord.objects.get().state == State.COMPLETED


# -- one definition of in use / expired / lapsed ------------------------------------------------

LEASES = {"none": None, "lapsed": -30, "live": 30}
TTLS = {"past": -60, "future": 3600}


def test_the_python_and_sql_definitions_agree_on_every_kind_of_record() -> None:
    """The engine decides with ``is_in_use``/``is_expired``/``is_lapsed`` on what it read;
    the take-over and the purge decide with ``in_use_q``/``expired_q``/``lapsed_q`` in SQL.
    If the two ever disagreed, the engine could take over a row the database calls in use,
    or the purge delete one the engine would keep."""
    now = timezone.now()
    cases = {}
    for state in State.values:
        for lease_name, lease in LEASES.items():
            for ttl_name, ttl in TTLS.items():
                key = f"{state}-{lease_name}-{ttl_name}"
                cases[key] = _record(
                    key=key,
                    state=state,
                    lease_expires_at=None if lease is None else now + timedelta(seconds=lease),
                    expires_at=now + timedelta(seconds=ttl),
                ).pk
    records = IdempotencyRecord.objects.all()
    in_sql = {
        "in_use": set(records.filter(in_use_q(now)).values_list("pk", flat=True)),
        "expired": set(records.filter(expired_q(now)).values_list("pk", flat=True)),
        "lapsed": set(records.filter(lapsed_q(now)).values_list("pk", flat=True)),
    }
    for key, pk in cases.items():
        snapshot = store.read(Scope(LOOKUP.account, LOOKUP.endpoint, key), "")
        assert snapshot is not None
        assert is_in_use(snapshot, now) is (pk in in_sql["in_use"]), key
        assert is_expired(snapshot, now) is (pk in in_sql["expired"]), key
        assert is_lapsed(snapshot, now) is (pk in in_sql["lapsed"]), key
    assert in_sql["in_use"]  # every definition is exercised both ways
    assert in_sql["expired"]
    assert in_sql["lapsed"]


# -- races between a read and the write that follows it ------------------------------------------


@pytest.mark.database_store("the database store's SQL paths")
def test_a_lease_renewed_between_the_read_and_the_take_over_is_not_taken_over(
    alice: User, post: Post, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retry reads a lapsed lease, then the first worker's heartbeat renews it before
    the take-over: the take-over re-checks the lease in its UPDATE, so the first worker
    keeps its key and the retry is told 409."""
    post("/effect/", {"amount": 1})
    IdempotencyRecord.objects.update(
        state=State.IN_PROGRESS,
        token="a" * 32,
        lease_expires_at=timezone.now() - timedelta(seconds=1),
        response_status=None,
        response_body=None,
    )
    take_over = DatabaseStore.take_over

    def renew_then_take_over(self: DatabaseStore, *args: Any) -> bool:
        IdempotencyRecord.objects.update(lease_expires_at=timezone.now() + timedelta(seconds=60))
        return take_over(self, *args)

    monkeypatch.setattr(DatabaseStore, "take_over", renew_then_take_over)
    response = post("/effect/", {"amount": 1})

    assert response.status_code == 409
    assert response["Retry-After"] == "1"
    assert effects() == 1
    record = IdempotencyRecord.objects.get()
    assert (record.token, record.state) == ("a" * 32, State.IN_PROGRESS)


@pytest.mark.database_store("the database store's SQL paths")
def test_a_row_that_keeps_vanishing_under_a_request_ends_in_409_not_a_spin(
    alice: User, post: Post, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim that keeps losing to a record that is gone when read (released, taken over)
    retries a bounded number of times, then answers 409 without running the view."""
    calls = []

    def always_vanished(self: DatabaseStore, write: Write) -> None:
        calls.append(write.scope.key)

    monkeypatch.setattr(DatabaseStore, "claim_or_read", always_vanished)
    response = post("/effect/", {"amount": 1})

    assert response.status_code == 409
    assert effects() == 0
    assert len(calls) == decisions.MAX_RACES + 1


def a_duplicate_waiting_on_the_lock() -> tuple[Any, Any]:
    """A POST to an atomic-mode view under "wait" held in its view (its claim
    uncommitted), then a duplicate waiting on the unique index behind it; both let go:
    their responses, in that order."""
    first: queue.Queue[Any] = queue.Queue()
    path = "/atomic-waiting/"
    holder = threading.Thread(target=lambda: first.put(send(path, {"gate": True})))
    holder.start()
    assert gate.entered.wait(20)
    second: queue.Queue[Any] = queue.Queue()
    waiter = threading.Thread(target=lambda: second.put(send(path, {"gate": True})))
    waiter.start()
    assert wait_until(lambda: lock_waiters() >= 1)
    finish([holder, waiter])
    return first.get(timeout=5), second.get(timeout=5)


@pytest.mark.concurrency
@pytest.mark.database_store("the database store's SQL paths")
def test_a_claim_that_waited_for_a_concurrent_claim_reads_the_row_it_lost_to(
    alice: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An atomic-mode claim holds the key uncommitted; a duplicate's claim waits on the
    unique index until it commits. On PostgreSQL the duplicate's one statement then finds
    neither a row it inserted nor, in its snapshot, the row it lost to: it must read again
    (one more statement), never call the key absent or go round the engine's race loop."""
    attempts: queue.Queue[str] = queue.Queue()
    claim_or_read = DatabaseStore.claim_or_read

    def counted(self: DatabaseStore, write: Write) -> Any:
        attempts.put(write.token)
        return claim_or_read(self, write)

    monkeypatch.setattr(DatabaseStore, "claim_or_read", counted)
    original, replay = a_duplicate_waiting_on_the_lock()

    assert original.status_code == 201
    assert replay.status_code == 201
    assert replay["Idempotent-Replayed"] == "true"
    assert effects() == 1
    assert attempts.qsize() == 2  # one claim attempt each: no race loop


@pytest.mark.concurrency
@pytest.mark.database_store("the database store's SQL paths")
def test_a_claim_that_waited_reads_its_own_endpoints_row_not_another_endpoints(
    alice: User,
) -> None:
    """The same race, with the account's key already used on two other endpoints (written
    first, their endpoints sorting on either side of ``/atomic/``): the read after the
    wait must find ``/atomic/``'s row, the one the claim lost to, never another endpoint's
    record (a 422, or another endpoint's response)."""
    before = [send(path, {"gate": False}) for path in ("/async/", "/effect/")]
    original, replay = a_duplicate_waiting_on_the_lock()

    assert [response.status_code for response in before] == [201, 201]
    assert original.status_code == 201
    assert replay.status_code == 201
    assert replay["Idempotent-Replayed"] == "true"
    assert replay.content == original.content
    assert effects() == 3
