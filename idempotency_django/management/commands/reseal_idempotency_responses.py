"""``manage.py reseal_idempotency_responses``: seal every stored response again under the
configured ``RESPONSE_CODEC`` (after a key rotation, or when encryption is turned on)."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError, CommandParser

from idempotency_django.core.codecs import Resealed, get_codec, reseal_records
from idempotency_django.management import arguments
from idempotency_django.store.base import get_store
from idempotency_django.store.database import DatabaseStore

NOT_RESEALED = (
    "The configured store ({store}) keeps its records outside the database: they are not "
    "resealed. Each expires by itself within TTL_SECONDS; keep the old key in "
    "ENCRYPTION_KEYS until TTL_SECONDS after every process runs with the new first key. "
    "(Records of views that use the database store are resealed with --database.)"
)


def summary(result: Resealed) -> str:
    """One line; the records completed without a body (a streamed or too-large response)
    are named only when there are some, as what they are: there was nothing to seal."""
    line = (
        f"Resealed {result.resealed} stored responses; {result.unreadable} could not be "
        "opened with the configured keys (left as they are)"
    )
    if result.skipped:
        line += (
            f"; {result.skipped} completed without a stored response (streamed or over "
            "MAX_RESPONSE_BYTES: nothing to seal)"
        )
    if result.unbound:
        line += (
            f"; {result.unbound} bound to no record, left as they are (REQUIRE_BOUND_RESPONSES "
            "is on: they are refused on replay)"
        )
    return line + "."


class Command(arguments.Command):
    help = (
        "Seal every stored idempotent response again with RESPONSE_CODEC: under the first "
        "of ENCRYPTION_KEYS after a rotation (so older keys can be dropped), and for the "
        "first time for records stored before the codec was set. Safe while traffic flows."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)  # --database
        parser.add_argument(
            "--batch-size",
            type=arguments.positive_int,
            default=100,
            help="Records listed per query (each is read and written on its own).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["database"] is None:
            try:
                if get_codec() is None:  # refused whatever the store: nothing to seal with
                    raise ImproperlyConfigured(
                        "IDEMPOTENCY RESPONSE_CODEC is not set: nothing to seal with."
                    )
                store = get_store()
            except ImproperlyConfigured as error:
                raise CommandError(str(error)) from error
            if not isinstance(store, DatabaseStore):
                # Said, not silently "Resealed 0": a rotation relying on it would drop a
                # key that the store's records still need.
                self.stdout.write(NOT_RESEALED.format(store=type(store).__name__))
                return
        database = arguments.database(options)
        try:
            result = reseal_records(using=database, batch_size=options["batch_size"])
        except ImproperlyConfigured as error:
            raise CommandError(str(error)) from error
        self.stdout.write(summary(result))
        if result.unreadable:
            self.stderr.write(
                "Records that cannot be opened answer 409 response-unreadable until they "
                "expire: restore the key that sealed them to read them again."
            )
