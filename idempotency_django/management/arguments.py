"""Command-line arguments of the management commands: value types, usage errors that are
``CommandError``s with exit status 2 under ``call_command`` too, and ``Command``, the base
that gives each command that parser and the store's ``--database``.

The purge command's options become ``purge_records``' keyword arguments here
(``purge_arguments``), so the command is argument parsing, one call and its output.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, NoReturn

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections

from idempotency_django.operations.purge import (
    MAX_AGE,
    Pacing,
    batch_size_setting,
    parse_duration,
    rate_setting,
    stale_after_setting,
)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return value


def rate(text: str) -> float:
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


def duration(text: str) -> timedelta:
    """A duration; ``-1d`` is read as a negative one, which the command refuses by name."""
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


def join_negative_values(args: Sequence[str]) -> list[str]:
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


class Parser(CommandParser):
    """Every usage error a ``CommandError`` with exit status 2, also under ``call_command``
    (Django's own parser raises one with status 1 there; on the command line argparse exits
    2). Negative durations are joined to their option first."""

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        return super().parse_args(None if args is None else join_negative_values(args), namespace)

    def error(self, message: str) -> NoReturn:
        if self.called_from_command_line:
            super().error(message)  # usage and message on stderr, exit status 2
        raise usage_error(f"Error: {message}")


class Command(BaseCommand):
    """The base of the app's commands: their parser is ``Parser``, and each takes the
    store's ``--database``."""

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.__class__ = Parser  # Django builds a CommandParser: this one's
        return parser

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--database",
            default=None,
            help="The database alias of the store (default: IDEMPOTENCY['DATABASE'] or "
            "the routers' choice).",
        )


def usage_error(message: str) -> CommandError:
    return CommandError(message, returncode=2)


def database(options: dict[str, Any]) -> str | None:
    """The ``--database`` alias, refused if ``DATABASES`` has no such alias."""
    alias: str | None = options["database"]
    if alias is not None and alias not in connections:
        raise usage_error(f"Unknown database {alias!r}.")
    return alias


def checked_duration(options: dict[str, Any], name: str) -> timedelta | None:
    """The duration option ``name`` (a ``timedelta``; ``call_command`` may also pass a
    string such as ``"7d"``), refused if negative."""
    option = f"--{name.replace('_', '-')}"
    given = options[name]
    value: timedelta | None = given
    if isinstance(given, str):
        try:
            value = duration(given)
        except argparse.ArgumentTypeError as exc:
            raise usage_error(f"{option}: {exc}") from exc
    if value is not None and value < timedelta(0):
        raise usage_error(f"{option} must not be negative: give how long ago, e.g. 7d.")
    if value is not None and value > MAX_AGE:
        raise usage_error(f"{option} must be at most 100 years (36500d).")
    return value


def purge_arguments(options: dict[str, Any]) -> dict[str, Any]:
    """The purge command's options as ``purge_records``' keyword arguments, the settings
    filling what the command line left out; a bad option or setting is a ``CommandError``."""
    alias = database(options)
    older_than = checked_duration(options, "older_than") or timedelta(0)
    stale_after = checked_duration(options, "stale_after")
    given_rate = options.get("rate")
    if given_rate is not None and not isinstance(given_rate, float):  # call_command(rate="100")
        try:
            given_rate = rate(str(given_rate))
        except argparse.ArgumentTypeError as exc:
            raise usage_error(f"--rate: {exc}") from exc
    if given_rate is not None and options.get("no_pacing"):
        raise usage_error("--rate and --no-pacing contradict each other: give one.")
    try:
        batch_size = options["batch_size"] or batch_size_setting()
        if stale_after is None:
            stale_after = stale_after_setting()
        if options.get("no_pacing"):
            pacing = Pacing.flat_out()
        else:
            pacing = Pacing(rate=rate_setting() if given_rate is None else given_rate)
    except ImproperlyConfigured as exc:
        raise CommandError(str(exc)) from exc
    return {
        "older_than": older_than,
        "stale_after": stale_after,
        "batch_size": batch_size,
        "limit": options["limit"],
        "dry_run": options["dry_run"],
        "using": alias,
        "pacing": pacing,
    }
