"""``manage.py purge_idempotency_keys``: delete expired records in batches (cron-safe)."""

from __future__ import annotations

import argparse
import time
from datetime import timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError, connections

from idempotency_django.purge import (
    PurgeResult,
    batch_size_setting,
    describe,
    parse_duration,
    purge_records,
    stale_after_setting,
)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return value


def _batches(count: int) -> str:
    return f"{count} batch" if count == 1 else f"{count} batches"


def _duration(text: str) -> timedelta:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


class Command(BaseCommand):
    help = (
        "Delete expired idempotency records, and in-progress ones whose lease has long been "
        "dead, in small batches: safe to run from cron while traffic flows."
    )

    #: At verbosity 1, a progress line at most this often (seconds); every batch at 2.
    progress_interval = 5.0

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="Count what would be deleted; delete nothing.",
        )
        parser.add_argument(
            "--older-than",
            type=_duration,
            default=timedelta(0),
            metavar="DURATION",
            help="Only records that expired at least this long ago, e.g. 7d, 12h, 30m.",
        )
        parser.add_argument(
            "--stale-after",
            type=_duration,
            default=None,
            metavar="DURATION",
            help=(
                "Delete in-progress records whose lease lapsed at least this long ago "
                "(default: IDEMPOTENCY['STALE_IN_PROGRESS_SECONDS'], 1h)."
            ),
        )
        parser.add_argument(
            "--batch-size",
            type=_positive_int,
            default=None,
            metavar="N",
            help="Rows per DELETE (default: IDEMPOTENCY['PURGE_BATCH_SIZE'], 500).",
        )
        parser.add_argument(
            "--limit",
            type=_positive_int,
            default=None,
            metavar="N",
            help="Stop after deleting N records in all.",
        )
        parser.add_argument(
            "--database",
            default=None,
            help="The database alias of the store (default: IDEMPOTENCY['DATABASE'] or "
            "the routers' choice).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        database = options["database"]
        if database is not None and database not in connections:
            raise CommandError(f"Unknown database {database!r}.")
        try:
            batch_size = options["batch_size"] or batch_size_setting()
            stale_after = options["stale_after"]
            if stale_after is None:
                stale_after = stale_after_setting()
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from exc
        verbosity = int(options["verbosity"])
        started = time.monotonic()
        last_report = started
        latest = PurgeResult(dry_run=options["dry_run"])

        def report(result: PurgeResult) -> None:
            nonlocal latest, last_report
            latest = result
            now = time.monotonic()
            if verbosity >= 2 or (verbosity == 1 and now - last_report >= self.progress_interval):
                last_report = now
                verb = "would delete" if result.dry_run else "deleted"
                self.stdout.write(
                    f"… {_batches(result.batches)}, {verb} {result.expired} expired and "
                    f"{result.stale} stale in-progress records so far ({now - started:.1f}s)"
                )

        try:
            result = purge_records(
                older_than=options["older_than"],
                stale_after=stale_after,
                batch_size=batch_size,
                limit=options["limit"],
                dry_run=options["dry_run"],
                using=database,
                progress=report,
            )
        except (DatabaseError, KeyboardInterrupt) as exc:
            # Every finished batch committed on its own: say what was done before failing.
            raise CommandError(
                f"Purge stopped after {_batches(latest.batches)}: {str(exc) or 'interrupted'}. "
                f"{describe(latest)}"
            ) from exc
        if verbosity >= 1:
            seconds = time.monotonic() - started
            self.stdout.write(
                self.style.SUCCESS(
                    f"{describe(result)} {_batches(result.batches)}, {seconds:.1f}s."
                )
            )
            if result.limit_reached:
                self.stdout.write(
                    f"Stopped at --limit {options['limit']}: more records are left to purge."
                )
