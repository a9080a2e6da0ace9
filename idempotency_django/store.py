"""The record store: the only module that knows how records are kept.

The lifecycle (``lifecycle.py``) and the engine's decision table (``engine.py``) talk to a
store through the small interface below (claim, read, take over, complete, release,
insert a completed record, and tell what kind of failure an error is), so that a second
store (Redis) can sit behind the same calls. ``DatabaseStore`` keeps records as rows of
``IdempotencyRecord``; the unique index on ``(account, endpoint, key)`` is the lock.

It also holds the one definition of which records are *in use* and which count as
*absent* (expired), shared by the engine's take-over and by the purge: an in-progress
record with a live lease is in use whatever its TTL says, and is never taken over or
deleted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any, Literal, Protocol

from django.conf import settings
from django.db import (
    DatabaseError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    connections,
    transaction,
)
from django.db.models import BinaryField, Case, F, Q, When

from idempotency_django.models import IdempotencyRecord

State = IdempotencyRecord.State

FailureKind = Literal["unreachable", "contention", "other"]


def never() -> datetime:
    """The expiry of records kept forever (``TTL_SECONDS = None``): a date every backend can
    store, naive when the project runs with ``USE_TZ = False`` (MariaDB and SQLite reject
    an aware datetime there)."""
    value = datetime(9999, 12, 31, tzinfo=dt_timezone.utc)
    return value if settings.USE_TZ else value.replace(tzinfo=None)


def expiry(now: datetime, ttl: float | None) -> datetime:
    return never() if ttl is None else now + timedelta(seconds=ttl)


# -- the one definition of "in use" and "absent" ----------------------------------------------


def in_use_q(now: datetime) -> Q:
    """In progress under a live lease: its view may be running right now."""
    return Q(state=State.IN_PROGRESS, lease_expires_at__gt=now)


def expired_q(now: datetime, expired_by: datetime | None = None) -> Q:
    """Past its TTL and not in use: the key counts as absent, and the purge may delete it.

    ``expired_by``: only records that expired by then (the purge's ``--older-than``).
    """
    return Q(expires_at__lte=now if expired_by is None else expired_by) & ~in_use_q(now)


def lapsed_q(now: datetime) -> Q:
    """In progress with a lease that nobody renews any more: its worker died or lost the
    store. The same request may take it over; a different one is told 422."""
    return Q(state=State.IN_PROGRESS) & (
        Q(lease_expires_at__lte=now) | Q(lease_expires_at__isnull=True)
    )


def is_in_use(record: Snapshot, now: datetime) -> bool:
    return record.state == State.IN_PROGRESS and (
        record.lease_expires_at is not None and record.lease_expires_at > now
    )


def is_expired(record: Snapshot, now: datetime) -> bool:
    return record.expires_at <= now and not is_in_use(record, now)


def is_lapsed(record: Snapshot, now: datetime) -> bool:
    return record.state == State.IN_PROGRESS and not is_in_use(record, now)


@dataclass(frozen=True)
class Snapshot:
    """What a loser reads of the record it lost to: never the body unless it replays."""

    pk: int
    state: str
    token: str
    fingerprint: str
    lease_expires_at: datetime | None
    expires_at: datetime
    response_status: int | None
    stored: Stored | None = None  # loaded only when it will be replayed


_SNAPSHOT_FIELDS = (
    "pk",
    "state",
    "token",
    "fingerprint",
    "lease_expires_at",
    "expires_at",
    "response_status",
)


@dataclass(frozen=True)
class Stored:
    status: int
    headers: list[tuple[str, str]]
    body: bytes | None  # None: completed without a storable body (streamed or too large)


def _stored(status: Any, headers: Any, body: Any) -> Stored:
    if isinstance(headers, str):  # a JSON column that a CASE turned into text (MariaDB)
        headers = json.loads(headers)
    return Stored(
        status=int(status),
        headers=[(str(name), str(value)) for name, value in headers],
        body=None if body is None else bytes(body),
    )


class Store(Protocol):
    """What the engine and the lifecycle need of a store."""

    def claim(self, alias: str, values: dict[str, Any]) -> bool: ...
    def read(self, alias: str, lookup: dict[str, str], fingerprint: str) -> Snapshot | None: ...
    def read_stored(self, alias: str, pk: int) -> Stored | None: ...
    def take_over(self, alias: str, record: Snapshot, values: dict[str, Any]) -> bool: ...
    def complete(
        self, alias: str, lookup: dict[str, str], token: str, values: dict[str, Any]
    ) -> bool: ...
    def is_completed(self, alias: str, lookup: dict[str, str], token: str) -> bool: ...
    def release(self, alias: str, lookup: dict[str, str], token: str) -> int: ...
    def failure_kind(self, alias: str, error: BaseException) -> FailureKind: ...


# Error codes that mean "a concurrent transaction is in the way", not "the store is gone".
# PostgreSQL SQLSTATEs: serialization_failure, deadlock_detected, lock_not_available,
# query_canceled (statement_timeout).
_PG_CONTENTION = frozenset({"40001", "40P01", "55P03", "57014"})
# PostgreSQL: connection exceptions (class 08), admin/crash shutdown, cannot connect now,
# too many connections.
_PG_UNREACHABLE_PREFIXES = ("08", "57P01", "57P02", "57P03", "53300")
# MariaDB/MySQL: lock wait timeout, deadlock, max_statement_time / max_execution_time.
_MYSQL_CONTENTION = frozenset({1205, 1213, 1969, 3024})
# MariaDB/MySQL client errors: can't connect, server gone away, lost connection, too many
# connections, and the server shutting down.
_MYSQL_UNREACHABLE = frozenset({1040, 1053, 1927, 2002, 2003, 2005, 2006, 2013, 2055, 4031})


class DatabaseStore:
    """Records as rows of ``IdempotencyRecord`` in a Django database."""

    def _records(self, alias: str) -> Any:
        return IdempotencyRecord.objects.using(alias)

    def claim(self, alias: str, values: dict[str, Any]) -> bool:
        """Insert the record if its key is absent: True when this call inserted it.

        One statement, no read first: the unique index decides between any number of
        concurrent claims. On MariaDB/MySQL a plain ``INSERT`` whose duplicate-key error is
        caught (``INSERT IGNORE`` would also turn every other error into a silent no-op).
        """
        connection = connections[alias]
        meta = IdempotencyRecord._meta
        fields = [field for field in meta.concrete_fields if field.name in values]
        columns = ", ".join(connection.ops.quote_name(str(field.column)) for field in fields)
        placeholders = ", ".join(["%s"] * len(fields))
        params = [field.get_db_prep_save(values[field.name], connection) for field in fields]
        table = connection.ops.quote_name(meta.db_table)
        sql = f"INSERT INTO {table} ({columns}) VALUES ({placeholders})"
        if connection.vendor == "mysql":
            try:
                with connection.cursor() as cursor:
                    cursor.execute(sql, params)
            except IntegrityError as error:
                if _mysql_code(error) == 1062:  # ER_DUP_ENTRY: the key is taken
                    return False
                raise
            return True
        if connection.vendor in ("postgresql", "sqlite"):
            with connection.cursor() as cursor:
                cursor.execute(sql + " ON CONFLICT DO NOTHING", params)
                return bool(cursor.rowcount == 1)
        try:  # pragma: no cover - other backends take the portable, slower path
            with transaction.atomic(using=alias):
                self._records(alias).create(**values)
        except IntegrityError:
            return False
        return True

    def read(self, alias: str, lookup: dict[str, str], fingerprint: str) -> Snapshot | None:
        """The record a claim lost to, with its stored response only if it will be replayed
        (completed, same fingerprint): a 409 or 422 never loads a body.

        A plain read: under READ COMMITTED (Django's default on every backend) it sees the
        row the insert just lost to. A locking read would make concurrent losers, who all
        hold a shared lock from their insert's duplicate check, deadlock on MariaDB.
        """
        replayable = Q(state=State.COMPLETED, fingerprint=fingerprint)
        row = (
            self._records(alias)
            .filter(**lookup)
            .annotate(
                replay_headers=Case(When(replayable, then=F("response_headers"))),
                replay_body=Case(
                    When(replayable, then=F("response_body")), output_field=BinaryField()
                ),
            )
            .values_list(*_SNAPSHOT_FIELDS, "replay_headers", "replay_body")
            .first()
        )
        if row is None:
            return None
        pk, state, token, fingerprint, lease_expires_at, expires_at, status, headers, body = row
        return Snapshot(
            pk=pk,
            state=state,
            token=token,
            fingerprint=fingerprint,
            lease_expires_at=lease_expires_at,
            expires_at=expires_at,
            response_status=status,
            stored=None if headers is None else _stored(status, headers, body),
        )

    def read_stored(self, alias: str, pk: int) -> Stored | None:
        row = (
            self._records(alias)
            .filter(pk=pk, state=State.COMPLETED)
            .values_list("response_status", "response_headers", "response_body")
            .first()
        )
        return None if row is None else _stored(*row)

    def take_over(self, alias: str, record: Snapshot, values: dict[str, Any]) -> bool:
        """Claim a record that counts as absent, or whose lease lapsed, unless it changed.

        The conditions are re-checked in the ``UPDATE`` itself (the same definitions the
        purge uses): a heartbeat that renewed the lease, or another request that took the
        row over first, makes it match nothing.
        """
        now = values["created_at"]
        updated: int = (
            self._records(alias)
            .filter(expired_q(now) | lapsed_q(now), pk=record.pk, token=record.token)
            .update(**values)
        )
        return updated == 1

    def complete(
        self, alias: str, lookup: dict[str, str], token: str, values: dict[str, Any]
    ) -> bool:
        updated: int = (
            self._records(alias)
            .filter(token=token, state=State.IN_PROGRESS, **lookup)
            .update(state=State.COMPLETED, lease_expires_at=None, **values)
        )
        return updated == 1

    def is_completed(self, alias: str, lookup: dict[str, str], token: str) -> bool:
        return bool(
            self._records(alias).filter(token=token, state=State.COMPLETED, **lookup).exists()
        )

    def release(self, alias: str, lookup: dict[str, str], token: str) -> int:
        deleted, _ = self._records(alias).filter(token=token, **lookup).delete()
        return int(deleted)

    def failure_kind(self, alias: str, error: BaseException) -> FailureKind:
        """Tell "the store cannot be reached" from "a concurrent transaction is in the way".

        Only the first may fail open; contention is what a concurrent duplicate causes and
        must never let a second execution through.
        """
        if isinstance(error, InterfaceError):
            return "unreachable"
        if not isinstance(error, DatabaseError):
            return "other"
        vendor = connections[alias].vendor
        cause = error.__cause__ or error
        if vendor == "postgresql":
            sqlstate = getattr(cause, "sqlstate", None)
            if sqlstate in _PG_CONTENTION:
                return "contention"
            if sqlstate is not None:
                return "unreachable" if sqlstate.startswith(_PG_UNREACHABLE_PREFIXES) else "other"
        elif vendor == "mysql":
            code = _mysql_code(error)
            if code in _MYSQL_CONTENTION:
                return "contention"
            if code is not None:
                return "unreachable" if code in _MYSQL_UNREACHABLE else "other"
        elif vendor == "sqlite":
            message = str(error).lower()
            if "locked" in message or "busy" in message:
                return "contention"
        # No code to go by (psycopg raises refused and closed connections without a
        # SQLSTATE): a connection-level failure is told by its message.
        message = str(error).lower()
        if isinstance(error, OperationalError) and any(
            word in message for word in _UNREACHABLE_WORDS
        ):
            return "unreachable"
        return "other"


_UNREACHABLE_WORDS = (
    "connection",
    "connect to",
    "server closed",
    "gone away",
    "unable to open",
    "terminating",
)


def _mysql_code(error: BaseException) -> int | None:
    for candidate in (error, error.__cause__):
        args = getattr(candidate, "args", ())
        if args and isinstance(args[0], int):
            return args[0]
    return None


store: Store = DatabaseStore()
