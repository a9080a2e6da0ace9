"""The admin's indexes (search by key, filter by endpoint and by status at 10M rows).

Built with ``CREATE INDEX CONCURRENTLY`` on PostgreSQL, so that migrating a large live
table does not block its claims for the minutes a build takes (MariaDB/MySQL build
InnoDB indexes online by themselves); hence a non-atomic migration.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models


class AddIndexOnline(migrations.AddIndex):
    """``AddIndex``, concurrently on PostgreSQL."""

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if schema_editor.connection.vendor != "postgresql":
            super().database_forwards(app_label, schema_editor, from_state, to_state)
            return
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            schema_editor.add_index(model, self.index, concurrently=True)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("idempotency_django", "0003_view_decrypted_body_permission"),
    ]

    operations = [
        AddIndexOnline(
            model_name="idempotencyrecord",
            index=models.Index(
                fields=["key"], name="idempotency_record_key", opclasses=["varchar_pattern_ops"]
            ),
        ),
        AddIndexOnline(
            model_name="idempotencyrecord",
            index=models.Index(fields=["endpoint", "id"], name="idempotency_record_endpoint"),
        ),
        AddIndexOnline(
            model_name="idempotencyrecord",
            index=models.Index(fields=["response_status", "id"], name="idempotency_record_status"),
        ),
    ]
