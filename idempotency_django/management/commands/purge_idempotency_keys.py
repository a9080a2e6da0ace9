"""``manage.py purge_idempotency_keys``: delete expired records in batches (cron-safe).

Argument parsing over ``purge.purge_records``; the options become its arguments in
``management/arguments.py``. The purge itself: docs/operations.md."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError, CommandParser
from django.db import DatabaseError

from idempotency_django.management import arguments
from idempotency_django.operations.purge import PurgeResult, describe, purge_records
from idempotency_django.store.base import get_store


def _batches(count: int) -> str:
    return f"{count} batch" if count == 1 else f"{count} batches"


class Command(arguments.Command):
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
            type=arguments.duration,
            default=timedelta(0),
            metavar="DURATION",
            help="Only records that expired at least this long ago, e.g. 7d, 12h, 30m.",
        )
        parser.add_argument(
            "--stale-after",
            type=arguments.duration,
            default=None,
            metavar="DURATION",
            help=(
                "Delete in-progress records whose lease lapsed at least this long ago "
                "(default: IDEMPOTENCY['STALE_IN_PROGRESS_SECONDS'], 1h)."
            ),
        )
        parser.add_argument(
            "--batch-size",
            type=arguments.positive_int,
            default=None,
            metavar="N",
            help="Rows per DELETE (default: IDEMPOTENCY['PURGE_BATCH_SIZE'], 1000).",
        )
        parser.add_argument(
            "--limit",
            type=arguments.positive_int,
            default=None,
            metavar="N",
            help="Stop after deleting N records in all.",
        )
        pacing = parser.add_mutually_exclusive_group()
        pacing.add_argument(
            "--rate",
            type=arguments.rate,
            default=None,
            metavar="ROWS_PER_SECOND",
            help="Delete at most this many rows a second; 0 for no ceiling (default: "
            "IDEMPOTENCY['PURGE_RATE'], 25000). Either way the purge pauses between batches "
            "at least as long as each batch took, so it backs off when the database is busy.",
        )
        pacing.add_argument(
            "--no-pacing",
            action="store_true",
            help="No pauses at all: delete as fast as the database allows (live traffic "
            "pays for it; for a maintenance window).",
        )
        super().add_arguments(parser)  # --database

    def handle(self, *args: Any, **options: Any) -> None:
        if options["database"] is None:
            try:
                store = get_store()
            except ImproperlyConfigured as exc:
                raise CommandError(str(exc)) from exc
            if not store.needs_purge:
                # Its records expire by themselves. A view that keeps its records in the
                # database (its own store=) is purged by naming the database: --database.
                self.stdout.write(
                    f"The configured store ({type(store).__name__}) expires its records "
                    "itself: nothing to purge. (Records of views that use the database store "
                    "are purged with --database.)"
                )
                return
        purge = arguments.purge_arguments(options)
        verbosity = int(options["verbosity"])
        started = last_report = time.monotonic()
        latest = PurgeResult(dry_run=purge["dry_run"])

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
            result = purge_records(**purge, progress=report)
        except (DatabaseError, KeyboardInterrupt) as exc:
            # Every finished batch committed on its own: say what was done before failing.
            raise CommandError(
                f"Purge stopped after {_batches(latest.batches)}: {str(exc) or 'interrupted'}. "
                f"{describe(latest)}"
            ) from exc
        if verbosity >= 1:
            self.stdout.write(
                self.style.SUCCESS(
                    f"{describe(result)} {_batches(result.batches)}, {result.seconds:.1f}s, "
                    f"{result.rate:,.0f} rows/s ({purge['pacing'].describe()})."
                )
            )
            if result.limit_reached:
                self.stdout.write(
                    f"Stopped at --limit {options['limit']}: more records are left to purge."
                )
