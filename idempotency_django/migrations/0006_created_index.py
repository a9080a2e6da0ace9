"""The admin overview's index: the records created in the last hour, newest first, read as a
bounded range at any table size (the busiest endpoints panel). Built online, as 0004's."""

from __future__ import annotations

from importlib import import_module

from django.db import migrations, models

# ``CREATE INDEX CONCURRENTLY`` on PostgreSQL, as migration 0004 builds its own.
AddIndexOnline = import_module("idempotency_django.migrations.0004_admin_indexes").AddIndexOnline


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("idempotency_django", "0005_in_use_index"),
    ]

    operations = [
        AddIndexOnline(
            model_name="idempotencyrecord",
            index=models.Index(fields=["created_at"], name="idempotency_record_created"),
        ),
    ]
