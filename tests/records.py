"""Seed, read, count, expire and lapse records through the store the suite runs on.

Every helper goes through the store's inspection interface (``store.base.Inspects``): the
database store reads and writes its rows, the Redis store its keys in its own value
format, on Redis's clock. A store that keeps only a digest of a record's scope (Redis)
names the records of the scopes this process used (``remember_scopes``); a record written
by another process reads with ``account``/``endpoint``/``key`` of None.

A test that fakes the time (``age``, ``retime``) moves the records instead wherever the
store keeps its own clock (``ON_STORE_CLOCK``): Redis, PostgreSQL and MariaDB.
"""

from __future__ import annotations

from dataclasses import fields, replace
from datetime import datetime, timedelta
from typing import Any

from django.db import connection
from django.utils import timezone

from idempotency_django.models import IdempotencyRecord
from idempotency_django.store import never
from idempotency_django.store.base import Inspects, Record, Times, get_store
from idempotency_django.store.database import DatabaseStore

__all__ = ["ON_STORE_CLOCK", "Record", "Times"]

State = IdempotencyRecord.State


def _store() -> Inspects:
    """The store the suite runs on (``IDEMPOTENCY["STORE"]``, as each test sets it)."""
    store = get_store()
    assert isinstance(store, Inspects), f"{type(store).__name__} cannot be inspected"
    store.remember_scopes()
    return store


def keeps_own_clock() -> bool:
    """The store's leases and expiry run on its own clock (Redis's, the database's), which a
    test cannot move; SQLite runs on this process's (``django.utils.timezone.now``)."""
    return _store().keeps_own_clock()


#: Whether the suite's store keeps its own clock: every store but the database store on
#: SQLite. Told from the suite's settings, not asked of the store (``keeps_own_clock``), so
#: that a store that wrongly keeps the app's clock fails the tests that this gates
#: (tests/test_clock_skew.py) instead of skipping them.
ON_STORE_CLOCK = not (connection.vendor == "sqlite" and isinstance(get_store(), DatabaseStore))

FIELDS = [f.name for f in fields(Record)]


def _matches(record: Record, filters: dict[str, Any]) -> bool:
    return not [name for name, value in filters.items() if getattr(record, name) != value]


def age(delta: timedelta) -> list[Any]:
    """Every record as the store would hold it ``delta`` later: its times that much
    earlier. On the Redis store, the keys that Redis would have expired by then are
    deleted, and returned; the database expires nothing by itself."""
    assert keeps_own_clock()
    return _store().age(delta)


def retime(key: Any, times: Times) -> Times | None:
    """Sets the record ``key``'s lease, expiry and (Redis) PTTL to ``times`` from now by the
    store's clock (a ``None`` lease or expiry is left as it is; a ``None`` PTTL: none), and
    returns the times it had (None: no such record). A test that ages records gives back,
    this way, the real time its own steps took on the store's clock."""
    assert keeps_own_clock()
    return _store().retime(key, times)


def lasts(when: datetime | None, since: datetime | None, seconds: float) -> bool:
    """``when`` is exactly ``seconds`` after ``since`` (a record's ``created_at`` or
    ``completed_at``); on a store that keeps neither (Redis), ``seconds`` from now (less
    the few the test took)."""
    assert when is not None
    if since is not None:
        return when - since == timedelta(seconds=seconds)
    left = (when - timezone.now()).total_seconds()
    return seconds - 5 < left <= seconds


# -- what tests call -------------------------------------------------------------------------


def all(**filters: Any) -> list[Record]:
    return [r for r in _store().records() if _matches(r, filters)]


def get(**filters: Any) -> Record:
    """The one record (that matches ``filters``): fails if there are none or several."""
    matching = all(**filters)
    assert len(matching) == 1, f"expected one record, found {len(matching)}"
    return matching[0]


def count(**filters: Any) -> int:
    return len(all(**filters))


def exists(**filters: Any) -> bool:
    return count(**filters) > 0


def values(*names: str, **filters: Any) -> list[tuple[Any, ...]]:
    return [tuple(getattr(r, name) for name in names) for r in all(**filters)]


def create(**values: Any) -> Record:
    """Seeds a record (``account``, ``endpoint``, ``key``, ``fingerprint``, ``token``, times,
    and the state and response fields of a completed one)."""
    given = {name: values[name] for name in FIELDS if name in values}
    assert len(given) == len(values), f"not a record's fields: {set(values) - set(given)}"
    body = given.get("response_body")
    record = Record(
        **{
            "pk": None,
            "state": State.IN_PROGRESS,
            "lease_expires_at": None,
            "expires_at": never(),
            "response_status": None,
            "response_headers": None,
            "response_body": None,
            **given,
            **({} if body is None else {"response_body": bytes(body)}),
        }
    )
    return _store().put(record, given.keys())


def update(filters: dict[str, Any] | None = None, **changes: Any) -> int:
    """Changes every record (matching ``filters``): ``expires_at`` to expire one,
    ``lease_expires_at`` to lapse one, ``state``, ``token``, … Returns how many."""
    store = _store()
    found = all(**(filters or {}))
    for record in found:
        store.put(replace(record, **changes), changes.keys())
    return len(found)


def delete(**filters: Any) -> int:
    store = _store()
    found = all(**filters)
    for record in found:
        store.drop(record)
    return len(found)
