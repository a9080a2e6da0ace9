"""The database store: records as rows of ``IdempotencyRecord``, and every query on them.

The unique index on ``(account, endpoint, key)`` is the lock. Besides the interface of
``base.Store`` this module holds the admin's conditional ``DELETE … RETURNING``
(``delete_returning``) and the purge's reads and deletes (``read_page``, ``delete_page``):
no other module sends SQL. The hot path (claim, read, complete, release, renew) is raw SQL
built once per database alias (``_Statements``), converted exactly as the ORM would; rare
paths stay on the ORM, with the ``Q`` definitions of ``base``. Leases and expiry are written
and compared on the database's clock (``DatabaseNow``), never an app server's. Why, and what
it measured: ``docs/performance.md`` ("How the hot path is built"); the clock and the
failures: ``docs/store.md``.
"""

from __future__ import annotations

import functools
import logging
import math
import sqlite3
import zoneinfo
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, ClassVar, Final, TypeVar

from django.conf import settings
from django.core.exceptions import EmptyResultSet
from django.db import (
    DatabaseError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    connections,
    transaction,
)
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import (
    Case,
    CharField,
    DateTimeField,
    Expression,
    F,
    Field,
    Q,
    QuerySet,
    When,
)
from django.utils import timezone

from idempotency_django.models import IdempotencyRecord
from idempotency_django.store.base import (
    CLAIMED,
    Bindable,
    ClaimOrRead,
    Completion,
    FailureKind,
    Record,
    Scope,
    Snapshot,
    Stored,
    Times,
    Write,
    expired_q,
    lapsed_q,
    never,
    shared,
    stored,
)

logger = logging.getLogger("idempotency_django")

State = IdempotencyRecord.State

# Error codes that mean "a concurrent transaction is in the way", not "the store is gone".
# PostgreSQL SQLSTATEs: serialization_failure, deadlock_detected, lock_not_available
# (lock_timeout). Not query_canceled (57014, statement_timeout): a statement that ran out of
# time may have waited on anything (a table lock, a slow disk), not on a duplicate of the
# key, so it is a store that cannot serve now ("other": 503), never "in flight".
_PG_CONTENTION = frozenset({"40001", "40P01", "55P03"})
# PostgreSQL: connection exceptions (class 08), admin/crash shutdown, cannot connect now.
# Not too_many_connections (53300): a server that is there but full (perhaps filled on
# purpose) must fail closed, never run views unprotected (_EXHAUSTED_WORDS below).
_PG_UNREACHABLE_PREFIXES = ("08", "57P01", "57P02", "57P03")
# MariaDB/MySQL: lock wait timeout, deadlock. Not max_statement_time (1969) or MySQL's
# max_execution_time (3024): a statement timeout, as PostgreSQL's 57014 above.
_MYSQL_CONTENTION = frozenset({1205, 1213})
# MariaDB/MySQL client errors: can't connect, server gone away, lost connection, and the
# server shutting down. Not "Too many connections" (1040), for the reason above.
_MYSQL_UNREACHABLE = frozenset({1053, 1927, 2002, 2003, 2005, 2006, 2013, 2055, 4031})


class DatabaseStore(Bindable):
    """Records as rows of ``IdempotencyRecord`` in a Django database: the database of its
    ``alias`` (``bind``)."""

    errors: ClassVar[tuple[type[BaseException], ...]] = (DatabaseError,)
    transactional: ClassVar[bool] = True
    needs_purge: ClassVar[bool] = True

    def _records(self, alias: str) -> Any:
        return IdempotencyRecord.objects.using(alias)

    def claim_or_read(self, write: Write) -> ClaimOrRead:
        """Claim the key, or read the record the claim lost to (``read``'s columns).

        PostgreSQL: one round trip, the insert and the read in one statement
        (``_pg_claim_or_read``). MariaDB/MySQL: the insert, then the read when it lost: two
        round trips for a loser, one for a winner. Nothing fewer is safe there: ``INSERT ...
        ON DUPLICATE KEY UPDATE`` takes an exclusive lock on the existing row (concurrent
        losers deadlock), ``INSERT IGNORE`` turns every error into a silent no-op, and
        sending the read with the insert needs multi-statement mode on the connection.
        SQLite has no ``INSERT`` in a CTE; it is a local file, where a round trip is a
        function call.
        """
        alias = self.alias
        statements = _statements(alias)
        values = _claim_values(write)
        if statements.claim_or_read is not None:
            return self._pg_claim_or_read(
                alias, statements, statements.claim_or_read, values, write.fingerprint
            )
        if self._claim(alias, values):
            return CLAIMED
        return self._read(alias, write.scope, write.fingerprint)

    def _pg_claim_or_read(
        self,
        alias: str,
        statements: _Statements,
        sql: str,
        values: dict[str, Any],
        fingerprint: str,
    ) -> ClaimOrRead:
        """``WITH ins AS (INSERT ... ON CONFLICT DO NOTHING RETURNING ...) SELECT ... FROM ins
        UNION ALL SELECT ... FROM <table> WHERE <key> AND NOT EXISTS (SELECT 1 FROM ins)``.

        The outer ``SELECT`` reads with the statement's snapshot, taken before the insert
        waited for a concurrent claim of the same key: a row committed by that claim after
        the snapshot conflicts with the insert but is invisible to the read, and the
        statement returns nothing. Then (only then) a second, plain read runs with a new
        snapshot; "nothing" is never taken for "absent".
        """
        connection = connections[alias]
        params = _claim_params(statements, values, connection)
        row = _execute(
            connection,
            sql,
            [
                *params,
                fingerprint,
                fingerprint,
                *_now_params(statements, connection),
                *_key(values),
            ],
            _fetchone,
        )
        if row is None:
            return self._read(alias, _scope(values), fingerprint)
        if row[0]:
            return CLAIMED
        return statements.snapshot(row[1:], connection)

    def claim(self, write: Write) -> bool:
        """Insert the record if its key is absent: True when this call inserted it.

        One statement, no read first: the unique index decides between any number of
        concurrent claims. On MariaDB/MySQL a plain ``INSERT`` whose duplicate-key error is
        caught (``INSERT IGNORE`` would also turn every other error into a silent no-op).
        """
        return self._claim(self.alias, _claim_values(write))

    def _claim(self, alias: str, values: dict[str, Any]) -> bool:
        connection = connections[alias]
        statements = _statements(alias)
        params = _claim_params(statements, values, connection)
        if connection.vendor == "mysql":
            try:
                with connection.cursor() as cursor:
                    cursor.execute(statements.claim, params)
            except IntegrityError as error:
                if _mysql_code(error) == 1062:  # ER_DUP_ENTRY: the key is taken
                    return False
                raise
            return True
        if connection.vendor in ("postgresql", "sqlite"):
            return _execute(connection, statements.claim, params, _rowcount) == 1
        try:  # pragma: no cover - other backends take the portable, slower path
            with transaction.atomic(using=alias):
                self._records(alias).create(**values)
        except IntegrityError:
            return False
        return True

    def read(self, scope: Scope, fingerprint: str) -> Snapshot | None:
        """The record of ``scope`` as a losing claim reads it (``_read``): for tests and tools."""
        return self._read(self.alias, scope, fingerprint)

    def _read(self, alias: str, scope: Scope, fingerprint: str) -> Snapshot | None:
        """The record a claim lost to, with its stored response only if it will be replayed
        (completed, same fingerprint): a 409 or 422 never loads a body.

        A plain read: under READ COMMITTED (Django's default on every backend) it sees the
        row the insert just lost to. A locking read would make concurrent losers, who all
        hold a shared lock from their insert's duplicate check, deadlock on MariaDB.
        """
        connection = connections[alias]
        statements = _statements(alias)
        row = _execute(
            connection,
            statements.read,
            [
                fingerprint,
                fingerprint,
                *_now_params(statements, connection),
                scope.account,
                scope.endpoint,
                scope.key,
            ],
            _fetchone,
        )
        return None if row is None else statements.snapshot(row, connection)

    def read_stored(self, pk: int) -> Stored | None:
        row = (
            self._records(self.alias)
            .filter(pk=pk, state=State.COMPLETED)
            .values_list("response_status", "response_headers", "response_body")
            .first()
        )
        return None if row is None else stored(*row)

    def take_over(self, record: Snapshot, write: Write) -> bool:
        """Claim a record that counts as absent, or whose lease lapsed, unless it changed.

        The conditions are re-checked in the ``UPDATE`` itself (the same definitions the
        purge uses), on the database's clock: a heartbeat that renewed the lease, or another
        request that took the row over first, makes it match nothing, whatever this app
        server's clock says. The new lease and expiry count from the database's now too.
        """
        alias = self.alias
        now: Any = write.created_at
        values: dict[str, Any] = {
            "fingerprint": write.fingerprint,
            "state": State.IN_PROGRESS,
            "token": write.token,
            "lease_expires_at": write.lease_expires_at,
            "response_status": None,
            "response_headers": [],
            "response_body": None,
            "created_at": now,
            "completed_at": None,
            "expires_at": write.expires_at,
        }
        if has_own_clock(connections[alias]):
            now = DatabaseNow()
            values.update(
                created_at=now,
                lease_expires_at=DatabaseNow(write.lease),
                expires_at=never() if write.ttl is None else DatabaseNow(write.ttl),
            )
        updated: int = (
            self._records(alias)
            .filter(expired_q(now) | lapsed_q(now), pk=record.pk, token=record.token)
            .update(**values)
        )
        return updated == 1

    def complete(self, scope: Scope, token: str, completion: Completion) -> bool:
        """Store the outcome, fenced by the claim's token and the in-progress state: a
        claim that was taken over matches nothing (``rowcount`` 0)."""
        alias = self.alias
        connection = connections[alias]
        values = {
            "response_status": completion.status,
            "response_headers": [list(pair) for pair in completion.headers],
            "response_body": completion.body,
            "completed_at": completion.completed_at,
            "expires_at": completion.expires_at,
        }
        statements = _statements(alias)
        params = _prepared(statements.complete_fields, values, connection)
        times = _time_params(statements, connection, values, "completed_at", completion.ttl)
        with transaction.mark_for_rollback_on_error(alias):
            updated = _execute(
                connection,
                statements.complete,
                [
                    State.COMPLETED.value,
                    *params,
                    *times,
                    scope.account,
                    scope.endpoint,
                    scope.key,
                    token,
                    State.IN_PROGRESS.value,
                ],
                _rowcount,
            )
        return updated == 1

    def is_completed(self, scope: Scope, token: str) -> bool:
        return bool(
            self._records(self.alias)
            .filter(token=token, state=State.COMPLETED, **scope.lookup())
            .exists()
        )

    def release(self, scope: Scope, token: str) -> int:
        """Delete the claim's record, fenced by its token and the in-progress state: one
        statement (the ORM's ``delete()`` wraps its ``DELETE`` in a transaction: two more
        round trips)."""
        alias = self.alias
        connection = connections[alias]
        with transaction.mark_for_rollback_on_error(alias):
            return _execute(
                connection,
                _statements(alias).release,
                [scope.account, scope.endpoint, scope.key, token],
                _rowcount,
            )

    def renew(self, claims: Sequence[tuple[Scope, str]], lease: float, timeout: float) -> int:
        """Push the lease of each in-progress ``(lookup, token)`` to ``lease`` seconds from
        the database's now, in one statement bounded by ``timeout`` (``_statement_timeout``);
        returns how many records were renewed. A record that was taken over (another
        token) or completed is left alone."""
        alias = self.alias
        connection = connections[alias]
        statements = _statements(alias)
        duration = timedelta(seconds=lease)
        with _statement_timeout(alias, timeout):
            # PostgreSQL counts each row's lease from the moment it is written, after any
            # wait for its lock (``clock_timestamp()``); SQLite from now, on this process's
            # clock, taken after any wait for the connection or the transaction.
            params = _clock_params(connection, duration, timezone.now() + duration)
            for scope, token in claims:
                params += [scope.account, scope.endpoint, scope.key, token]
            return _execute(connection, statements.renew_many(len(claims)), params, _rowcount)

    def lock_wait(self, seconds: float) -> AbstractContextManager[None]:
        """Bound how long the claim run inside waits for a row lock (``_lock_timeout``):
        in atomic mode a duplicate's insert waits on the first request's transaction."""
        return _lock_timeout(self.alias, seconds)

    def count_in_use(self, account: str, now: datetime, limit: int) -> int:
        """How many of ``account``'s records are in use (in progress under a live lease),
        counted no further than ``limit``. PostgreSQL and SQLite read the partial index of
        in-progress records (``idempotency_record_in_use``, migration 0005); MariaDB/MySQL,
        which have no partial indexes, the in-progress records of every account (the
        ``(state, lease_expires_at)`` index) or the account's records (the unique index),
        whichever the planner expects fewer of."""
        connection = connections[self.alias]
        fields = {field.name: field for field in IdempotencyRecord._meta.concrete_fields}
        column = {
            name: connection.ops.quote_name(str(field.column)) for name, field in fields.items()
        }
        qn = connection.ops.quote_name
        sql = (
            f"SELECT COUNT(*) FROM (SELECT 1 FROM {qn(IdempotencyRecord._meta.db_table)} "
            f"WHERE {column['account']} = %s "
            # A literal, not a parameter: a prepared statement's generic plan can use a
            # partial index only when its condition is written out.
            f"AND {column['state']} = '{State.IN_PROGRESS.value}' "
            # Live by the database's clock, as every lease is told.
            f"AND {column['lease_expires_at']} > {_clock_sql(connection.vendor, offset=False)} "
            "LIMIT %s) live"
        )
        now_params = _clock_params(connection, None, now)
        row = _execute(connection, sql, [account, *now_params, limit], _fetchone)
        return int(row[0])

    def oldest_expired(self) -> datetime | None:
        """The expiry of the oldest expired record still present, or ``None``: the first
        entry of the ``expires_at`` index past which a record is expired by the database's
        clock (an in-progress record under a live lease is in use, not expired, whatever
        its TTL says, and the purge keeps it). One short index walk, at any table size."""
        first: datetime | None = (
            self._records(self.alias)
            .filter(expired_q(DatabaseNow()))
            .order_by("expires_at")
            .values_list("expires_at", flat=True)
            .first()
        )
        return first

    def ping(self, timeout: float) -> None:
        """One round trip to the records table, bounded by ``timeout`` (``bounded_reads``):
        the health check's. Reads no row (a primary key no record has), but needs the
        connection, the server and the table: a database that is down, a table that was
        never migrated, a server that stalls are each a ``DatabaseError``."""
        with self.bounded_reads(timeout):
            self._records(self.alias).filter(pk=0).exists()

    def bounded_reads(self, timeout: float) -> AbstractContextManager[None]:
        """Bound the ``SELECT`` statements run inside to ``timeout`` seconds on the
        server, as the heartbeat bounds its renewals (``_statement_timeout``)."""
        return _statement_timeout(self.alias, timeout, verb="SELECT")

    def in_transaction(self) -> bool:
        return connections[self.alias].in_atomic_block

    def reset(self) -> None:
        """Drop the alias's connection, so that the next call opens a new one."""
        with suppress(DatabaseError):
            connections[self.alias].close()

    def usable(self) -> bool:
        """Whether the alias's connection still works; closes it when it does not."""
        connection = connections[self.alias]
        with suppress(Exception):
            if connection.connection is not None and connection.is_usable():
                return True
        with suppress(Exception):
            connection.close()
        return False

    def failure_kind(self, error: BaseException) -> FailureKind:
        """Tell "the store cannot be reached" from "a concurrent transaction is in the way".

        Only the first may fail open; contention is what a concurrent duplicate causes and
        must never let a second execution through.
        """
        return error_kind(error, connections[self.alias].vendor)

    # -- inspection (``base.Inspects``): tests and tools, never a request's path -------------

    def keeps_own_clock(self) -> bool:
        return has_own_clock(connections[self.alias])

    def remember_scopes(self) -> None:
        """Nothing to remember: a row keeps its scope."""

    def records(self) -> list[Record]:
        return [_record(row) for row in self._records(self.alias).all()]

    def put(self, record: Record, fields: Collection[str] | None = None) -> Record:
        names = [name for name in _RECORD_FIELDS if fields is None or name in fields]
        values = {name: getattr(record, name) for name in names}
        if record.pk is None:
            return _record(self._records(self.alias).create(**values))
        self._records(self.alias).filter(pk=record.pk).update(**values)
        return record

    def drop(self, record: Record) -> None:
        self._records(self.alias).filter(pk=record.pk).delete()

    def age(self, delta: timedelta) -> list[Any]:
        """Every time of every row ``delta`` earlier (but ``never()``): the database
        deletes nothing by itself."""
        self._records(self.alias).update(
            lease_expires_at=F("lease_expires_at") - delta,
            expires_at=Case(
                When(expires_at__gte=never(), then=F("expires_at")),
                default=F("expires_at") - delta,
            ),
            created_at=F("created_at") - delta,
            completed_at=F("completed_at") - delta,
        )
        return []

    def retime(self, pk: Any, times: Times) -> Times | None:
        rows = self._records(self.alias).filter(pk=pk)
        old = (
            rows.annotate(now=DatabaseNow()).values("lease_expires_at", "expires_at", "now").first()
        )
        if old is None:
            return None
        changes = {
            name: DatabaseNow(timedelta(milliseconds=ms))
            for name, ms in (("lease_expires_at", times.lease), ("expires_at", times.expires))
            if ms is not None
        }
        if changes:
            rows.update(**changes)

        def ms(when: datetime | None) -> int | None:
            if when is None or when >= never():
                return None
            now: datetime = old["now"]
            return round((when - now).total_seconds() * 1000)

        return Times(lease=ms(old["lease_expires_at"]), expires=ms(old["expires_at"]), pttl=None)


_RECORD_FIELDS = tuple(name for name in Record.__dataclass_fields__ if name != "pk")


def _record(row: IdempotencyRecord) -> Record:
    body = row.response_body
    return Record(
        pk=row.pk,
        account=row.account,
        endpoint=row.endpoint,
        key=row.key,
        state=row.state,
        token=row.token,
        fingerprint=row.fingerprint,
        lease_expires_at=row.lease_expires_at,
        expires_at=row.expires_at,
        response_status=row.response_status,
        response_headers=row.response_headers,
        response_body=None if body is None else bytes(body),
        created_at=row.created_at,
        completed_at=row.completed_at,
    )


def rolled_back(error: BaseException) -> bool:
    """Whether a Django database error, from any alias, says the database rolled back what
    raised it: a deadlock, a serialization failure, a lock timeout (the codes of the
    "contention" kind). Nothing of that statement committed, and its transaction is gone
    (PostgreSQL aborts it; MariaDB rolls it back on a deadlock, and Django's ``atomic``
    does on the way out after a lock timeout): the lifecycle's unknown-outcome rule
    (``decisions.outcome_unknown``) counts it as a known failure. The vendor is the
    driver's, told by the error itself: the work's database need not be the store's."""
    return error_kind(error, _vendor_of(error)) == "contention"


def _vendor_of(error: BaseException) -> str | None:
    module = type(error.__cause__).__module__ if error.__cause__ is not None else ""
    for prefix, vendor in _DRIVERS:
        if module.startswith(prefix):
            return vendor
    return None


# The modules of the drivers' exceptions, and the vendor (``connection.vendor``) of each.
_DRIVERS = (
    ("psycopg", "postgresql"),
    ("MySQLdb", "mysql"),
    ("pymysql", "mysql"),
    ("sqlite3", "sqlite"),
)


def error_kind(error: BaseException, vendor: str | None) -> FailureKind:
    """The failure kind of a Django database error on a database of ``vendor``: what
    ``DatabaseStore.failure_kind`` answers, and what ``rolled_back`` asks of any error."""
    if isinstance(error, InterfaceError):
        return "unreachable"
    if not isinstance(error, DatabaseError):
        return "other"
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
    if any(word in message for word in _EXHAUSTED_WORDS):
        return "other"
    if isinstance(error, OperationalError) and any(word in message for word in _UNREACHABLE_WORDS):
        return "unreachable"
    return "other"


# A server that refuses a new connection because it is full: PostgreSQL's 53300 ("sorry,
# too many clients already", "too many connections for role/database", "remaining
# connection slots are reserved"), which psycopg raises without a SQLSTATE on connect.
# (In English: a server with translated messages is told by its SQLSTATE only.)
_EXHAUSTED_WORDS = ("too many clients", "too many connections", "connection slots are reserved")

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


# -- the hot path's SQL ------------------------------------------------------------------------

_Converter = Callable[[Any, Any, Any], Any]

# What a loser reads, in ``Snapshot``'s order, then the replay's headers and body.
_READ_FIELDS = (
    "id",
    "state",
    "token",
    "fingerprint",
    "lease_expires_at",
    "expires_at",
    "response_status",
    "response_headers",
    "response_body",
)
# What a claim writes (``claims``): the rest of the row starts empty. Its times come last,
# from the database's clock (``_time_params``).
_CLAIM_FIELDS = frozenset(
    {
        "account",
        "endpoint",
        "key",
        "fingerprint",
        "state",
        "token",
        "response_headers",
    }
)
_CLAIM_TIMES = ("created_at", "lease_expires_at", "expires_at")
_COMPLETE_FIELDS = (
    "response_status",
    "response_headers",
    "response_body",
)
_COMPLETE_TIMES = ("completed_at", "expires_at")


def _cursor(connection: Any) -> Any:
    """A cursor for the hot path's statements: Django's, except on PostgreSQL when the
    connection may prepare statements (``OPTIONS["prepare_threshold"]`` set; Django leaves
    it unset so that transaction-mode poolers keep working).

    Django's psycopg cursor binds parameters on the client, which psycopg never prepares,
    so PostgreSQL plans every statement again: for the claim's ``INSERT`` with its read,
    planning costs more than running it (pgbench: 9,000 against 24,000 statements/s,
    ``benchmarks/RESULTS.md``). A server-side binding cursor on the same connection, in the
    same transaction, wrapped by Django as its own cursors are (error translation, execute
    wrappers), lets psycopg prepare the statements the hot path sends again and again. The
    ORM's own queries are left as they are.
    """
    if connection.vendor != "postgresql" or connection.queries_logged:
        # Logging queries (DEBUG, assertNumQueries): Django's cursor, whose log shows the
        # SQL with its parameters, where a prepared statement's would show None.
        return connection.cursor()
    connection.ensure_connection()
    raw = connection.connection
    if getattr(raw, "prepare_threshold", None) is None:
        return connection.cursor()
    connection.validate_thread_sharing()
    with connection.wrap_database_errors:
        cursor = _server_binding_cursor(connection, raw)
    return connection.make_cursor(cursor)


R = TypeVar("R")

# PostgreSQL SQLSTATEs of a prepared statement the server cannot use: feature_not_supported
# ("cached plan must not change result type": a column's type changed under it),
# invalid_sql_statement_name (it does not exist: a transaction-mode pooler sent it to
# another server connection) and duplicate_prepared_statement (that server connection
# already has one of that name: another client's).
_PREPARED_STATEMENT_ERRORS = frozenset({"0A000", "26000", "42P05"})


def _execute(connection: Any, sql: str, params: Sequence[Any], result: Callable[[Any], R]) -> R:
    """Run one statement of the hot path and read ``result`` off its cursor.

    A prepared statement that the server refuses (``_PREPARED_STATEMENT_ERRORS``) did not
    run, so it is sent once more, unprepared, on Django's own cursor, and this connection
    prepares nothing more (``_stop_preparing``): psycopg keeps the statement's name after
    such an error, so every later use would fail the same way. Retrying unprepared rather
    than deallocating works behind a transaction-mode pooler too, where a ``DEALLOCATE``
    may reach another server connection. This is what keeps a completion of work that
    committed from being lost. Inside a transaction nothing can be retried: PostgreSQL
    aborted it, and the error propagates (its work rolls back).
    """
    cursor = _cursor(connection)
    try:
        with cursor:
            cursor.execute(sql, params)
            return result(cursor)
    except DatabaseError as error:
        if not _prepared_statement_refused(connection, error):
            raise
        in_transaction = connection.in_atomic_block or not connection.get_autocommit()
        _stop_preparing(connection, error, sent_again=not in_transaction)
        if in_transaction:
            raise
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return result(cursor)


def _fetchone(cursor: Any) -> Any:
    return cursor.fetchone()


def _rowcount(cursor: Any) -> int:
    return int(cursor.rowcount)


def _prepared_statement_refused(connection: Any, error: DatabaseError) -> bool:
    return (
        connection.vendor == "postgresql"
        and getattr(error.__cause__, "sqlstate", None) in _PREPARED_STATEMENT_ERRORS
        and getattr(connection.connection, "prepare_threshold", None) is not None
    )


def _stop_preparing(connection: Any, error: DatabaseError, *, sent_again: bool) -> None:
    """Prepare nothing more on this connection (psycopg's ``prepare_threshold = None``): its
    next statements are sent unprepared until Django replaces it (``CONN_MAX_AGE``).

    The warning says what became of the statement: sent again unprepared, or, inside a
    transaction (a request transaction, the heartbeat's renewal), not sent again at all:
    PostgreSQL aborted that transaction, so the statement fails and its transaction rolls
    back."""
    connection.connection.prepare_threshold = None
    became = (
        "it is sent again unprepared"
        if sent_again
        else "it is not sent again: PostgreSQL aborted the transaction it ran in, which rolls back"
    )
    logger.warning(
        "PostgreSQL refused a prepared statement of the idempotency store (SQLSTATE %s: %s); "
        "%s, and this connection prepares nothing more. After a schema change this is "
        "expected once per connection; otherwise a transaction-mode pooler does not keep "
        "prepared statements (PgBouncer before 1.21, or max_prepared_statements = 0): leave "
        "OPTIONS prepare_threshold unset behind it.",
        getattr(error.__cause__, "sqlstate", None),
        error,
        became,
    )


def _server_binding_cursor(connection: Any, raw: Any) -> Any:
    """What Django's ``create_cursor`` builds with ``server_side_binding``, time zone
    included."""
    from django.db.backends.postgresql.base import ServerBindingCursor
    from psycopg.pq import Format

    cursor = ServerBindingCursor(raw)  # type: ignore[call-arg]  # psycopg's Cursor(conn)
    loader = raw.adapters.get_loader(TIMESTAMPTZ_OID, Format.TEXT)
    if connection.timezone != getattr(loader, "timezone", connection.timezone):
        from django.db.backends.postgresql.psycopg_any import register_tzloader

        register_tzloader(connection.timezone, cursor)
    return cursor


#: PostgreSQL's type oid of ``timestamp with time zone`` (the purge reads it too).
TIMESTAMPTZ_OID: Final = 1184


def _key(values: dict[str, Any]) -> tuple[str, str, str]:
    return values["account"], values["endpoint"], values["key"]


def _scope(values: dict[str, Any]) -> Scope:
    return Scope(values["account"], values["endpoint"], values["key"])


def _claim_values(write: Write) -> dict[str, Any]:
    """A claim's columns (``_CLAIM_FIELDS`` and ``_CLAIM_TIMES``)."""
    scope = write.scope
    return {
        "account": scope.account,
        "endpoint": scope.endpoint,
        "key": scope.key,
        "fingerprint": write.fingerprint,
        "state": State.IN_PROGRESS,
        "token": write.token,
        "lease_expires_at": write.lease_expires_at,
        "response_headers": [],
        "created_at": write.created_at,
        "expires_at": write.expires_at,
    }


def _claim_params(statements: _Statements, values: dict[str, Any], connection: Any) -> list[Any]:
    if len(values) != len(statements.claim_fields) + len(_CLAIM_TIMES):
        names = [f.name for f in statements.claim_fields] + list(_CLAIM_TIMES)
        raise ValueError(f"a claim sets {sorted(names)}")
    lease = values["lease_expires_at"] - values["created_at"]
    return [
        *_prepared(statements.claim_fields, values, connection),
        *_time_params(statements, connection, values, "created_at", _ttl(values), lease),
    ]


def _ttl(values: dict[str, Any], since: str = "created_at") -> timedelta | None:
    """The TTL of ``values`` (``expires_at`` less ``since``), or None for a record kept
    forever (``never()``): a duration, for the database's own clock."""
    expires: datetime = values["expires_at"]
    return None if expires >= never() else expires - values[since]


def _prepared(
    fields: Sequence[Field[Any, Any]], values: dict[str, Any], connection: Any
) -> list[Any]:
    """``values`` as the ORM would send them: each through its field's ``get_db_prep_save``
    (datetimes made naive for MariaDB, JSON adapted per backend), except a ``str`` for a
    ``CharField``, which that returns unchanged (most of a claim's ten values)."""
    return [
        value
        if type(value) is str and isinstance(field, CharField)
        else field.get_db_prep_save(value, connection)
        for field in fields
        for value in (values[field.name],)
    ]


# -- the database's clock ----------------------------------------------------------------------
#
# Every time the store writes or compares (a claim's or take-over's created_at, lease and
# expiry, a renewal's lease, a completion's completed_at and expiry, the "now" of the
# take-over, the purge and the admin) is the database's: app servers whose clocks disagree
# then agree on every lease. SQLite keeps the app's clock: one file, one machine, one clock.
# Why these functions, and what USE_TZ changes: docs/store.md ("Leases on the database's
# clock").

_OWN_CLOCK = ("postgresql", "mysql")
_ZERO = timedelta(0)
_MICROSECOND = timedelta(microseconds=1)


def has_own_clock(connection: BaseDatabaseWrapper) -> bool:
    """Whether the store's times are the database's clock (PostgreSQL, MariaDB/MySQL), or
    this process's (SQLite, and any other backend)."""
    return connection.vendor in _OWN_CLOCK


def _clock_sql(vendor: str, *, offset: bool = True, per_row: bool = False) -> str:
    """The database's now, plus a duration (``offset``), in SQL; ``_clock_params`` are its
    parameters.

    PostgreSQL: ``statement_timestamp()``, one now for every time a statement writes (a
    claim's lease and expiry count from its ``created_at`` exactly), and an index bound
    (a stable function: the purge and the admin scan by it); ``per_row``: the moment each
    row is written, after any wait for its lock (``clock_timestamp()``: the renewal).
    MariaDB/MySQL: ``UTC_TIMESTAMP(6)`` (the statement's start) moved into the zone Django
    stores naive datetimes in (``_utc_offset_us``). SQLite: a parameter, this process's now.
    """
    if vendor not in _OWN_CLOCK:
        return "%s"
    if vendor == "postgresql":
        now = "clock_timestamp()" if per_row else "statement_timestamp()"
        return f"({now} + %s::interval)" if offset else now
    return "TIMESTAMPADD(MICROSECOND, %s, UTC_TIMESTAMP(6))"


def _expiry_sql(vendor: str) -> str:
    """An expiry: the database's now plus a TTL, or ``never()`` for a TTL of None."""
    if vendor in _OWN_CLOCK:
        return f"COALESCE({_clock_sql(vendor)}, %s)"
    return "%s"


def _clock_params(connection: Any, delta: timedelta | None, app_time: datetime) -> list[Any]:
    """The parameters of ``_clock_sql``: ``delta`` after the database's now (None: the SQL
    built without ``offset``). ``app_time`` is the same moment on this process's clock,
    which SQLite is given instead."""
    vendor = connection.vendor
    if vendor not in _OWN_CLOCK:
        return [_datetime_field().get_db_prep_save(app_time, connection)]
    if vendor == "postgresql":
        return [] if delta is None else [delta]
    return [_utc_offset_us(connection) + (delta or _ZERO) // _MICROSECOND]


def _expiry_params(connection: Any, ttl: timedelta | None, app_time: datetime) -> list[Any]:
    """The parameters of ``_expiry_sql`` (``app_time``: the expiry on this process's clock,
    ``never()`` included, for SQLite)."""
    if connection.vendor not in _OWN_CLOCK:
        return [_datetime_field().get_db_prep_save(app_time, connection)]
    forever = _datetime_field().get_db_prep_save(never(), connection)
    return [None if ttl is None else _clock_params(connection, ttl, app_time)[0], forever]


def _time_params(
    statements: _Statements,
    connection: Any,
    values: dict[str, Any],
    since: str,
    ttl: timedelta | None,
    lease: timedelta | None = None,
) -> list[Any]:
    """The parameters of the times a claim (``since="created_at"``: ``_CLAIM_TIMES``) or a
    completion (``"completed_at"``: ``_COMPLETE_TIMES``) writes: only the durations of the
    engine's ``values`` count where the database keeps the clock."""
    if not statements.own_clock:
        prepare = _datetime_field().get_db_prep_save
        names = _CLAIM_TIMES if since == "created_at" else _COMPLETE_TIMES
        return [prepare(values[name], connection) for name in names]
    start = values[since]
    params = _clock_params(connection, _ZERO, start)
    if since == "created_at":
        params += _clock_params(connection, lease, values["lease_expires_at"])
    return params + _expiry_params(connection, ttl, values["expires_at"])


def _now_params(statements: _Statements, connection: Any) -> list[Any]:
    """The parameters of the database's now that ``read`` selects (none on SQLite)."""
    if not statements.own_clock:
        return []
    return _clock_params(connection, None, timezone.now())


def _utc_offset_us(connection: Any) -> int:
    """MariaDB/MySQL: what to add to ``UTC_TIMESTAMP(6)``, in microseconds, for the naive
    time Django stores there: the connection's time zone (UTC under ``USE_TZ`` unless the
    database's ``TIME_ZONE`` says otherwise; ``TIME_ZONE``'s local time without it).

    An offset, not ``CONVERT_TZ``: that needs the server's time zone tables, and gives NULL
    without them. The offset is the zone's now on this process's clock: a clock skew moves
    it only across a daylight-saving change, when naive local times are ambiguous anyway.
    """
    name = connection.timezone_name
    if name == "UTC":
        return 0
    now = datetime.now(zoneinfo.ZoneInfo(name)) if name else datetime.now().astimezone()
    return (now.utcoffset() or _ZERO) // _MICROSECOND


def _datetime_field() -> Field[Any, Any]:
    """A datetime column of the records: how a time is prepared for the database."""
    return IdempotencyRecord._meta.get_field("created_at")


class DatabaseNow(Expression):
    """The database's now plus ``offset``, in the ORM's queries (the take-over, the purge,
    the admin): the clock ``_clock_sql`` writes leases with. On SQLite, this process's now,
    taken when the query is compiled."""

    output_field = DateTimeField()

    def __init__(self, offset: timedelta = _ZERO) -> None:
        super().__init__(output_field=DateTimeField())
        self.offset = offset

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, tuple[Any, ...]]:
        bare = connection.vendor == "postgresql" and has_own_clock(connection) and not self.offset
        sql = _clock_sql(connection.vendor, offset=not bare)
        delta = None if bare else self.offset
        return sql, tuple(_clock_params(connection, delta, timezone.now() + self.offset))


@dataclass(frozen=True)
class _Statements:
    """The hot path's statements for one database alias, built once (``_statements``)."""

    table: str
    where_key: str  # "account = %s AND endpoint = %s AND key = %s", quoted
    own_clock: bool  # the times are the database's (``has_own_clock``)
    claim_fields: tuple[Field[Any, Any], ...]  # then ``_CLAIM_TIMES``
    claim: str
    claim_or_read: str | None  # PostgreSQL only
    read: str  # its columns: ``_READ_FIELDS``, then the database's now (``own_clock``)
    converters: tuple[tuple[tuple[_Converter, ...], Any], ...]  # per read column
    complete_fields: tuple[Field[Any, Any], ...]  # then ``_COMPLETE_TIMES``
    complete: str
    release: str
    renew: str  # for one claim; ``renew_many`` repeats its last condition
    renew_owned: str

    def snapshot(self, row: Sequence[Any], connection: Any) -> Snapshot:
        """The record read, its times moved onto this process's clock by the difference
        between its now and the database's now read in the same statement (as the Redis
        store does with ``TIME``): the engine compares them with ``timezone.now()``."""
        values = list(row)
        for index, (converters, expression) in enumerate(self.converters):
            for convert in converters:
                values[index] = convert(values[index], expression, connection)
        pk, state, token, fingerprint, lease_expires_at, expires_at, status, headers, body = values[
            : len(_READ_FIELDS)
        ]
        if self.own_clock:
            shift = timezone.now() - values[-1]
            if lease_expires_at is not None:
                lease_expires_at += shift
            if expires_at < never():
                expires_at += shift
        return Snapshot(
            pk=pk,
            state=state,
            token=token,
            fingerprint=fingerprint,
            lease_expires_at=lease_expires_at,
            expires_at=expires_at,
            response_status=status,
            stored=None if headers is None else stored(status, headers, body),
        )

    def renew_many(self, count: int) -> str:
        return self.renew + " OR ".join([self.renew_owned] * count) + ")"


_CACHE: dict[tuple[str, str, bool], _Statements] = {}


def _statements(alias: str) -> _Statements:
    """The statements for ``alias``, built on first use. ``USE_TZ`` is part of the key: the
    converters of datetime columns depend on it (MariaDB and SQLite return naive values
    that are made aware only under ``USE_TZ``)."""
    connection = connections[alias]
    key = (alias, connection.vendor, bool(settings.USE_TZ))
    cached = _CACHE.get(key)
    if cached is None:
        cached = _CACHE[key] = _build(connection)
    return cached


def _build(connection: Any) -> _Statements:
    meta = IdempotencyRecord._meta
    qn = connection.ops.quote_name
    table = qn(meta.db_table)
    fields = {field.name: field for field in meta.concrete_fields}
    column = {name: qn(field.column) for name, field in fields.items()}
    where_key = " AND ".join(f"{column[name]} = %s" for name in ("account", "endpoint", "key"))
    claim_fields = tuple(field for field in meta.concrete_fields if field.name in _CLAIM_FIELDS)
    now, expiry = _clock_sql(connection.vendor), _expiry_sql(connection.vendor)
    insert = (
        f"INSERT INTO {table} "
        f"({', '.join([column[f.name] for f in claim_fields] + [column[n] for n in _CLAIM_TIMES])})"
        f" VALUES ({', '.join(['%s'] * len(claim_fields))}, {now}, {now}, {expiry})"
    )
    # The replay's headers and body only for a completed record of the same request.
    replayable = f"{column['state']} = '{State.COMPLETED.value}' AND {column['fingerprint']} = %s"
    selected = [column[name] for name in _READ_FIELDS[:-2]] + [
        f"CASE WHEN {replayable} THEN {column['response_headers']} END",
        f"CASE WHEN {replayable} THEN {column['response_body']} END",
    ]
    own_clock = has_own_clock(connection)
    if own_clock:
        selected.append(_clock_sql(connection.vendor, offset=False))
    read = f"SELECT {', '.join(selected)} FROM {table} WHERE {where_key}"
    claim_or_read = None
    if connection.vendor == "postgresql":
        nulls = ", ".join(["NULL"] * len(selected))
        claim_or_read = (
            f"WITH ins AS ({insert} ON CONFLICT DO NOTHING RETURNING 1) "
            f"SELECT true, {nulls} FROM ins "
            f"UNION ALL SELECT false, {', '.join(selected)} FROM {table} "
            f"WHERE {where_key} AND NOT EXISTS (SELECT 1 FROM ins)"
        )
    converters = []
    for name in _READ_FIELDS:
        expression = fields[name].get_col(meta.db_table)
        found = connection.ops.get_db_converters(expression) + expression.get_db_converters(
            connection
        )
        converters.append((tuple(found), expression))
    if own_clock:  # the database's now, a datetime as the lease is
        converters.append(converters[_READ_FIELDS.index("lease_expires_at")])
    complete_fields = tuple(fields[name] for name in _COMPLETE_FIELDS)
    assignments = ", ".join(f"{column[f.name]} = %s" for f in complete_fields)
    complete = (
        f"UPDATE {table} SET {column['state']} = %s, "
        f"{column['lease_expires_at']} = NULL, {assignments}, "
        f"{column['completed_at']} = {now}, {column['expires_at']} = {expiry} "
        f"WHERE {where_key} AND {column['token']} = %s AND {column['state']} = %s"
    )
    renewed = _clock_sql(connection.vendor, per_row=True)
    return _Statements(
        table=table,
        where_key=where_key,
        own_clock=own_clock,
        claim_fields=claim_fields,
        claim=insert if connection.vendor == "mysql" else f"{insert} ON CONFLICT DO NOTHING",
        claim_or_read=claim_or_read,
        read=read,
        converters=tuple(converters),
        complete_fields=complete_fields,
        complete=complete,
        # Fenced by the token and the state: a completed record is never deleted by a late
        # release (one resent after its first reply was lost).
        release=(
            f"DELETE FROM {table} WHERE {where_key} AND {column['token']} = %s "
            f"AND {column['state']} = '{State.IN_PROGRESS.value}'"
        ),
        renew=(
            f"UPDATE {table} SET {column['lease_expires_at']} = {renewed} "
            f"WHERE {column['state']} = '{State.IN_PROGRESS.value}' AND ("
        ),
        renew_owned=f"({where_key} AND {column['token']} = %s)",
    )


# The largest statement timeouts the servers take: PostgreSQL's statement_timeout (an int of
# milliseconds) and MariaDB's max_statement_time (a year).
_PG_MAX_TIMEOUT_MS = 2**31 - 1
_MARIADB_MAX_STATEMENT_TIME = 31_536_000


@contextmanager
def _statement_timeout(alias: str, seconds: float, verb: str = "UPDATE") -> Iterator[None]:
    """Bound the statements run inside to ``seconds``, lock waits included (the heartbeat's
    renewal: one locked row must not hold every other lease past its expiry; the health
    check's reads, ``verb="SELECT"``).

    PostgreSQL: ``statement_timeout`` set for one short transaction (``set_config(…, true)``
    is ``SET LOCAL`` with a parameter). MariaDB: ``SET STATEMENT max_statement_time=… FOR``
    in front of each statement, which also ends a wait for a row lock. MySQL and SQLite
    have no such bound for an ``UPDATE``; SQLite has no row locks to wait for, only its own
    ``timeout`` for the database lock.
    """
    connection = connections[alias]
    if connection.vendor == "postgresql":
        with transaction.atomic(using=alias), connection.cursor() as cursor:
            milliseconds = max(1, math.ceil(seconds * 1000))
            # statement_timeout is an int of milliseconds: a beat of a lease over 74 days
            # would be refused ("outside the valid range"), and every renewal with it.
            milliseconds = min(milliseconds, _PG_MAX_TIMEOUT_MS)
            cursor.execute("SELECT set_config('statement_timeout', %s, true)", [str(milliseconds)])
            yield
    elif connection.vendor == "mysql" and connection.mysql_is_mariadb:  # type: ignore[attr-defined]
        bound = min(max(seconds, 0.001), _MARIADB_MAX_STATEMENT_TIME)
        prefix = f"SET STATEMENT max_statement_time={bound:.3f} FOR "

        def bounded(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
            # Only the renewal (or the health check's reads): not what Django runs to set
            # up a new connection.
            if sql.lstrip()[: len(verb)].upper() == verb:
                sql = prefix + sql
            return execute(sql, params, many, context)

        with connection.execute_wrapper(bounded):
            yield
    else:
        yield


# PostgreSQL: the transaction's lock_timeout as it was (read first: the CTE is evaluated
# before the row that calls set_config), then the new one for this transaction only.
_PG_SET_LOCK_TIMEOUT = (
    "WITH previous AS MATERIALIZED (SELECT current_setting('lock_timeout') AS value) "
    "SELECT value, set_config('lock_timeout', %s, true) FROM previous"
)


@contextmanager
def _lock_timeout(alias: str, seconds: float) -> Iterator[None]:
    """Bound the row-lock waits of the statements run inside to ``seconds``, then give the
    connection its own bound back: the view's statements after the claim wait as they
    always did. For a claim inside a transaction (atomic mode), where a duplicate's insert
    waits on the first request's uncommitted row.

    PostgreSQL: ``lock_timeout`` for the transaction (``set_config(…, true)``, ``SET
    LOCAL``), put back after the claim; a claim that failed aborted the transaction, which
    is rolled back with the setting. MariaDB: ``SET STATEMENT innodb_lock_wait_timeout=…
    FOR`` in front of the claim's ``INSERT``. MySQL: the session's
    ``innodb_lock_wait_timeout``, put back after. Both count whole seconds (rounded up).
    SQLite has no row locks: its ``timeout`` bounds the wait for the database lock.
    """
    connection = connections[alias]
    whole_seconds = max(0, math.ceil(seconds))
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(_PG_SET_LOCK_TIMEOUT, [str(max(1, math.ceil(seconds * 1000)))])
            previous = cursor.fetchone()[0]
        yield
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config('lock_timeout', %s, true)", [previous])
    elif connection.vendor == "mysql" and _set_statement(connection):
        prefix = f"SET STATEMENT innodb_lock_wait_timeout={whole_seconds} FOR "

        def bounded(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
            if sql.lstrip()[:6].upper() == "INSERT":  # the claim, not its read
                sql = prefix + sql
            return execute(sql, params, many, context)

        with connection.execute_wrapper(bounded):
            yield
    elif connection.vendor == "mysql":
        with connection.cursor() as cursor:
            cursor.execute(
                "SET @idempotency_lock_wait = @@SESSION.innodb_lock_wait_timeout, "
                "SESSION innodb_lock_wait_timeout = %s",
                [whole_seconds],
            )
        try:
            yield
        finally:
            # A session setting outlives the transaction: always put back (a connection
            # that cannot take it any more is broken, and dropped by Django).
            with suppress(DatabaseError), connection.cursor() as cursor:
                cursor.execute("SET SESSION innodb_lock_wait_timeout = @idempotency_lock_wait")
    else:
        yield


def _set_statement(connection: Any) -> bool:
    """Whether the server takes ``SET STATEMENT … FOR`` (MariaDB; MySQL does not)."""
    return bool(connection.mysql_is_mariadb)


# -- the admin's and the purge's statements -------------------------------------------------


def delete_returning(queryset: QuerySet[IdempotencyRecord]) -> list[IdempotencyRecord]:
    """Delete ``queryset``'s records in one conditional ``DELETE``; return what it deleted.

    The statement is the queryset's own ``WHERE``, so every condition in it is checked by
    the database on the row as it is when deleted, never on a copy read earlier. The
    deleted rows come back through ``RETURNING`` (PostgreSQL, SQLite 3.35+, MariaDB
    10.5+), as unsaved records holding the primary key and the scope: what the admin
    history, the log and the ``released`` signal need. MySQL has no ``DELETE …
    RETURNING``: there the rows are locked (``SELECT … FOR UPDATE``) and deleted in one
    transaction, so nothing can change them in between.
    """
    alias = queryset.db
    connection = connections[alias]
    opts = IdempotencyRecord._meta
    query = queryset.query
    try:
        where, params = query.get_compiler(alias).compile(query.where)
    except EmptyResultSet:  # e.g. pk__in=[]: nothing can match
        return []
    quote = connection.ops.quote_name
    column = {field.name: str(field.column) for field in opts.concrete_fields}
    names = ("id", "account", "endpoint", "key")
    columns = ", ".join(quote(column[name]) for name in names)
    delete = f"DELETE FROM {quote(opts.db_table)} WHERE {where}"
    if deletes_returning(connection):
        with connection.cursor() as cursor:
            cursor.execute(f"{delete} RETURNING {columns}", params)
            rows = list(cursor.fetchall())
    else:
        with transaction.atomic(using=alias):
            rows = list(queryset.select_for_update().order_by("pk").values_list(*names))
            if rows:
                pk = quote(column["id"])
                marks = ", ".join(["%s"] * len(rows))
                with connection.cursor() as cursor:
                    cursor.execute(
                        f"{delete} AND {pk} IN ({marks})", [*params, *(row[0] for row in rows)]
                    )
    return [
        IdempotencyRecord(pk=pk, account=account, endpoint=endpoint, key=key)
        for pk, account, endpoint, key in rows
    ]


def deletes_returning(connection: BaseDatabaseWrapper) -> bool:
    """Whether the database can answer a ``DELETE`` with the rows it deleted."""
    if connection.vendor == "mysql":
        return bool(connection.mysql_is_mariadb)  # type: ignore[attr-defined]
    if connection.vendor == "sqlite":
        return sqlite3.sqlite_version_info >= (3, 35)
    return connection.vendor == "postgresql"


def read_page(alias: str, page: QuerySet[Any]) -> tuple[list[int], tuple[datetime, int] | None]:
    """A page's primary keys, and the keyset cursor after it (None for an empty page): the
    last row's ``(order value, pk)``, read in the same statement (the same snapshot) as the
    page.

    PostgreSQL: the order column arrives unparsed and only the last row's value is loaded,
    by the loader the ORM would have used. Parsing every row's timestamp was most of the
    purge's own CPU (a third of it, profiled), taken from the claims it shares the machine
    with. MariaDB/MySQL: the rows are read as the driver returns them and the ORM's
    converters (making each timestamp aware) run on the last row only: they were 1.6 ms of
    a 999-row page's 3.8 ms (measured at 10M records), in a batch whose time sets the
    purge's pauses."""
    connection = connections[alias]
    if connection.vendor == "mysql":
        compiler = page.query.get_compiler(alias)
        try:
            sql, params = compiler.as_sql()
        except EmptyResultSet:  # e.g. a selection of no records: nothing can match
            return [], None
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            raw: Sequence[tuple[Any, ...]] = cursor.fetchall()
        if not raw:
            return [], None
        converters = compiler.get_converters([column for column, _, _ in compiler.select])
        last = (
            next(iter(compiler.apply_converters(raw[-1:], converters))) if converters else raw[-1]
        )
        return [row[0] for row in raw], (last[1], last[0])
    if connection.vendor != "postgresql" or not hasattr(connection.connection, "adapters"):
        rows: list[tuple[int, datetime]] = list(page)
        return [pk for pk, _ in rows], (rows[-1][1], rows[-1][0]) if rows else None
    from psycopg.pq import Format

    sql, params = page.query.get_compiler(alias).as_sql()
    with connection.cursor() as cursor:
        cursor.cursor.adapters.register_loader(TIMESTAMPTZ_OID, _unparsed())
        cursor.execute(sql, params)
        raw_rows = cursor.fetchall()
    if not raw_rows:
        return [], None
    adapters = connection.connection.adapters
    loader = adapters.get_loader(TIMESTAMPTZ_OID, Format.TEXT)(TIMESTAMPTZ_OID, adapters)
    last_pk, last_order = raw_rows[-1]
    return [pk for pk, _ in raw_rows], (loader.load(last_order), last_pk)


@functools.cache
def _unparsed() -> type:
    """A psycopg loader that keeps a column's text as PostgreSQL sent it (built on first use:
    psycopg is imported only where PostgreSQL is used)."""
    from psycopg.adapt import Loader

    class Unparsed(Loader):
        def load(self, data: Any) -> bytes:
            return bytes(data)

    return Unparsed


def delete_page(alias: str, pks: list[int], condition: Q) -> int:
    """One short ``DELETE`` by primary key that re-checks ``condition`` on every row."""
    connection = connections[alias]
    if connection.vendor == "postgresql":
        # The batch's keys as one array parameter: building and parsing ``IN (%s, …)`` with
        # hundreds of placeholders was most of the purge's time (3-4x slower, measured).
        matching = IdempotencyRecord.objects.using(alias).filter(condition).query
        where, params = matching.get_compiler(alias).compile(matching.where)
        table = connection.ops.quote_name(IdempotencyRecord._meta.db_table)
        pk = connection.ops.quote_name("id")
        with connection.cursor() as cursor:
            cursor.execute(
                f"DELETE FROM {table} WHERE {table}.{pk} = ANY(%s::bigint[]) AND ({where})",
                # An array literal built here: psycopg's quoting of a list of ints, item by
                # item, cost as much as the rest of the batch.
                ["{" + ",".join(map(str, map(int, pks))) + "}", *params],
            )
            return int(cursor.rowcount)
    if connection.vendor != "mysql":
        records: QuerySet[IdempotencyRecord] = IdempotencyRecord.objects.using(alias).filter(
            condition, pk__in=pks
        )
        # ``_raw_delete``: one statement, whatever receivers of Django's delete signals exist.
        # ``QuerySet.delete()`` would turn into a read and an unconditional delete by pk when
        # someone listens to pre_delete/post_delete, losing the re-check.
        return records._raw_delete(alias)
    # MySQL/MariaDB plan ``id IN (…)`` on a table they think small as a full scan, and in
    # InnoDB a scanning DELETE waits for every row another transaction holds (a claim's
    # uncommitted insert) while it holds the rows it already deleted: claims of those keys
    # then wait for it, or deadlock with it. Pin the primary key.
    # The keys as integer literals, as PostgreSQL's path sends them as one array: resolving
    # and escaping a parameter per key was about a seventh of the purge's time on MariaDB
    # (profiled at 10M records, 999 keys a batch: 0.29 s of 1.9 s for 10,000 rows).
    matching = IdempotencyRecord.objects.using(alias).filter(condition).query
    where, params = matching.get_compiler(alias).compile(matching.where)
    table = connection.ops.quote_name(IdempotencyRecord._meta.db_table)
    pk = connection.ops.quote_name("id")
    keys = ",".join(map(str, map(int, pks)))
    with connection.cursor() as cursor:
        cursor.execute(
            f"DELETE {table} FROM {table} FORCE INDEX (PRIMARY) "
            f"WHERE {table}.{pk} IN ({keys}) AND ({where})",
            params,
        )
        return int(cursor.rowcount)


store = DatabaseStore()
shared(store)  # the one instance get_store() answers for this class


# The admin's statements that depend on the database vendor.


def estimated_rows(alias: str) -> int | None:
    """The database's own estimate of the records table's size (from its statistics, so
    free and roughly right), or None where it keeps none (SQLite)."""
    connection = connections[alias]
    table = IdempotencyRecord._meta.db_table
    if connection.vendor == "postgresql":
        sql, params = "SELECT reltuples FROM pg_class WHERE oid = %s::regclass", [table]
    elif connection.vendor == "mysql":
        sql = (
            "SELECT table_rows FROM information_schema.tables "
            "WHERE table_schema = DATABASE() AND table_name = %s"
        )
        params = [table]
    else:
        return None
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    return None if row is None or row[0] is None or row[0] < 0 else int(row[0])


def recent_outcomes(
    alias: str, window: timedelta, limit: int
) -> list[tuple[str, str, int | None, int, datetime]]:
    """The newest ``limit`` records created within ``window`` of the database's now, counted
    by ``(endpoint, state, response_status)``, with the oldest ``created_at`` of each group:
    the admin overview's busiest endpoints. One statement: a backward walk of the
    ``created_at`` index stopped at ``limit`` (migration 0006), grouped on the server, so
    that ten thousand rows never cross the wire (their conversion by the ORM alone took
    more than the page's budget, measured at 10M records)."""
    connection = connections[alias]
    qn = connection.ops.quote_name
    column = {f.name: qn(str(f.column)) for f in IdempotencyRecord._meta.concrete_fields}
    names = ", ".join(column[name] for name in ("endpoint", "state", "response_status"))
    since = _clock_sql(connection.vendor)
    sql = (
        f"SELECT {names}, COUNT(*), MIN({column['created_at']}) FROM ("
        f"SELECT {names}, {column['created_at']} "
        f"FROM {qn(IdempotencyRecord._meta.db_table)} WHERE {column['created_at']} >= {since} "
        f"ORDER BY {column['created_at']} DESC LIMIT %s) recent "
        f"GROUP BY {names}"
    )
    params = [*_clock_params(connection, -window, timezone.now() - window), limit]
    created = _datetime_field()
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    converters = created.get_db_converters(connection) + connection.ops.get_db_converters(
        created.get_col(IdempotencyRecord._meta.db_table)
    )

    def moment(value: Any) -> datetime:
        for convert in converters:
            value = convert(value, created, connection)
        result: datetime = value
        return result

    return [
        (str(endpoint), str(state), status, int(count), moment(oldest))
        for endpoint, state, status, count, oldest in rows
    ]


def key_prefix_q(prefix: str, alias: str) -> Q:
    """Keys that start with ``prefix``, case-sensitively, in a form the key index serves.
    PostgreSQL's index has pattern ops for ``LIKE``. Elsewhere a range, which the binary
    collation orders by code point (the bound is the last one): MariaDB/MySQL read the
    whole table for ``LIKE BINARY 'prefix%'`` OR-ed with the other terms, and SQLite's
    ``LIKE`` ignores case."""
    if connections[alias].vendor == "postgresql":
        return Q(key__startswith=prefix)
    return Q(key__gte=prefix, key__lt=prefix + "\U0010ffff")


def delete_account(alias: str, account: str, keep_endpoints: Q) -> int:
    """Delete every record of ``account`` but those ``keep_endpoints`` matches (a task's
    scope may be any string): one statement on the unique index's leading column. For a
    principal that is gone for good (``accounts.forget_account``), whatever the records'
    state: nobody can claim in that account again but a new holder of the same name."""
    deleted, _ = (
        IdempotencyRecord.objects.using(alias).filter(account=account).exclude(keep_endpoints)
    ).delete()
    return deleted
