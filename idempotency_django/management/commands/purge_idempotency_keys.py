"""``manage.py purge_idempotency_keys``: delete expired records in batches (cron-safe)."""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, NoReturn

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError, connections

from idempotency_django.purge import (
    Pacing,
    PurgeResult,
    batch_size_setting,
    describe,
    parse_duration,
    purge_records,
    rate_setting,
    stale_after_setting,
)
from idempotency_django.store.base import get_store


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return value


def _rate(text: str) -> float:
    """Rows per second: a number of zero or more (``0``: no ceiling)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (0 <= value < float("inf")):  # also refuses NaN
        raise argparse.ArgumentTypeError(
            f"must be a number of rows per second (0 for no ceiling), not {text!r}"
        )
    return value


def _batches(count: int) -> str:
    return f"{count} batch" if count == 1 else f"{count} batches"


def _duration(text: str) -> timedelta:
    """A duration; ``-1d`` is read as a negative one, which ``handle`` refuses by name."""
    stripped = text.strip()
    if stripped.startswith("-"):
        try:
            return -parse_duration(stripped[1:])
        except ValueError:
            pass  # not a duration either: say so of the whole text
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


#: The options that take a duration, whose value may start with "-".
DURATION_OPTIONS = ("--older-than", "--stale-after")
_NEGATIVE = re.compile(r"-\s*[0-9]")


def _join_negative_values(args: Sequence[str]) -> list[str]:
    """``--older-than -1d`` as ``--older-than=-1d``: argparse would read ``-1d`` as an
    option, and answer "expected one argument" instead of refusing a negative duration."""
    joined: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        is_duration_option = len(arg) > 2 and any(o.startswith(arg) for o in DURATION_OPTIONS)
        if is_duration_option and index + 1 < len(args) and _NEGATIVE.match(args[index + 1]):
            joined.append(f"{arg}={args[index + 1]}")
            index += 2
        else:
            joined.append(arg)
            index += 1
    return joined


class _Parser(CommandParser):
    """The command's parser: joins negative durations to their option, and makes every usage
    error a ``CommandError`` with exit status 2, also under ``call_command`` (Django's own
    parser raises one with status 1 there; on the command line argparse exits 2)."""

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        return super().parse_args(None if args is None else _join_negative_values(args), namespace)

    def error(self, message: str) -> NoReturn:
        if self.called_from_command_line:
            super().error(message)  # usage and message on stderr, exit status 2
        raise CommandError(f"Error: {message}", returncode=2)


def _bad_option(message: str) -> CommandError:
    return CommandError(message, returncode=2)


def _checked_duration(options: dict[str, Any], name: str) -> timedelta | None:
    """The duration option ``name`` (a ``timedelta``; ``call_command`` may also pass a
    string such as ``"7d"``), refused if negative."""
    option = f"--{name.replace('_', '-')}"
    given = options[name]
    value: timedelta | None = given
    if isinstance(given, str):
        try:
            value = _duration(given)
        except argparse.ArgumentTypeError as exc:
            raise _bad_option(f"{option}: {exc}") from exc
    if value is not None and value < timedelta(0):
        raise _bad_option(f"{option} must not be negative: give how long ago, e.g. 7d.")
    return value


class Command(BaseCommand):
    help = (
        "Delete expired idempotency records, and in-progress ones whose lease has long been "
        "dead, in small batches: safe to run from cron while traffic flows."
    )

    #: At verbosity 1, a progress line at most this often (seconds); every batch at 2.
    progress_interval = 5.0

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        # Django builds a CommandParser; the same one, with _Parser's two methods.
        parser.__class__ = _Parser
        return parser

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
        pacing = parser.add_mutually_exclusive_group()
        pacing.add_argument(
            "--rate",
            type=_rate,
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
        parser.add_argument(
            "--database",
            default=None,
            help="The database alias of the store (default: IDEMPOTENCY['DATABASE'] or "
            "the routers' choice).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        database = options["database"]
        try:
            store = get_store()
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from exc
        if not store.needs_purge and database is None:
            # Its records expire by themselves. A view that keeps its records in the
            # database (its own store=) is purged by naming the database: --database.
            self.stdout.write(
                f"The configured store ({type(store).__name__}) expires its records itself: "
                "nothing to purge. (Records of views that use the database store are purged "
                "with --database.)"
            )
            return
        if database is not None and database not in connections:
            raise _bad_option(f"Unknown database {database!r}.")
        older_than = _checked_duration(options, "older_than") or timedelta(0)
        stale_after = _checked_duration(options, "stale_after")
        rate = options.get("rate")
        if rate is not None and not isinstance(rate, float):  # call_command(rate="100")
            try:
                rate = _rate(str(rate))
            except argparse.ArgumentTypeError as exc:
                raise _bad_option(f"--rate: {exc}") from exc
        if rate is not None and options.get("no_pacing"):
            raise _bad_option("--rate and --no-pacing contradict each other: give one.")
        try:
            batch_size = options["batch_size"] or batch_size_setting()
            if stale_after is None:
                stale_after = stale_after_setting()
            if options.get("no_pacing"):
                pacing = Pacing.flat_out()
            else:
                pacing = Pacing(rate=rate_setting() if rate is None else rate)
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
                older_than=older_than,
                stale_after=stale_after,
                batch_size=batch_size,
                limit=options["limit"],
                dry_run=options["dry_run"],
                using=database,
                progress=report,
                pacing=pacing,
            )
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
                    f"{result.rate:,.0f} rows/s ({pacing.describe()})."
                )
            )
            if result.limit_reached:
                self.stdout.write(
                    f"Stopped at --limit {options['limit']}: more records are left to purge."
                )
