"""The admin overview's panels: what an operator asks of the records first.

Records in flight, the oldest claim in flight, lapsed claims nobody took over, expired
records the purge has not deleted yet (its lag), the table's estimated size, and the
busiest endpoints of the last hour by outcome. Each panel is one bounded read of an index,
whatever the table's size (``benchmarks/admin_scale.py`` times them at 10 million records):

- counts stop at ``COUNT_LIMIT`` (``COUNT(*)`` over ``LIMIT``), and say "more than" past it;
- the oldest claim in flight and the oldest lapse read the ``(state, lease_expires_at)``
  index's in-progress range (as many entries as claims in progress, never the table);
- the purge lag is ``Store.oldest_expired``: the first entry of the ``expires_at`` index;
- the table's size is the database's own estimate (``pg_class.reltuples``,
  ``information_schema.TABLES.TABLE_ROWS``), never ``COUNT(*)``;
- the busiest endpoints are counted over the newest ``RECENT_LIMIT`` records of the last
  hour, read backwards through the ``created_at`` index (migration 0006).

Every time compared is the database's (``DatabaseNow``), as the claims compare leases.
A store outside the database (Redis) keeps no index by state, lease or creation: only this
process's heartbeat can be shown for it (``redis_overview``), and the page says what cannot.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import connections
from django.db.models import QuerySet
from django.utils import timezone

from idempotency_django.core.heartbeat import HeartbeatStatus
from idempotency_django.core.heartbeat import heartbeat as process_heartbeat
from idempotency_django.models import IdempotencyRecord
from idempotency_django.store import database as database_store
from idempotency_django.store.base import Store, expired_q, in_use_q, lapsed_q
from idempotency_django.store.database import DatabaseNow

State = IdempotencyRecord.State

#: Counts stop here: past it a panel says "more than 10,000" (exact counts of a large range
#: would read all of it).
COUNT_LIMIT = 10_000
#: The busiest endpoints are counted over at most this many of the last hour's records, the
#: newest (the page says so when the hour had more).
RECENT_LIMIT = 10_000
WINDOW = timedelta(hours=1)
#: The outcome columns of the busiest endpoints: a record in progress, or the class of the
#: status its response was stored with. Replays and released claims leave no record of
#: their own: the metrics count them.
OUTCOMES = ("in progress", "2xx", "3xx", "4xx", "5xx")


@dataclass(frozen=True)
class Count:
    value: int
    more: bool  # the count stopped at COUNT_LIMIT

    def __str__(self) -> str:
        return f"more than {COUNT_LIMIT:,}" if self.more else f"{self.value:,}"


@dataclass(frozen=True)
class Claim:
    """A record shown in a panel, with its age on this process's clock."""

    pk: int
    key: str
    account: str
    endpoint: str
    since: datetime | None  # created_at (in flight) or lease_expires_at (lapsed)
    age: timedelta

    @property
    def age_text(self) -> str:
        return describe_age(self.age)


def describe_age(age: timedelta | None) -> str:
    """``"42 s"``, ``"5 min 3 s"``, ``"3 h 20 min"``, ``"2 d 4 h"``: for people."""
    if age is None:
        return "—"
    seconds = int(age.total_seconds())
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes} min"
    if minutes:
        return f"{minutes} min {seconds} s"
    return f"{seconds} s"


@dataclass(frozen=True)
class EndpointRow:
    endpoint: str
    total: int
    outcomes: list[int]  # in the order of OUTCOMES


@dataclass(frozen=True)
class Busiest:
    rows: list[EndpointRow]
    counted: int  # records counted
    capped: bool  # the hour had RECENT_LIMIT records or more: the newest were counted
    since: datetime | None  # the oldest record counted (when capped)


@dataclass
class Panel:
    name: str
    title: str
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def milliseconds(self) -> float:
        return self.seconds * 1000


def _count(queryset: QuerySet[IdempotencyRecord]) -> Count:
    """``COUNT(*)`` over ``LIMIT COUNT_LIMIT + 1``: a bounded range of an index."""
    found = queryset.order_by()[: COUNT_LIMIT + 1].count()
    return Count(min(found, COUNT_LIMIT), found > COUNT_LIMIT)


def _claim(record: Any, now: datetime) -> Claim | None:
    if record is None:
        return None
    pk, key, account, endpoint, since = record
    if since is None:  # a lapsed claim without a lease: when it was made
        return Claim(pk, key, account, endpoint, since, timedelta(0))
    return Claim(pk, key, account, endpoint, since, now - since)


_SHOWN = ("pk", "key", "account", "endpoint")


def in_flight(records: QuerySet[IdempotencyRecord]) -> dict[str, Any]:
    """Records in use (in progress under a live lease), and the oldest of them by creation:
    the in-progress range of the ``(state, lease_expires_at)`` index, sorted (as many rows
    as claims running now)."""
    live = records.filter(in_use_q(DatabaseNow()))
    oldest = live.order_by("created_at", "pk").values_list(*_SHOWN, "created_at").first()
    return {"count": _count(live), "oldest": _claim(oldest, timezone.now())}


def lapsed(records: QuerySet[IdempotencyRecord]) -> dict[str, Any]:
    """In-progress records whose lease lapsed and that no retry took over (their worker died
    or lost the store), and the one that lapsed first: the start of the same index's range."""
    dead = records.filter(lapsed_q(DatabaseNow()))
    first = (
        dead.order_by("state", "lease_expires_at", "pk")
        .values_list(*_SHOWN, "lease_expires_at")
        .first()
    )
    return {"count": _count(dead), "oldest": _claim(first, timezone.now())}


def purge_lag(records: QuerySet[IdempotencyRecord], store: Store, alias: str) -> dict[str, Any]:
    """Expired records still present: how many (bounded) and the expiry of the oldest
    (``Store.oldest_expired``), both through the ``expires_at`` index."""
    oldest = store.bind(alias).oldest_expired()
    lag = None if oldest is None else max(timedelta(0), timezone.now() - oldest)
    return {
        "count": _count(records.filter(expired_q(DatabaseNow()))),
        "oldest": oldest,
        "lag": lag,
        "lag_text": describe_age(lag),
    }


def table_size(alias: str) -> dict[str, Any]:
    """The database's estimate from its statistics: None where it keeps none (SQLite), or
    before it first analyzed the table (PostgreSQL's autovacuum does after enough writes)."""
    estimate = database_store.estimated_rows(alias)
    return {
        "estimate": estimate,
        "estimate_text": None if estimate is None else f"{estimate:,}",
        "keeps_statistics": connections[alias].vendor in ("postgresql", "mysql"),
    }


def busiest_endpoints(alias: str, top: int = 10) -> Busiest:
    """The endpoints with the most records created in the last hour, by outcome: the newest
    ``RECENT_LIMIT`` records of the hour (``database.recent_outcomes``)."""
    groups = database_store.recent_outcomes(alias, WINDOW, RECENT_LIMIT)
    totals: Counter[str] = Counter()
    outcomes: Counter[tuple[str, str]] = Counter()
    for endpoint, state, status, count, _oldest in groups:
        totals[endpoint] += count
        outcomes[endpoint, _outcome(state, status)] += count
    counted = sum(totals.values())
    capped = counted >= RECENT_LIMIT
    return Busiest(
        rows=[
            EndpointRow(endpoint, total, [outcomes[endpoint, name] for name in OUTCOMES])
            for endpoint, total in sorted(totals.items(), key=lambda item: (-item[1], item[0]))[
                :top
            ]
        ],
        counted=counted,
        capped=capped,
        since=min(group[4] for group in groups) if capped and groups else None,
    )


def _outcome(state: str, status: int | None) -> str:
    if state == State.IN_PROGRESS or status is None:
        return "in progress"
    return f"{min(max(status // 100, 2), 5)}xx"


def _timed(panel: Panel, run: Callable[[], Any]) -> Panel:
    started = time.perf_counter()
    data = run()
    panel.seconds = time.perf_counter() - started
    panel.data = data if isinstance(data, dict) else {"value": data}
    return panel


def database_overview(
    records: QuerySet[IdempotencyRecord], store: Store, alias: str
) -> list[Panel]:
    """Every panel of a database store, each timed (the page shows how long each took)."""
    return [
        _timed(Panel("in_flight", "In flight"), lambda: in_flight(records)),
        _timed(Panel("lapsed", "Lapsed claims nobody took over"), lambda: lapsed(records)),
        _timed(
            Panel("purge_lag", "Expired records still present (purge lag)"),
            lambda: purge_lag(records, store, alias),
        ),
        _timed(Panel("table_size", "Table size (estimated)"), lambda: table_size(alias)),
        _timed(
            Panel("busiest", "Busiest endpoints of the last hour, by outcome"),
            lambda: busiest_endpoints(alias),
        ),
    ]


def heartbeat_overview() -> HeartbeatStatus:
    """What a store outside the database can show cheaply: this process's claims."""
    return process_heartbeat.status()
