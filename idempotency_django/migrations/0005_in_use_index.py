"""The index that counts an account's requests in progress (``MAX_IN_FLIGHT_PER_ACCOUNT``).

Partial: only in-progress records have an entry, so it stays small and costs nothing to a
completed record. PostgreSQL (built ``CONCURRENTLY``, hence a non-atomic migration) and
SQLite have partial indexes; MariaDB/MySQL have none, and there the count reads the
``(state, lease_expires_at)`` index or the unique index instead (docs/security.md). Not in
the model's ``Meta.indexes``: Django would warn on MariaDB/MySQL that the condition is
ignored.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations

INDEX = "idempotency_record_in_use"


def _create(apps: Any, schema_editor: Any) -> None:
    vendor = schema_editor.connection.vendor
    if vendor not in ("postgresql", "sqlite"):
        return
    model = apps.get_model("idempotency_django", "IdempotencyRecord")
    qn = schema_editor.quote_name
    columns = ", ".join(
        qn(model._meta.get_field(name).column) for name in ("account", "lease_expires_at")
    )
    state = qn(model._meta.get_field("state").column)
    concurrently = "CONCURRENTLY " if vendor == "postgresql" else ""
    schema_editor.execute(
        f"CREATE INDEX {concurrently}IF NOT EXISTS {qn(INDEX)} "
        f"ON {qn(model._meta.db_table)} ({columns}) WHERE {state} = 'in_progress'"
    )


def _drop(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor in ("postgresql", "sqlite"):
        schema_editor.execute(f"DROP INDEX IF EXISTS {schema_editor.quote_name(INDEX)}")


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("idempotency_django", "0004_admin_indexes"),
    ]

    operations = [migrations.RunPython(_create, _drop, elidable=False)]
