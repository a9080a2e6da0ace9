"""``manage.py idempotency_health``: the health check for deploy scripts (``health.py``).

Prints the same JSON as ``idempotency_health_view`` and exits 1 when a check fails (0 when
every check passes), with the store's own error text in the messages: it is run by an
operator, not answered to whoever reaches a URL."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections

from idempotency_django.operations.health import run_checks


class Command(BaseCommand):
    help = (
        "Check the idempotency store: a bounded round trip, this process's lease renewals, "
        "and the purge lag. Prints JSON; exits 1 when a check fails."
    )
    requires_system_checks: list[str] = []  # a probe answers even with a settings warning

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--database",
            default=None,
            help="The database alias of the records (default: the store's).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        alias = options["database"]
        if alias is not None and alias not in connections:
            raise CommandError(f"Unknown database {alias!r}.", returncode=2)
        report = run_checks(alias=alias)
        self.stdout.write(report.to_json())
        if not report.ok:
            failed = ", ".join(check.name for check in report.checks if not check.ok)
            raise CommandError(f"Idempotency health check failed: {failed}.", returncode=1)
