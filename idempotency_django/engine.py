"""Claim, replay, complete and release keys in the ``IdempotencyRecord`` store.

This module knows nothing of HTTP: the decorator (and any other adapter) turns a request
into a ``Scope`` and a fingerprint, calls ``begin`` and then ``complete`` or ``release``.

The claim is one ``INSERT … ON CONFLICT DO NOTHING`` (``INSERT IGNORE`` on MariaDB/MySQL):
whoever inserts the row owns the key, and the unique index decides between concurrent
inserts in any number of processes. Only a loser reads the row, so a first request costs
one statement to claim and one to complete, and a replay, conflict or mismatch costs two.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any, TypeVar

from django.db import (
    DatabaseError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    connections,
    router,
    transaction,
)
from django.db.models import Q
from django.utils import timezone

from idempotency_django import signals
from idempotency_django.conf import conf
from idempotency_django.exceptions import InFlight, KeyMismatch, ResponseNotStored
from idempotency_django.models import IdempotencyRecord
from idempotency_django.responses import StoredResponse
from idempotency_django.signals import emit

logger = logging.getLogger("idempotency_django")

State = IdempotencyRecord.State

# How often one request retries when the row it lost to changes under it (released, or
# taken over by another request, between its read and its write). Past this, the
# caller is told to retry later rather than spin.
MAX_RACES = 5


@dataclass(frozen=True)
class Scope:
    account: str
    endpoint: str
    key: str

    def lookup(self) -> dict[str, str]:
        return {"account": self.account, "endpoint": self.endpoint, "key": self.key}


@dataclass(frozen=True)
class Options:
    alias: str
    lease: float
    ttl: float | None  # None: keep records forever
    in_flight: str
    wait_seconds: float
    retry_after: int


@dataclass(frozen=True)
class Claim:
    scope: Scope
    token: str
    alias: str


T = TypeVar("T")


def reconnecting(alias: str, operation: Callable[[], T]) -> T:
    """Run a store operation, and once more on a fresh connection if the first one broke.

    A connection lost between requests (the server restarted, a pooler or an operator
    dropped it) costs one reconnect instead of a 503 or an unstored outcome. Every store
    operation can run twice: the claim is an insert-if-absent, the others are fenced by the
    claim's token. Inside a transaction nothing can be retried: the error propagates.
    """
    try:
        return operation()
    except (OperationalError, InterfaceError):
        connection = connections[alias]
        if connection.in_atomic_block:
            raise
        logger.warning("Idempotency store connection failed; retrying once on a new one.")
        with contextlib.suppress(DatabaseError):
            connection.close()
        return operation()


# The expiry of records kept forever (TTL_SECONDS = None): a date every backend can store.
NEVER = datetime(9999, 12, 31, tzinfo=dt_timezone.utc)


def expiry(now: datetime, ttl: float | None) -> datetime:
    return NEVER if ttl is None else now + timedelta(seconds=ttl)


def store_alias() -> str:
    return conf.DATABASE or router.db_for_write(IdempotencyRecord)


def _records(alias: str) -> Any:
    return IdempotencyRecord.objects.using(alias)


def new_token() -> str:
    return uuid.uuid4().hex


def begin(
    scope: Scope, fingerprint: str, options: Options, token: str | None = None
) -> Claim | StoredResponse:
    """Claim ``scope`` for this request, or return the stored outcome of an earlier one.

    Raises ``KeyMismatch`` when the key belongs to a different request, ``InFlight`` when
    its first request is still running (after waiting, under the ``wait`` policy) and
    ``ResponseNotStored`` when it completed without a storable response.

    Give the same ``token`` when calling again for the same request (after a lost
    connection): a claim whose commit the first call never heard of is then recognised as
    this request's own, not reported as a duplicate in flight.
    """
    token = token or new_token()
    deadline = time.monotonic() + (options.wait_seconds if options.in_flight == "wait" else 0)
    delay = 0.05
    races = 0
    reported_in_flight = False
    while True:
        now = timezone.now()
        if _insert(scope, fingerprint, token, now, options):
            emit(signals.claimed, logging.DEBUG, "Idempotency key claimed.", **scope.lookup())
            return Claim(scope, token, options.alias)
        record = _read(scope, options.alias)
        if record is None:
            races = _count_race(races, options)
            continue
        if record.token == token and record.state == State.IN_PROGRESS:
            return Claim(scope, token, options.alias)  # ours: its commit was not acknowledged
        expired = record.expires_at <= now
        lapsed = record.state == State.IN_PROGRESS and (
            record.lease_expires_at is None or record.lease_expires_at <= now
        )
        if expired or (lapsed and record.fingerprint == fingerprint):
            claim = _take_over(record, scope, fingerprint, token, now, options)
            if claim is not None:
                if expired:
                    emit(signals.claimed, logging.DEBUG, "Expired key claimed.", **scope.lookup())
                else:
                    emit(
                        signals.lease_taken_over,
                        logging.WARNING,
                        "Idempotency lease lapsed; the key was taken over by a retry.",
                        **scope.lookup(),
                    )
                return claim
            races = _count_race(races, options)
            continue
        if record.fingerprint != fingerprint:
            emit(
                signals.mismatch,
                logging.INFO,
                "Idempotency key reused with a different request.",
                **scope.lookup(),
            )
            raise KeyMismatch("This Idempotency-Key was already used with a different request.")
        if record.state == State.COMPLETED:
            return _stored(record, scope)
        if not reported_in_flight:
            emit(
                signals.in_flight,
                logging.INFO,
                "Duplicate of a request still in flight.",
                **scope.lookup(),
            )
            reported_in_flight = True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise InFlight(
                "A request with this Idempotency-Key is still being processed.",
                retry_after=options.retry_after,
            )
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.5)


def _count_race(races: int, options: Options) -> int:
    if races >= MAX_RACES:
        raise InFlight(
            "The record for this Idempotency-Key is changing under heavy contention.",
            retry_after=options.retry_after,
        )
    return races + 1


def complete(claim: Claim, outcome: StoredResponse, *, body_stored: bool = True) -> bool:
    """Store the outcome for ``claim``: fenced, so it never overwrites a newer claim.

    Returns False (and logs an error) when the claim was lost: its lease lapsed and another
    request took the key over, which now owns the record.
    """
    updated = (
        _records(claim.alias)
        .filter(token=claim.token, state=State.IN_PROGRESS, **claim.scope.lookup())
        .update(
            state=State.COMPLETED,
            response_status=outcome.status,
            response_headers=[list(pair) for pair in outcome.headers],
            response_body=outcome.body if body_stored else None,
            completed_at=timezone.now(),
            lease_expires_at=None,
        )
    )
    if updated:
        return True
    retried = (
        _records(claim.alias)
        .filter(token=claim.token, state=State.COMPLETED, **claim.scope.lookup())
        .exists()
    )
    if retried:
        return True  # a retried completion whose first attempt committed unacknowledged
    emit(
        signals.completion_lost,
        logging.ERROR,
        "Idempotency claim lost before completion: the view ran, but its lease lapsed and "
        "another request took the key over; the outcome was not stored.",
        status=outcome.status,
        **claim.scope.lookup(),
    )
    return False


def release(claim: Claim) -> None:
    """Delete the claim's record so that the next retry runs the view."""
    _records(claim.alias).filter(token=claim.token, **claim.scope.lookup()).delete()
    emit(signals.released, logging.INFO, "Idempotency key released.", **claim.scope.lookup())


def _insert(scope: Scope, fingerprint: str, token: str, now: Any, options: Options) -> bool:
    values = {
        **scope.lookup(),
        "fingerprint": fingerprint,
        "state": State.IN_PROGRESS,
        "token": token,
        "lease_expires_at": now + timedelta(seconds=options.lease),
        "response_headers": [],
        "created_at": now,
        "expires_at": expiry(now, options.ttl),
    }
    connection = connections[options.alias]
    if connection.vendor == "mysql":
        verb, suffix = "INSERT IGNORE INTO", ""
    elif connection.vendor in ("postgresql", "sqlite"):
        verb, suffix = "INSERT INTO", " ON CONFLICT DO NOTHING"
    else:  # pragma: no cover - other backends take the portable, slower path
        try:
            with transaction.atomic(using=options.alias):
                _records(options.alias).create(**values)
        except IntegrityError:
            return False
        return True
    meta = IdempotencyRecord._meta
    fields = [field for field in meta.concrete_fields if field.name in values]
    columns = ", ".join(connection.ops.quote_name(str(field.column)) for field in fields)
    placeholders = ", ".join(["%s"] * len(fields))
    params = [field.get_db_prep_save(values[field.name], connection) for field in fields]
    table = connection.ops.quote_name(meta.db_table)
    sql = f"{verb} {table} ({columns}) VALUES ({placeholders}){suffix}"
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return bool(cursor.rowcount == 1)


def _read(scope: Scope, alias: str) -> IdempotencyRecord | None:
    # A plain read: under READ COMMITTED (Django's default on every backend) it sees the
    # row the insert just lost to. A locking read would make concurrent losers, who all
    # hold a shared lock from their insert's duplicate check, deadlock on MariaDB.
    return _records(alias).filter(**scope.lookup()).first()  # type: ignore[no-any-return]


def _take_over(
    record: IdempotencyRecord,
    scope: Scope,
    fingerprint: str,
    token: str,
    now: Any,
    options: Options,
) -> Claim | None:
    """Claim a row that is expired or whose lease lapsed, unless someone else got there first.

    The conditions are re-checked in the ``UPDATE`` itself: a heartbeat that renewed the
    lease, or another request that took the row over, makes it match nothing.
    """
    still_takeable = (
        Q(expires_at__lte=now)
        | Q(state=State.IN_PROGRESS, lease_expires_at__lte=now)
        | Q(state=State.IN_PROGRESS, lease_expires_at__isnull=True)
    )
    updated = (
        _records(options.alias)
        .filter(still_takeable, pk=record.pk, token=record.token)
        .update(
            fingerprint=fingerprint,
            state=State.IN_PROGRESS,
            token=token,
            lease_expires_at=now + timedelta(seconds=options.lease),
            response_status=None,
            response_headers=[],
            response_body=None,
            created_at=now,
            completed_at=None,
            expires_at=expiry(now, options.ttl),
        )
    )
    if not updated:
        return None
    return Claim(scope, token, options.alias)


def _stored(record: IdempotencyRecord, scope: Scope) -> StoredResponse:
    assert record.response_status is not None
    if record.response_body is None:
        raise ResponseNotStored(
            f"The first request with this Idempotency-Key completed with status "
            f"{record.response_status}, but its response was not stored "
            "(it was streamed or larger than MAX_RESPONSE_BYTES)."
        )
    emit(
        signals.replayed,
        logging.DEBUG,
        "Idempotency key replayed.",
        status=record.response_status,
        **scope.lookup(),
    )
    return StoredResponse(
        status=record.response_status,
        body=bytes(record.response_body),
        headers=[(str(name), str(value)) for name, value in record.response_headers],
    )
