"""Delete expired records, in small batches, while traffic flows.

Records past their TTL already count as absent (a claim takes them over); purging only
bounds the table. ``purge_records`` is the one implementation behind the
``purge_idempotency_keys`` command, the admin's "delete expired" action and any scheduled
task of your own (Celery beat, …). It stays out of the claims' way: keyset-paginated
batches whose ``DELETE`` re-checks its conditions, nothing held between batches, and a pace
(``Pacing``) that leaves the database to the claims. The long story, with the measurements:
``docs/operations.md`` ("Purging old keys").
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.db.models import Q, QuerySet
from django.dispatch import Signal

from idempotency_django.conf import MAX_DURATION_SECONDS, conf, problem
from idempotency_django.core import claims
from idempotency_django.models import IdempotencyRecord
from idempotency_django.store.base import expired_q
from idempotency_django.store.database import DatabaseNow
from idempotency_django.store.database import delete_page as _delete
from idempotency_django.store.database import read_page as _read_page

logger = logging.getLogger("idempotency_django")

State = IdempotencyRecord.State

#: Sent after every purge that was not a dry run, with ``sender=IdempotencyRecord`` and the
#: keyword arguments ``expired`` and ``stale`` (how many records of each kind were deleted)
#: and ``using`` (the database alias).
purged = Signal()

# Parameters of the DELETE besides its primary keys: the re-checked conditions.
_RECHECK_PARAMS = 8
# MariaDB turns an ``IN`` list of 1000 values or more into a join with a table of values
# (``in_predicate_conversion_threshold``), which the DELETE then plans as a table scan.
_MYSQL_MAX_IN_LIST = 999

#: The share of the time a paced purge may spend running batches: after a batch that took
#: ``t`` seconds it pauses at least ``t * (1 - share) / share`` (as long as the batch, at
#: one half), so a purge slowed down by a busy database backs off in proportion.
DEFAULT_BUSY_SHARE = 0.5

_UNITS = {"w": 7 * 86400, "d": 86400, "h": 3600, "m": 60, "s": 1}
_PART = re.compile(r"(\d+)([wdhms])")
_DURATION = re.compile(r"(?:\d+[wdhms])+")
#: The longest ``older_than`` or ``stale_after``: the settings' bound (100 years).
MAX_AGE = timedelta(seconds=MAX_DURATION_SECONDS)


@dataclass(frozen=True)
class PurgeResult:
    """What a purge deleted (or, in a dry run, would delete)."""

    expired: int = 0
    stale: int = 0
    batches: int = 0
    dry_run: bool = False
    #: True when ``limit`` stopped the purge: more records may be left to purge.
    limit_reached: bool = False
    #: How long the purge took in all, and how much of it was pacing's pauses (seconds).
    seconds: float = field(default=0.0, compare=False)
    paused: float = field(default=0.0, compare=False)

    @property
    def total(self) -> int:
        return self.expired + self.stale

    @property
    def rate(self) -> float:
        """Rows (deleted, or counted in a dry run) per second of the whole purge, pauses
        included: what the purge achieved."""
        return self.total / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The counts as a plain dict (what a Celery task would return)."""
        return {**asdict(self), "total": self.total, "rate": self.rate}


@dataclass(frozen=True)
class Pacing:
    """How a purge keeps out of the way of live claims: after each batch, a pause.

    - ``rate``: at most this many rows per second (``0``: no ceiling);
    - ``busy_share``: the purge runs batches at most this share of the time (``1``: no
      back-off), so a batch slowed down by a busy database is followed by a longer pause.

    A pause is the longer of the two. ``clock`` and ``sleep`` are what it times and waits
    with (tests pass their own; ``sleep=None`` is this module's ``_sleep``).
    """

    rate: float = 0
    busy_share: float = DEFAULT_BUSY_SHARE
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] | None = None

    def __post_init__(self) -> None:
        if not (self.rate >= 0):  # also refuses NaN
            raise ValueError(f"rate must be zero (no ceiling) or more, not {self.rate}")
        if not (0 < self.busy_share <= 1):
            raise ValueError(f"busy_share must be more than 0 and at most 1, not {self.busy_share}")

    @classmethod
    def flat_out(cls) -> Pacing:
        """No pauses at all: the purge takes what the database gives it."""
        return cls(rate=0, busy_share=1)

    @classmethod
    def from_settings(cls) -> Pacing:
        """The default: ``PURGE_RATE`` and ``DEFAULT_BUSY_SHARE``."""
        return cls(rate=float(_setting("PURGE_RATE")))

    @property
    def paces(self) -> bool:
        return self.rate > 0 or self.busy_share < 1

    def pause(self, rows: int, took: float) -> float:
        """How long to wait after a batch of ``rows`` rows that took ``took`` seconds."""
        by_rate = rows / self.rate - took if self.rate > 0 else 0.0
        by_share = took * (1 - self.busy_share) / self.busy_share
        return max(0.0, by_rate, by_share)

    def describe(self) -> str:
        """For people: ``"at most 25,000 rows/s, busy at most 50% of the time"``."""
        if not self.paces:
            return "not paced"
        parts = [f"at most {self.rate:,.0f} rows/s"] if self.rate > 0 else []
        if self.busy_share < 1:
            parts.append(f"busy at most {self.busy_share:.0%} of the time")
        return ", ".join(parts)


def batch_size_setting() -> int:
    return int(_setting("PURGE_BATCH_SIZE"))


def rate_setting() -> float:
    return float(_setting("PURGE_RATE"))


def stale_after_setting() -> timedelta:
    return timedelta(seconds=_setting("STALE_IN_PROGRESS_SECONDS"))


def _setting(name: str) -> Any:
    value = conf.get(name)
    wrong = problem(name, value)
    if wrong is not None or (name == "PURGE_BATCH_SIZE" and not isinstance(value, int)):
        raise ImproperlyConfigured(
            f"IDEMPOTENCY {name} is {value!r}: {wrong or 'expected an integer'}."
        )
    return value


def purge_records(
    *,
    older_than: timedelta = timedelta(0),
    stale_after: timedelta | None = None,
    include_stale: bool = True,
    batch_size: int | None = None,
    limit: int | None = None,
    dry_run: bool = False,
    using: str | None = None,
    queryset: QuerySet[IdempotencyRecord] | None = None,
    progress: Callable[[PurgeResult], None] | None = None,
    pacing: Pacing | None = None,
) -> PurgeResult:
    """Delete expired records (and stale in-progress ones) in batches; return the counts.

    - ``older_than``: only records that expired at least this long ago.
    - ``stale_after``: in-progress records whose lease lapsed at least this long ago are
      deleted too (default: the ``STALE_IN_PROGRESS_SECONDS`` setting); ``include_stale=False``
      leaves them alone.
    - ``batch_size``: rows per ``DELETE`` (default: the ``PURGE_BATCH_SIZE`` setting; at most
      999 on MariaDB/MySQL and about as many on SQLite, whatever is asked).
    - ``limit``: stop after this many records in all (expired ones first).
    - ``dry_run``: count what would be deleted; delete nothing.
    - ``using``: the database alias (default: the store's).
    - ``queryset``: only consider these records (the admin passes its selection).
    - ``progress``: called after every batch with the counts so far.
    - ``pacing``: the pauses between batches (default: ``Pacing.from_settings()``, at most
      ``PURGE_RATE`` rows a second and busy half the time; ``Pacing.flat_out()``: none).

    The result's ``seconds`` and ``rate`` say how long it took and the rate it achieved.
    """
    if older_than < timedelta(0):
        raise ValueError(f"older_than must not be negative, not {older_than}")
    if stale_after is None:
        stale_after = stale_after_setting()
    if stale_after < timedelta(0):
        raise ValueError(f"stale_after must not be negative, not {stale_after}")
    for name, age in (("older_than", older_than), ("stale_after", stale_after)):
        if age > MAX_AGE:  # now minus more than 2000 years is not a date
            raise ValueError(f"{name} must be at most 100 years, not {age}")
    if batch_size is None:
        batch_size = batch_size_setting()
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, not {batch_size}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive integer, not {limit}")
    if pacing is None:
        pacing = Pacing.from_settings()
    alias = using or claims.store_alias()
    connection = connections[alias]
    max_params = connection.features.max_query_params
    if max_params is not None:  # SQLite: at most 999 parameters in one statement
        batch_size = min(batch_size, max_params - _RECHECK_PARAMS)
    if connection.vendor == "mysql":
        batch_size = min(batch_size, _MYSQL_MAX_IN_LIST)
    if connection.in_atomic_block and not dry_run:
        logger.warning(
            "Idempotency purge inside an open transaction on %r: its batches cannot commit "
            "one by one, so their row locks are held until that transaction ends.",
            alias,
        )

    # The database's clock, which wrote the leases and expiries, read by every statement
    # (each ``DELETE`` re-checks on it): never this process's, which may run ahead.
    now = DatabaseNow()
    cutoff = DatabaseNow(-older_than)
    base = (queryset if queryset is not None else IdempotencyRecord.objects.all()).using(alias)
    # The claims' own definition: a view still running under its claim is never deleted,
    # even past its TTL.
    expired = expired_q(now, expired_by=cutoff)
    stale = Q(
        state=State.IN_PROGRESS,
        lease_expires_at__lt=DatabaseNow(-stale_after),
        # Disjoint from ``expired``, so that a dry run does not count a record twice.
        expires_at__gt=cutoff,
    )

    # MariaDB/MySQL: a page of the expired pass is read from the ``expires_at`` index alone
    # (the ``DELETE`` re-checks the rest on every row), not from the table's rows too: half
    # of the page's time at 10M records. Not in a dry run, which counts its pages, nor for a
    # selection of records, whose conditions only the page applies.
    index_only = connection.vendor == "mysql" and not dry_run and queryset is None
    candidates = Q(expires_at__lte=cutoff) if index_only else None
    passes = [_Pass("expired", expired, "expires_at", candidates)]
    if include_stale:
        passes.append(_Pass("stale", stale, "lease_expires_at"))
    clock = pacing.clock
    started = clock()
    result = PurgeResult(dry_run=dry_run)
    for index, current in enumerate(passes):
        cursor: tuple[datetime, int] | None = None
        while True:
            room = batch_size if limit is None else min(batch_size, limit - result.total)
            if room <= 0:
                more = current.page(base, cursor, exact=True).exists() or any(
                    later.page(base, None, exact=True).exists() for later in passes[index + 1 :]
                )
                result = replace(result, limit_reached=more, seconds=clock() - started)
                return _finish(result, alias)
            batch_started = clock()
            pks, cursor = _read_page(alias, current.page(base, cursor)[:room])
            if not pks:
                break
            deleted = len(pks) if dry_run else _delete(alias, pks, current.condition)
            batch_ended = clock()
            result = replace(
                result,
                batches=result.batches + 1,
                seconds=batch_ended - started,
                **{current.kind: getattr(result, current.kind) + deleted},
            )
            if progress is not None:
                progress(result)
            if len(pks) < room:
                break
            # More may follow: pause, so that live claims keep the database (see ``Pacing``).
            wait = pacing.pause(len(pks), batch_ended - batch_started)
            if wait > 0:
                (pacing.sleep or _sleep)(wait)
                result = replace(result, paused=result.paused + wait)
    return _finish(replace(result, seconds=clock() - started), alias)


@dataclass(frozen=True)
class _Pass:
    kind: str  # the PurgeResult field that counts it
    condition: Q  # what the DELETE re-checks on every row
    order_field: str  # an indexed column, walked in (order_field, pk) order
    # What a page reads instead of ``condition`` (which implies it), if not None: the
    # candidates the order field's index alone finds, some of which the DELETE then keeps.
    candidates: Q | None = None

    def page(
        self,
        base: QuerySet[IdempotencyRecord],
        cursor: tuple[datetime, int] | None,
        *,
        exact: bool = False,
    ) -> QuerySet[Any]:
        """The rows to consider after ``cursor`` (keyset pagination), as ``(pk, order)``;
        ``exact``: only those that match ``condition`` (not all ``candidates``)."""
        wide = self.candidates is not None and not exact
        rows = base.filter(self.candidates if wide else self.condition)
        if cursor is not None:
            after, pk = cursor
            # ``>=`` bounds the index scan, so that a page starts where the last one stopped
            # rather than at the start of the range (over rows a dry run left, or the dead
            # index entries of the rows already deleted); the ``OR`` breaks the ties.
            rows = rows.filter(
                Q(**{f"{self.order_field}__gte": after}),
                Q(**{f"{self.order_field}__gt": after})
                | Q(**{self.order_field: after, "pk__gt": pk}),
            )
        return rows.order_by(self.order_field, "pk").values_list("pk", self.order_field)


def _sleep(seconds: float) -> None:
    """The pause between two batches (a seam for tests of the default pacing)."""
    time.sleep(seconds)


def _finish(result: PurgeResult, alias: str) -> PurgeResult:
    if not result.dry_run:
        purged.send(IdempotencyRecord, expired=result.expired, stale=result.stale, using=alias)
        if result.total:
            logger.info(
                "Idempotency purge deleted %d expired and %d stale in-progress records.",
                result.expired,
                result.stale,
            )
    return result


def parse_duration(text: str) -> timedelta:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"45s"``, ``"2w"``, or several at once: ``"1d12h"``."""
    value = text.strip().lower()
    if not _DURATION.fullmatch(value):
        raise ValueError(
            f"{text!r} is not a duration: give a number and a unit, e.g. 7d, 12h, 30m or 45s "
            "(units w, d, h, m, s; combined as in 1d12h)"
        )
    seconds = sum(int(number) * _UNITS[unit] for number, unit in _PART.findall(value))
    if seconds > MAX_DURATION_SECONDS:
        # Checked before timedelta() sees it, which raises OverflowError past 2.7 million
        # years; and now minus more than 2000 years would not be a date.
        raise ValueError(f"{text!r} is longer than 100 years: give at most 36500d")
    return timedelta(seconds=seconds)


def describe(result: PurgeResult) -> str:
    """One line for people: what was (or would be) deleted."""
    verb = "Would delete" if result.dry_run else "Deleted"
    line = (
        f"{verb} {result.expired} expired record{_s(result.expired)} and "
        f"{result.stale} stale in-progress record{_s(result.stale)}"
    )
    if result.dry_run:
        line += " (dry run: nothing was deleted)"
    return line + "."


def _s(count: int) -> str:
    return "" if count == 1 else "s"
