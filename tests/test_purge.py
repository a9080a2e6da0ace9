"""The purge: ``idempotency_django.purge.purge_records`` and ``manage.py purge_idempotency_keys``.

The first part runs on every database; the concurrency part (purge and claims at once, on
separate connections) on PostgreSQL and MariaDB.
"""

from __future__ import annotations

import logging
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from idempotency_django.core import claims, shell
from idempotency_django.management.commands import purge_idempotency_keys as command_module
from idempotency_django.management.commands.purge_idempotency_keys import Command
from idempotency_django.models import IdempotencyRecord
from idempotency_django.operations import purge
from idempotency_django.purge import Pacing, PurgeResult, parse_duration, purge_records
from tests.project.factories import IdempotencyRecordFactory
from tools.server import example_env, run_python

State = IdempotencyRecord.State
pytestmark = pytest.mark.database_store("the purge deletes database rows (Redis expires its keys)")


HOUR = timedelta(hours=1)
FINGERPRINT = "0" * 64


def expired(ago: timedelta = HOUR, **kwargs: Any) -> IdempotencyRecord:
    """A completed record whose TTL ran out ``ago``."""
    now = timezone.now()
    return IdempotencyRecordFactory.completed(
        created_at=now - ago - timedelta(days=1), expires_at=now - ago, **kwargs
    )


def live(**kwargs: Any) -> IdempotencyRecord:
    return IdempotencyRecordFactory.completed(**kwargs)


def in_progress(lease_lapsed: timedelta | None = None, **kwargs: Any) -> IdempotencyRecord:
    """An in-progress record: its lease is live, or lapsed ``lease_lapsed`` ago."""
    now = timezone.now()
    lease = now + timedelta(seconds=10) if lease_lapsed is None else now - lease_lapsed
    return IdempotencyRecordFactory(lease_expires_at=lease, **kwargs)


def bulk_expired(count: int, prefix: str = "exp") -> list[IdempotencyRecord]:
    now = timezone.now()
    return IdempotencyRecord.objects.bulk_create(
        IdempotencyRecord(
            account="1",
            endpoint="POST /effect/",
            key=f"{prefix}-{index}",
            fingerprint=FINGERPRINT,
            state=State.COMPLETED,
            token=f"{index:032x}",
            response_status=201,
            response_body=b"{}",
            created_at=now - timedelta(days=2),
            completed_at=now - timedelta(days=2),
            # Distinct, ordered expiry times: the purge walks them in this order.
            expires_at=now - HOUR - timedelta(milliseconds=count - index),
        )
        for index in range(count)
    )


def keys() -> set[str]:
    return set(IdempotencyRecord.objects.values_list("key", flat=True))


def deletes(queries: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in queries.captured_queries if q["sql"].upper().startswith("DELETE")]


def in_list_size(sql: str) -> int:
    """How many values the (one) ``IN (…)`` list of ``sql`` holds (on PostgreSQL the keys
    are one array: ``= ANY('{1,2,3}'::bigint[])``)."""
    if " = ANY('{" in sql:
        start = sql.index(" = ANY('{") + len(" = ANY('{")
        return sql[start : sql.index("}", start)].count(",") + 1
    start = sql.index(" IN (") + len(" IN (")
    return sql[start : sql.index(")", start)].count(",") + 1


def claim_options(**kwargs: Any) -> claims.ClaimPolicy:
    values: dict[str, Any] = {
        "alias": "default",
        "lease": 10.0,
        "ttl": 86400.0,
        "in_flight": "conflict",
        "wait_seconds": 0.0,
        "retry_after": 1,
        **kwargs,
    }
    return claims.ClaimPolicy(**values)


def scope_of(record: IdempotencyRecord) -> claims.Scope:
    return claims.Scope(record.account, record.endpoint, record.key)


@pytest.fixture
def purged_reports() -> Iterator[list[dict[str, Any]]]:
    reports: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        reports.append({"sender": sender, **kwargs})

    purge.purged.connect(receiver)
    yield reports
    purge.purged.disconnect(receiver)


# --- purge_records ---------------------------------------------------------------------------


@pytest.mark.django_db
def test_deletes_expired_records_and_keeps_live_ones() -> None:
    old = [expired(key="old-1"), expired(timedelta(days=30), key="old-2")]
    keep = [live(key="live"), in_progress(key="running")]

    result = purge_records()

    assert result == PurgeResult(expired=2, stale=0, batches=1)
    assert keys() == {record.key for record in keep}
    assert not {record.key for record in old} & keys()


@pytest.mark.django_db
def test_a_record_whose_view_still_runs_is_kept_even_past_its_ttl() -> None:
    now = timezone.now()
    running = in_progress(key="running", expires_at=now - HOUR)
    dead = in_progress(timedelta(seconds=5), key="dead", expires_at=now - HOUR)

    result = purge_records()

    assert result.expired == 1
    assert keys() == {running.key}
    assert dead.key not in keys()


@pytest.mark.django_db
def test_records_still_running_past_their_ttl_do_not_stop_the_purge_behind_them() -> None:
    """Where a page is read from the expiry index alone (MariaDB/MySQL), a page can hold
    nothing but records whose view still runs: the DELETE keeps them and the purge reads
    on to the expired records behind them."""
    now = timezone.now()
    running = [
        in_progress(key=f"running-{n}", expires_at=now - timedelta(hours=3, seconds=n))
        for n in range(3)
    ]
    bulk_expired(2)  # expired after the running ones: behind them in the index

    result = purge_records(batch_size=2, include_stale=False)

    assert result.expired == 2
    assert keys() == {record.key for record in running}


@pytest.mark.django_db
@pytest.mark.parametrize("dry_run", [False, True])
def test_a_page_reads_the_expiry_index_alone_on_mariadb_unless_counting(dry_run: bool) -> None:
    """On MariaDB/MySQL a page of the expired pass names no column of the row but the
    expiry (the index holds it and the primary key; the DELETE re-checks the rest): reading
    the rows too was half of a page's time at 10 million records. A dry run counts its
    pages, so it reads exactly what it would delete, as the other databases always do."""
    bulk_expired(3)

    with CaptureQueriesContext(connection) as queries:
        result = purge_records(batch_size=5, include_stale=False, dry_run=dry_run)

    assert result.expired == 3
    pages = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("SELECT")]
    conditions = [sql.split(" WHERE ", 1)[1].split(" ORDER BY ")[0] for sql in pages]
    assert conditions
    index_only = connection.vendor == "mysql" and not dry_run
    assert all(("state" not in condition) == index_only for condition in conditions)


@pytest.mark.django_db
def test_older_than_keeps_recently_expired_records() -> None:
    expired(timedelta(hours=2), key="two-hours")
    expired(timedelta(days=2), key="two-days")

    assert purge_records(older_than=timedelta(days=1)).expired == 1
    assert keys() == {"two-hours"}


@pytest.mark.django_db
def test_deletes_in_batches_by_primary_key_each_re_checking_the_expiry() -> None:
    bulk_expired(25)
    live(key="live")
    seen: list[PurgeResult] = []

    with CaptureQueriesContext(connection) as queries:
        result = purge_records(batch_size=10, progress=seen.append)

    assert result.expired == 25
    assert result.batches == 3
    assert [report.expired for report in seen] == [10, 20, 25]
    statements = deletes(queries)
    assert len(statements) == 3
    # One bounded statement per batch: by primary key, with the conditions re-checked.
    assert [in_list_size(sql) for sql in statements] == [10, 10, 5]
    assert all("expires_at" in sql for sql in statements)
    assert keys() == {"live"}


@pytest.mark.django_db
def test_each_batch_reads_a_bounded_page_in_index_order() -> None:
    bulk_expired(7)

    with CaptureQueriesContext(connection) as queries:
        purge_records(batch_size=3, include_stale=False)

    reads = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("SELECT")]
    assert len(reads) == 3
    for sql in reads:
        assert "response_body" not in sql  # reads the pk and the expiry, nothing more
        assert "ORDER BY" in sql
        assert sql.endswith("LIMIT 3")
    # After the first page, each one starts where the previous one stopped (keyset), with
    # a bound the index scan can start from.
    assert not re.search(r"expires_at[\"`]? >= ", reads[0])
    assert all(re.search(r"expires_at[\"`]? >= ", sql) for sql in reads[1:])


@pytest.mark.django_db
@pytest.mark.parametrize("use_tz", [True, False])
def test_pages_continue_after_their_last_row_through_ties_in_the_expiry(
    settings: Any, use_tz: bool
) -> None:
    """The keyset cursor is the page's last ``(expiry, pk)``, read with the page (on
    PostgreSQL only that row's timestamp is parsed): a dry run, which deletes nothing, counts
    every record once across pages, with equal expiry times and with naive datetimes."""
    settings.USE_TZ = use_tz
    records = bulk_expired(8)
    IdempotencyRecord.objects.filter(pk__in=[r.pk for r in records[2:6]]).update(
        expires_at=records[2].expires_at
    )

    counted = purge_records(batch_size=3, include_stale=False, dry_run=True)
    result = purge_records(batch_size=3, include_stale=False)

    assert (counted.expired, counted.batches) == (8, 3)
    assert (result.expired, result.batches) == (8, 3)
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.django_db
def test_dry_run_counts_and_deletes_nothing(purged_reports: list[dict[str, Any]]) -> None:
    bulk_expired(12)
    in_progress(timedelta(hours=2), key="stale")
    live(key="live")
    before = keys()

    with CaptureQueriesContext(connection) as queries:
        result = purge_records(dry_run=True, batch_size=5)

    assert result == PurgeResult(expired=12, stale=1, batches=4, dry_run=True)
    assert keys() == before
    assert deletes(queries) == []
    assert purged_reports == []


@pytest.mark.django_db
def test_limit_stops_the_purge_and_says_whether_more_is_left() -> None:
    bulk_expired(25)

    first = purge_records(batch_size=5, limit=12)
    assert (first.expired, first.limit_reached) == (12, True)
    assert len(keys()) == 13

    second = purge_records(batch_size=5, limit=13)
    assert (second.expired, second.limit_reached) == (13, False)
    assert keys() == set()


@pytest.mark.django_db
def test_a_limit_reached_says_nothing_is_left_when_only_running_records_are() -> None:
    bulk_expired(2)
    in_progress(key="running", expires_at=timezone.now() - timedelta(minutes=30))

    result = purge_records(batch_size=5, limit=2)

    assert (result.expired, result.limit_reached) == (2, False)
    assert keys() == {"running"}


@pytest.mark.django_db
def test_limit_counts_stale_records_after_expired_ones() -> None:
    bulk_expired(3)
    in_progress(timedelta(hours=2), key="stale")

    result = purge_records(limit=3)

    assert (result.expired, result.stale, result.limit_reached) == (3, 0, True)
    assert keys() == {"stale"}


@pytest.mark.django_db
def test_stale_in_progress_records_are_purged_and_counted_apart() -> None:
    in_progress(timedelta(hours=2), key="abandoned")
    in_progress(timedelta(minutes=10), key="lapsed-recently")
    in_progress(key="running")
    expired(key="expired")
    live(key="completed")

    result = purge_records()

    assert (result.expired, result.stale) == (1, 1)
    assert keys() == {"lapsed-recently", "running", "completed"}


@pytest.mark.django_db
def test_stale_age_comes_from_the_setting_or_the_argument(settings: Any) -> None:
    in_progress(timedelta(minutes=10), key="ten-minutes")
    in_progress(timedelta(minutes=2), key="two-minutes")

    settings.IDEMPOTENCY = {"STALE_IN_PROGRESS_SECONDS": 5 * 60}
    assert purge_records().stale == 1
    assert keys() == {"two-minutes"}

    assert purge_records(stale_after=timedelta(minutes=1)).stale == 1
    assert keys() == set()


@pytest.mark.django_db
def test_include_stale_false_leaves_in_progress_records_alone() -> None:
    in_progress(timedelta(hours=2), key="abandoned")

    assert purge_records(include_stale=False).stale == 0
    assert keys() == {"abandoned"}


@pytest.mark.django_db
def test_a_record_both_expired_and_stale_is_counted_once() -> None:
    in_progress(timedelta(hours=2), key="both", expires_at=timezone.now() - HOUR)

    assert purge_records(dry_run=True) == PurgeResult(expired=1, batches=1, dry_run=True)
    assert purge_records() == PurgeResult(expired=1, batches=1)


@pytest.mark.django_db
def test_queryset_restricts_the_purge() -> None:
    expired(key="mine", account="7")
    expired(key="theirs", account="8")

    result = purge_records(queryset=IdempotencyRecord.objects.filter(account="7"))

    assert result.expired == 1
    assert keys() == {"theirs"}


@pytest.mark.django_db
def test_a_key_taken_over_between_read_and_delete_is_not_deleted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The DELETE re-checks: a retry that took an expired key over in between keeps it."""
    records = bulk_expired(3)
    target = records[1]
    delete = purge._delete
    taken: list[claims.Claim] = []

    def take_over_then_delete(alias: str, pks: list[int], condition: Any) -> int:
        assert target.pk in pks  # the purge read it as expired
        claim = shell.claim_or_replay(scope_of(target), FINGERPRINT, claim_options())
        assert isinstance(claim, claims.Claim)
        taken.append(claim)
        return delete(alias, pks, condition)

    monkeypatch.setattr(purge, "_delete", take_over_then_delete)
    result = purge_records()

    assert result.expired == 2
    survivor = IdempotencyRecord.objects.get()
    assert survivor.key == target.key
    assert (survivor.state, survivor.token) == (State.IN_PROGRESS, taken[0].token)


@pytest.mark.django_db
def test_a_lease_renewed_between_read_and_delete_is_not_deleted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    record = in_progress(timedelta(seconds=5), key="revived", expires_at=timezone.now() - HOUR)
    delete = purge._delete

    def renew_then_delete(alias: str, pks: list[int], condition: Any) -> int:
        IdempotencyRecord.objects.filter(pk=record.pk).update(
            lease_expires_at=timezone.now() + timedelta(seconds=10)
        )
        return delete(alias, pks, condition)

    monkeypatch.setattr(purge, "_delete", renew_then_delete)

    assert purge_records().expired == 0
    assert keys() == {"revived"}


@pytest.mark.django_db
def test_batches_fit_the_databases_limits() -> None:
    """SQLite takes at most 999 parameters; MariaDB plans an IN list of 1000 values or more
    as a join, which a DELETE runs as a table scan."""
    bulk_expired(1200)

    with CaptureQueriesContext(connection) as queries:
        result = purge_records(batch_size=5000)

    assert result.expired == 1200
    sizes = [in_list_size(sql) for sql in deletes(queries)]
    assert sum(sizes) == 1200
    if connection.vendor == "postgresql":
        assert sizes == [1200]
    elif connection.vendor == "mysql":
        assert max(sizes) < 1000
        assert len(sizes) == 2
    else:  # SQLite: Django's max_query_params (999 before Django 6.0, the library's limit after)
        assert max(sizes) <= connection.features.max_query_params


@pytest.mark.django_db
def test_purged_signal_reports_the_counts(purged_reports: list[dict[str, Any]]) -> None:
    expired()
    expired()
    in_progress(timedelta(hours=2))

    purge_records()
    purge_records()

    assert [(r["sender"], r["expired"], r["stale"], r["using"]) for r in purged_reports] == [
        (IdempotencyRecord, 2, 1, "default"),
        (IdempotencyRecord, 0, 0, "default"),
    ]


@pytest.mark.django_db
def test_oldest_expired_is_the_expiry_of_the_oldest_record_the_purge_would_delete() -> None:
    store = claims.get_store()
    assert store.oldest_expired() is None  # an empty table
    live(key="live")
    assert store.oldest_expired() is None  # nothing expired

    now = timezone.now()
    # Past its TTL but its view still runs: in use, not expired, and the purge keeps it.
    in_progress(key="running", expires_at=now - timedelta(days=3))
    newer = expired(HOUR, key="newer")
    older = expired(timedelta(days=2), key="older")

    oldest = store.oldest_expired()
    assert oldest == IdempotencyRecord.objects.get(pk=older.pk).expires_at

    purge_records(include_stale=False, pacing=Pacing.flat_out())
    assert not IdempotencyRecord.objects.filter(pk__in=[older.pk, newer.pk]).exists()
    assert store.oldest_expired() is None  # what is left is in use or live


@pytest.mark.django_db
def test_result_as_dict() -> None:
    expired()
    # The start; the batch's start and end; the empty page of stale records; the end.
    ticks = iter([10.0, 10.0, 10.5, 10.9, 11.0])
    result = purge_records(pacing=Pacing(clock=lambda: next(ticks)))
    assert result.as_dict() == {
        "expired": 1,
        "stale": 0,
        "total": 1,
        "batches": 1,
        "dry_run": False,
        "limit_reached": False,
        "seconds": 1.0,
        "paused": 0.0,
        "rate": 1.0,
    }


# --- pacing ------------------------------------------------------------------------------------


class FakeTime:
    """A clock that ``step``s forward on every reading (each batch seems to take one step)
    and a ``sleep`` that only writes down what it was asked for."""

    def __init__(self, step: float = 0.004) -> None:
        self.now = 100.0
        self.step = step
        self.sleeps: list[float] = []

    def clock(self) -> float:
        self.now += self.step
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)


def test_a_pause_keeps_the_rate_under_its_ceiling() -> None:
    pacing = Pacing(rate=25_000, busy_share=1)
    # 500 rows may take 20 ms: a batch that took 5 ms is followed by 15 ms of rest.
    assert pacing.pause(500, took=0.005) == pytest.approx(0.015)
    assert pacing.pause(500, took=0.030) == 0  # slower than the ceiling already


def test_a_pause_grows_with_the_batch_when_the_database_is_busy() -> None:
    pacing = Pacing(rate=0, busy_share=0.25)
    assert pacing.pause(500, took=0.01) == pytest.approx(0.03)
    assert pacing.pause(500, took=0.2) == pytest.approx(0.6)


def test_a_pause_is_the_longer_of_the_two() -> None:
    pacing = Pacing(rate=1000, busy_share=0.5)
    assert pacing.pause(100, took=0.01) == pytest.approx(0.09)  # the rate's
    assert pacing.pause(100, took=0.3) == pytest.approx(0.3)  # the share's


def test_flat_out_never_pauses() -> None:
    pacing = Pacing.flat_out()
    assert not pacing.paces
    assert pacing.pause(500, took=0.001) == 0
    assert pacing.pause(500, took=10) == 0
    assert pacing.describe() == "not paced"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"rate": -1}, "rate must be zero"),
        ({"rate": float("nan")}, "rate must be zero"),
        ({"busy_share": 0}, "busy_share must be more than 0"),
        ({"busy_share": 1.5}, "busy_share must be more than 0"),
    ],
)
def test_bad_pacing_raises_value_error(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Pacing(**arguments)


@pytest.mark.django_db
def test_the_purge_sleeps_between_batches_as_its_pacing_asks() -> None:
    bulk_expired(5)
    fake = FakeTime(step=0.004)

    result = purge_records(
        batch_size=2, pacing=Pacing(rate=100, busy_share=1, clock=fake.clock, sleep=fake.sleep)
    )

    assert (result.expired, result.batches) == (5, 3)
    assert keys() == set()
    # 2 rows at 100 rows/s take 20 ms; each batch took 4 ms (one step of the fake clock):
    # 16 ms of rest after the first two batches, none after the last.
    assert fake.sleeps == [pytest.approx(0.016), pytest.approx(0.016)]
    assert result.paused == pytest.approx(0.032)


@pytest.mark.django_db
def test_the_purge_backs_off_as_its_batches_slow_down() -> None:
    bulk_expired(5)
    sleeps: list[float] = []
    # The start; batch 1 takes 10 ms, batch 2 60 ms, batch 3 (the last, 1 row) 1 ms; the
    # empty page of stale records; the end.
    ticks = iter([0.0, 0.0, 0.01, 0.01, 0.07, 0.07, 0.071, 0.071, 0.071])
    pacing = Pacing(rate=0, busy_share=0.25, clock=lambda: next(ticks), sleep=sleeps.append)

    result = purge_records(batch_size=2, pacing=pacing)

    assert result.total == 5
    assert sleeps == [pytest.approx(0.03), pytest.approx(0.18)]
    assert result.seconds == pytest.approx(0.071)
    assert result.rate == pytest.approx(5 / 0.071)


@pytest.mark.django_db
def test_the_default_pacing_comes_from_the_purge_rate_setting(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.IDEMPOTENCY = {}
    assert Pacing.from_settings() == Pacing(rate=25_000, busy_share=purge.DEFAULT_BUSY_SHARE)
    settings.IDEMPOTENCY = {"PURGE_RATE": 0}
    assert Pacing.from_settings().rate == 0
    assert Pacing.from_settings().paces  # no ceiling, still backs off
    settings.IDEMPOTENCY = {"PURGE_RATE": 1.5}
    bulk_expired(3)
    # The default pacing, timed by a fake clock (each batch seems to take 4 ms) and waiting
    # through this module's ``_sleep``: no real time is read, none is spent.
    fake = FakeTime(step=0.004)
    from_settings = Pacing.from_settings
    monkeypatch.setattr(
        Pacing, "from_settings", classmethod(lambda cls: replace(from_settings(), clock=fake.clock))
    )
    slept: list[float] = []
    monkeypatch.setattr(purge, "_sleep", slept.append)

    result = purge_records(batch_size=1)

    # Full batches of one row at 1.5 rows/s: 2/3 s each, less the 4 ms the batch took, as a
    # pause after each (the third batch is full too, so the purge pauses before the read
    # that finds nothing left).
    assert result.total == 3
    assert slept == [pytest.approx(1 / 1.5 - 0.004)] * 3


@pytest.mark.parametrize(("value"), [-1, "fast", None])
def test_a_bad_purge_rate_setting_raises_improperly_configured(settings: Any, value: Any) -> None:
    settings.IDEMPOTENCY = {"PURGE_RATE": value}
    with pytest.raises(ImproperlyConfigured, match="PURGE_RATE"):
        purge_records()


@pytest.mark.django_db
def test_inside_a_transaction_the_purge_warns(caplog: pytest.LogCaptureFixture) -> None:
    # pytest-django's ``db`` runs each test inside a transaction.
    assert connection.in_atomic_block
    with caplog.at_level(logging.WARNING, logger="idempotency_django"):
        purge_records()
    assert "inside an open transaction" in caplog.text


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"older_than": timedelta(seconds=-1)}, "older_than must not be negative"),
        ({"stale_after": timedelta(seconds=-1)}, "stale_after must not be negative"),
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"limit": 0}, "limit must be a positive integer"),
    ],
)
def test_bad_arguments_raise_value_error(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        purge_records(**arguments)


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("PURGE_BATCH_SIZE", 0),
        ("PURGE_BATCH_SIZE", "1000"),
        ("PURGE_BATCH_SIZE", True),
        ("STALE_IN_PROGRESS_SECONDS", -1),
        ("STALE_IN_PROGRESS_SECONDS", "1h"),
    ],
)
def test_bad_settings_raise_improperly_configured(settings: Any, setting: str, value: Any) -> None:
    settings.IDEMPOTENCY = {setting: value}
    with pytest.raises(ImproperlyConfigured, match=setting):
        purge_records()


def test_settings_defaults(settings: Any) -> None:
    settings.IDEMPOTENCY = {}
    assert purge.batch_size_setting() == 1000
    assert purge.stale_after_setting() == timedelta(hours=1)
    settings.IDEMPOTENCY = {"PURGE_BATCH_SIZE": 250, "STALE_IN_PROGRESS_SECONDS": 90.5}
    assert purge.batch_size_setting() == 250
    assert purge.stale_after_setting() == timedelta(seconds=90.5)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("7d", timedelta(days=7)),
        ("12h", timedelta(hours=12)),
        ("30m", timedelta(minutes=30)),
        ("45s", timedelta(seconds=45)),
        ("2w", timedelta(weeks=2)),
        ("1d12h", timedelta(days=1, hours=12)),
        (" 0S ", timedelta(0)),
    ],
)
def test_parse_duration(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "7", "d", "7x", "-1d", "1.5h", "7 d", "h12"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration(text)


# --- the management command ------------------------------------------------------------------


def run(*args: str, verbosity: int = 1) -> str:
    out = StringIO()
    call_command("purge_idempotency_keys", *args, stdout=out, verbosity=verbosity)
    return out.getvalue()


@pytest.mark.django_db
def test_command_deletes_and_prints_a_summary() -> None:
    bulk_expired(3)
    in_progress(timedelta(hours=2), key="stale")
    live(key="live")

    output = run()

    assert "Deleted 3 expired records and 1 stale in-progress record." in output
    assert keys() == {"live"}


@pytest.mark.django_db
def test_command_dry_run() -> None:
    bulk_expired(1)

    output = run("--dry-run")

    assert "Would delete 1 expired record and 0 stale in-progress records" in output
    assert "dry run: nothing was deleted" in output
    assert len(keys()) == 1


@pytest.mark.django_db
def test_command_options_reach_the_purge() -> None:
    expired(timedelta(hours=2), key="two-hours")
    expired(timedelta(days=2), key="two-days")
    in_progress(timedelta(minutes=20), key="twenty-minutes")

    output = run("--older-than", "1d", "--stale-after", "10m")

    assert "Deleted 1 expired record and 1 stale in-progress record." in output
    assert keys() == {"two-hours"}


@pytest.mark.django_db
def test_command_limit_says_more_is_left() -> None:
    bulk_expired(5)

    output = run("--limit", "2", "--batch-size", "1")

    assert "Deleted 2 expired records" in output
    assert "Stopped at --limit 2: more records are left to purge." in output
    assert len(keys()) == 3


@pytest.mark.django_db
def test_command_prints_progress_per_batch_at_verbosity_2() -> None:
    bulk_expired(5)

    output = run("--batch-size", "2", verbosity=2)

    progress = [line for line in output.splitlines() if line.startswith("…")]
    assert len(progress) == 3
    assert "3 batches, deleted 5 expired and 0 stale in-progress records so far" in progress[-1]


@pytest.mark.django_db
def test_command_prints_progress_on_long_runs_at_verbosity_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bulk_expired(4)
    assert not [line for line in run("--batch-size", "2").splitlines() if line.startswith("…")]

    bulk_expired(4)
    # A "long run": every batch ends later than the progress interval.
    monkeypatch.setattr(Command, "progress_interval", 0.0)
    output = run("--batch-size", "2", "--dry-run")
    progress = [line for line in output.splitlines() if line.startswith("…")]
    assert len(progress) == 2
    assert "2 batches, would delete 4 expired and 0 stale in-progress records" in progress[1]


@pytest.mark.django_db
def test_command_is_silent_at_verbosity_0() -> None:
    bulk_expired(2)
    assert run(verbosity=0) == ""
    assert keys() == set()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--older-than", "7"], "argument --older-than: '7' is not a duration"),
        (["--stale-after", "soon"], "argument --stale-after: 'soon' is not a duration"),
        (["--batch-size", "0"], "argument --batch-size: must be a positive integer, not '0'"),
        (["--limit", "many"], "argument --limit: must be a positive integer, not 'many'"),
        (["--database", "nope"], "Unknown database 'nope'"),
        (["--older-than", "-1d"], "^--older-than must not be negative: give how long ago"),
        (["--older-than=-1d"], "^--older-than must not be negative"),
        (["--older", "-1d"], "^--older-than must not be negative"),
        (["--stale-after", "-30m"], "^--stale-after must not be negative"),
        (["--older-than", "-1.5h"], "argument --older-than: '-1.5h' is not a duration"),
        (["--older-than", "--dry-run"], "argument --older-than: expected one argument"),
        (["--older-than"], "argument --older-than: expected one argument"),
        (["--no-such-option"], "unrecognized arguments: --no-such-option"),
        (["--rate", "-5"], "argument --rate: must be a number of rows per second .*'-5'"),
        (["--rate", "fast"], "argument --rate: must be a number of rows per second"),
        (["--rate", "nan"], "argument --rate: must be a number of rows per second"),
        (["--rate", "inf"], "argument --rate: must be a number of rows per second"),
        (["--rate", "100", "--no-pacing"], "argument --no-pacing: not allowed with argument"),
        (["--no-pacing", "yes"], "unrecognized arguments: yes"),
    ],
)
def test_command_bad_arguments_raise_command_error_with_status_2(
    args: list[str], message: str
) -> None:
    """Every bad option is the same failure, exit status 2 (a usage error), whether argparse
    or the command found it."""
    with pytest.raises(CommandError, match=message) as raised:
        run(*args)
    assert raised.value.returncode == 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"older_than": timedelta(days=-1)}, "^--older-than must not be negative"),
        ({"stale_after": "-1h"}, "^--stale-after must not be negative"),
        ({"older_than": "soon"}, "^--older-than: 'soon' is not a duration"),
        ({"rate": "fast"}, "^--rate: must be a number of rows per second"),
        ({"rate": -1}, "^--rate: must be a number of rows per second"),
        ({"rate": 100, "no_pacing": True}, "^--rate and --no-pacing contradict each other"),
    ],
)
def test_command_checks_durations_given_as_keyword_arguments(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(CommandError, match=message) as raised:
        call_command("purge_idempotency_keys", **options)
    assert raised.value.returncode == 2


@pytest.mark.django_db
def test_command_takes_durations_as_keyword_arguments_too() -> None:
    expired(timedelta(hours=2), key="two-hours")
    expired(timedelta(days=2), key="two-days")
    in_progress(timedelta(minutes=20), key="twenty-minutes")

    call_command(
        "purge_idempotency_keys", older_than="1d", stale_after=timedelta(minutes=10), verbosity=0
    )

    assert keys() == {"two-hours"}


@pytest.fixture
def pacing_used(monkeypatch: pytest.MonkeyPatch) -> list[Pacing]:
    """The ``pacing`` the command passes to the purge, run for real."""
    used: list[Pacing] = []

    def purge_and_record(**kwargs: Any) -> PurgeResult:
        used.append(kwargs["pacing"])
        return purge_records(**kwargs)

    monkeypatch.setattr(command_module, "purge_records", purge_and_record)
    return used


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "setting", "expected", "said"),
    [
        ([], None, Pacing(rate=25_000), "at most 25,000 rows/s, busy at most 50% of the time"),
        ([], 400, Pacing(rate=400), "at most 400 rows/s, busy at most 50% of the time"),
        (["--rate", "1000"], 400, Pacing(rate=1000), "at most 1,000 rows/s"),
        (["--rate", "0"], None, Pacing(rate=0), "(busy at most 50% of the time)"),
        (["--no-pacing"], None, Pacing.flat_out(), "(not paced)"),
    ],
)
def test_command_paces_as_its_options_and_the_setting_say(
    settings: Any,
    pacing_used: list[Pacing],
    args: list[str],
    setting: int | None,
    expected: Pacing,
    said: str,
) -> None:
    settings.IDEMPOTENCY = {} if setting is None else {"PURGE_RATE": setting}
    bulk_expired(2)

    output = run(*args)

    assert pacing_used == [expected]
    assert "Deleted 2 expired records and 0 stale in-progress records. 1 batch, " in output
    assert said in output
    assert re.search(r"s, [\d,]+ rows/s \(", output), output  # the rate it achieved


@pytest.mark.django_db
def test_command_rate_as_a_keyword_argument(pacing_used: list[Pacing]) -> None:
    call_command("purge_idempotency_keys", rate="250", verbosity=0)
    call_command("purge_idempotency_keys", no_pacing=True, verbosity=0)
    assert pacing_used == [Pacing(rate=250), Pacing.flat_out()]


def test_command_bad_purge_rate_setting_raises_command_error(settings: Any) -> None:
    settings.IDEMPOTENCY = {"PURGE_RATE": -1}
    with pytest.raises(CommandError, match=r"PURGE_RATE is -1: expected a number") as e:
        run()
    assert e.value.returncode == 1  # the configuration is wrong, not the command line


@pytest.mark.django_db
def test_command_a_negative_zero_is_zero() -> None:
    expired(key="expired")
    assert "Deleted 1 expired record" in run("--older-than", "-0s")


def test_command_bad_setting_raises_command_error(settings: Any) -> None:
    settings.IDEMPOTENCY = {"PURGE_BATCH_SIZE": "lots"}
    with pytest.raises(CommandError, match=r"PURGE_BATCH_SIZE is .lots.: expected a number") as e:
        run()
    assert e.value.returncode == 1  # the configuration is wrong, not the command line


@pytest.mark.django_db
def test_command_database_error_fails_and_says_what_was_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bulk_expired(5)
    delete = purge._delete
    calls = []

    def fail_second_batch(alias: str, pks: list[int], condition: Any) -> int:
        calls.append(pks)
        if len(calls) == 2:
            raise DatabaseError("the database went away")
        return delete(alias, pks, condition)

    monkeypatch.setattr(purge, "_delete", fail_second_batch)

    with pytest.raises(CommandError) as raised:
        run("--batch-size", "2")

    message = str(raised.value)
    assert "Purge stopped after 1 batch: the database went away." in message
    assert "Deleted 2 expired records" in message
    assert len(keys()) == 3  # the first batch committed on its own


def test_command_exit_status_from_the_command_line(tmp_path: Path) -> None:
    """A real project runs it: exit status 0 on success, 2 with the message for a bad option
    (argparse's own status for a usage error, whoever finds it), 1 for a failure."""
    migrated_env = example_env(f"sqlite:///{tmp_path / 'example.sqlite3'}")

    def manage(*args: str, env: dict[str, str] = migrated_env) -> subprocess.CompletedProcess[str]:
        return run_python(env, "manage.py", *args)

    migrated = manage("migrate", "-v", "0")
    assert migrated.returncode == 0, migrated.stderr
    ok = manage("purge_idempotency_keys")
    assert ok.returncode == 0, ok.stderr
    assert "Deleted 0 expired records and 0 stale in-progress records." in ok.stdout
    usage = manage("purge_idempotency_keys", "--older-than", "7")
    assert usage.returncode == 2  # argparse's status for a usage error
    assert "'7' is not a duration" in usage.stderr
    for negative in (["--older-than", "-1d"], ["--older-than=-1d"]):
        refused = manage("purge_idempotency_keys", *negative)
        assert refused.returncode == 2, refused.stderr
        assert "CommandError: --older-than must not be negative" in refused.stderr
    paced = manage("purge_idempotency_keys", "--rate", "-5")
    assert paced.returncode == 2
    assert "argument --rate: must be a number of rows per second" in paced.stderr
    unknown = manage("purge_idempotency_keys", "--database", "nope")
    assert unknown.returncode == 2
    assert "CommandError: Unknown database 'nope'." in unknown.stderr
    # A failure, not a bad option: a database where nothing was migrated.
    failed = manage(
        "purge_idempotency_keys",
        env=example_env(f"sqlite:///{tmp_path / 'not-migrated.sqlite3'}"),
    )
    assert failed.returncode == 1
    assert "CommandError: Purge stopped after 0 batches" in failed.stderr


# --- concurrently with claims (PostgreSQL, MariaDB) --------------------------------------------


@contextmanager
def lock_waits_limited(seconds: int) -> Iterator[None]:
    """Make a lock wait longer than ``seconds`` fail the statement on this connection."""
    if connection.vendor == "postgresql":
        setting, value = "lock_timeout", f"'{seconds}s'"
    else:
        setting, value = "SESSION innodb_lock_wait_timeout", str(seconds)
    with connection.cursor() as cursor:
        cursor.execute(f"SET {setting} = {value}")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"SET {setting} = DEFAULT")


def open_write_transaction() -> bool:
    """Whether this connection is inside a transaction that has written something."""
    if connection.in_atomic_block or not connection.get_autocommit():
        return True
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_current_xact_id_if_assigned() IS NOT NULL")
        else:
            cursor.execute(
                "SELECT COUNT(*) > 0 FROM information_schema.innodb_trx "
                "WHERE trx_mysql_thread_id = CONNECTION_ID()"
            )
        return bool(cursor.fetchone()[0])


def in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``target`` in a thread with its own connection; its result or exception lands in
    the returned list."""
    outcome: list[Any] = []

    def run_it() -> None:
        try:
            outcome.append(target())
        except BaseException as exc:
            outcome.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run_it)
    thread.start()
    return thread, outcome


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_between_batches_the_purge_holds_nothing_and_claims_go_through() -> None:
    """Paused between two batches, the purge has no open transaction: a claim on a key it
    is about to delete neither waits (a lock wait over 1 s would fail it) nor loses its
    record when the purge goes on."""
    records = bulk_expired(30)
    later = records[25]  # in the last batch
    pauses: list[bool] = []
    taken: list[Any] = []

    def between_batches(result: PurgeResult) -> None:
        if result.batches != 1:
            return
        pauses.append(open_write_transaction())

        def claim() -> Any:
            with lock_waits_limited(1):
                started = time.monotonic()
                outcome = shell.claim_or_replay(scope_of(later), FINGERPRINT, claim_options())
                return outcome, time.monotonic() - started

        thread, outcome = in_thread(claim)
        thread.join(30)
        taken.extend(outcome)

    result = purge_records(batch_size=10, progress=between_batches)

    assert pauses == [False]
    assert len(taken) == 1
    claim, seconds = taken[0]
    assert isinstance(claim, claims.Claim)
    assert seconds < 2
    assert result.expired == 29
    survivor = IdempotencyRecord.objects.get()
    assert (survivor.key, survivor.token, survivor.state) == (
        later.key,
        claim.token,
        State.IN_PROGRESS,
    )


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_claims_during_a_purge_are_not_blocked_and_keep_their_records() -> None:
    """Claims hammer the keys the purge is deleting, on their own connections, from before
    its first batch to after its last: none waits on a lock for more than 1 s (the database
    would fail it) or takes over 2 s, and every claimed record survives the purge."""
    total = 2000
    clients = 3
    started_at = timezone.now()
    bulk_expired(total)
    keep = live(key="live")
    barrier = threading.Barrier(clients + 1, timeout=30)
    purge_done = threading.Event()
    claims_started = threading.Semaphore(0)

    def client(index: int) -> list[tuple[str, Any, float]]:
        with lock_waits_limited(1):
            return claim_keys(index)

    def claim_keys(index: int) -> list[tuple[str, Any, float]]:
        barrier.wait()
        done = []
        # Each client walks its share of the keys from the last the purge deletes to the
        # first, so that claims and batches meet on the same rows; then fresh keys, until
        # the purge is over.
        for number in range(total - 1 - index, -10 * total, -clients):
            if purge_done.is_set() and number < 0:
                return done
            key = f"exp-{number}" if number >= 0 else f"fresh-{-number}"
            scope = claims.Scope("1", "POST /effect/", key)
            started = time.monotonic()
            outcome = shell.claim_or_replay(scope, FINGERPRINT, claim_options())
            done.append((key, outcome, time.monotonic() - started))
            if len(done) == 5:
                claims_started.release()
        return done

    threads = [in_thread(lambda i=i: client(i)) for i in range(clients)]

    def after_each_batch(result: PurgeResult) -> None:
        if result.batches == 1:  # the claims are under way before the purge goes on
            for _ in range(clients):
                assert claims_started.acquire(timeout=30)

    barrier.wait()
    try:
        result = purge_records(batch_size=50, progress=after_each_batch)
    finally:
        purge_done.set()
        for thread, _ in threads:
            thread.join(60)

    outcomes = [outcome for _, outcome in threads]
    assert all(len(outcome) == 1 and isinstance(outcome[0], list) for outcome in outcomes), [
        outcome[0] for outcome in outcomes if not isinstance(outcome[0], list)
    ]
    taken = [claim for outcome in outcomes for claim in outcome[0]]
    assert all(isinstance(outcome, claims.Claim) for _, outcome, _ in taken)
    slowest = max(seconds for _, _, seconds in taken)
    assert slowest < 2, slowest

    # Every claimed record is there, still owned by its claim; nothing expired is left.
    tokens = dict(IdempotencyRecord.objects.values_list("key", "token"))
    claimed_expired = {key for key, _, _ in taken if key.startswith("exp-")}
    assert claimed_expired  # the claims did meet the purge's keys
    for key, claim, _ in taken:
        assert tokens.get(key) == claim.token, key
    assert tokens[keep.key] == keep.token
    assert not IdempotencyRecord.objects.filter(expires_at__lt=started_at).exists()
    # Each expired record was either deleted by the purge or taken over by a claim first.
    assert result.expired + len(claimed_expired) >= total
    assert result.expired <= total
    assert set(tokens) == {keep.key} | {key for key, _, _ in taken}


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_a_claim_held_open_in_atomic_mode_does_not_block_the_purge() -> None:
    """An atomic-mode claim keeps its row uncommitted while its view runs. The purge's
    DELETEs go by primary key, so they never wait for it (a DELETE that scanned the table
    would, on MariaDB, while holding the rows it had deleted)."""
    bulk_expired(60)
    claimed = threading.Event()
    release = threading.Event()

    def hold_a_claim() -> Any:
        scope = claims.Scope("1", "POST /effect/", "held")
        with transaction.atomic():
            claim = shell.claim_or_replay(scope, FINGERPRINT, claim_options())
            claimed.set()
            release.wait(30)
        return claim

    thread, outcome = in_thread(hold_a_claim)
    try:
        assert claimed.wait(30)
        with lock_waits_limited(1):
            result = purge_records(batch_size=50)
    finally:
        release.set()
        thread.join(30)

    assert result.expired == 60
    assert isinstance(outcome[0], claims.Claim)
    assert keys() == {"held"}
