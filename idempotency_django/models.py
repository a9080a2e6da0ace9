"""The record whose unique row is the single-flight lock for one idempotency key.

Purged and shown read-only in the admin: docs/operations.md."""

from __future__ import annotations

from typing import Any

from django.db import models

# Defined with the rules that use them (keys.py imports no model: the client imports it).
from idempotency_django.core.keys import FINGERPRINT_MAX_LENGTH as FINGERPRINT_MAX_LENGTH
from idempotency_django.core.keys import KEY_MAX_LENGTH as KEY_MAX_LENGTH

# Column widths are chosen so the unique index fits MariaDB/MySQL's 3072-byte
# InnoDB limit with utf8mb4 (4 bytes per character): (128 + 255 + 255) * 4 = 2552.
ACCOUNT_MAX_LENGTH = 128
ENDPOINT_MAX_LENGTH = 255


class ExactCharField(models.CharField):  # type: ignore[type-arg]
    """A ``CharField`` compared byte for byte on every backend.

    MariaDB/MySQL's default collations ignore case and trailing spaces, which would make
    ``abc``, ``ABC`` and ``"abc "`` one key there: another client's operation replayed.
    PostgreSQL and SQLite compare exactly already.
    """

    def db_parameters(self, connection: Any) -> dict[str, Any]:
        parameters = super().db_parameters(connection)
        if connection.vendor == "mysql":
            parameters["collation"] = (
                "utf8mb4_nopad_bin" if connection.mysql_is_mariadb else "utf8mb4_0900_bin"
            )
        return parameters


class IdempotencyRecord(models.Model):
    class State(models.TextChoices):
        IN_PROGRESS = "in_progress", "in progress"
        COMPLETED = "completed", "completed"

    account = ExactCharField(max_length=ACCOUNT_MAX_LENGTH)
    endpoint = ExactCharField(max_length=ENDPOINT_MAX_LENGTH)
    key = ExactCharField(max_length=KEY_MAX_LENGTH)
    # "<version>:<sha256 hex>" (66 characters today; 64 hex digits without a version were
    # written before versions), with room for a longer version or digest name.
    fingerprint = models.CharField(max_length=FINGERPRINT_MAX_LENGTH)
    state = models.CharField(max_length=16, choices=State.choices, default=State.IN_PROGRESS)
    # A new random token per claim: completion, renewal and release only touch the
    # row while it still carries the token of the claim that wants to write it.
    token = models.CharField(max_length=32)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    response_headers = models.JSONField(default=list, blank=True)
    response_body = models.BinaryField(null=True, blank=True)
    created_at = models.DateTimeField()
    completed_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(db_index=True)

    class Meta:
        verbose_name = "idempotency record"
        permissions = [
            # With a RESPONSE_CODEC, the admin shows stored responses only to holders of
            # this permission (superusers hold every permission); others see "encrypted".
            ("view_decrypted_body", "Can view decrypted stored responses"),
        ]
        indexes = [
            # The purge's second pass: in-progress records whose lease died long ago.
            models.Index(fields=["state", "lease_expires_at"], name="idempotency_record_stale"),
            # The admin at 10 million rows (see admin.py): exact-key and key-prefix search
            # (pattern ops, so that PostgreSQL serves ``LIKE 'prefix%'`` in any collation),
            # and the endpoint and status filters, newest first, without a scan or a sort.
            models.Index(
                fields=["key"], name="idempotency_record_key", opclasses=["varchar_pattern_ops"]
            ),
            models.Index(fields=["endpoint", "id"], name="idempotency_record_endpoint"),
            models.Index(fields=["response_status", "id"], name="idempotency_record_status"),
            # The admin overview's busiest endpoints of the last hour: a bounded range of
            # the newest records, whatever the table's size (migration 0006).
            models.Index(fields=["created_at"], name="idempotency_record_created"),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["account", "endpoint", "key"],
                name="idempotency_record_unique_key",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.key} ({self.account}, {self.endpoint})"
