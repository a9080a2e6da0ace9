"""The Django admin for idempotency records: read-only, plus two actions.

- **Release** deletes a stuck *in-progress* record, so that the next retry with its key runs
  the view (what the engine does when a view fails). Completed records are never released
  from here: that would let a retry repeat a side effect that already happened.
- **Delete expired** deletes the selected records that are past their TTL (they already
  count as absent), through the same batched, re-checking purge as
  ``manage.py purge_idempotency_keys``.

Nothing can be added or edited, and the generic delete is off for the same reason as above;
both actions need the model's "delete" permission.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.auth import get_permission_codename
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from idempotency_django import engine, signals
from idempotency_django.models import IdempotencyRecord
from idempotency_django.purge import purge_records

logger = logging.getLogger("idempotency_django")

State = IdempotencyRecord.State

if TYPE_CHECKING:
    RecordAdminBase = admin.ModelAdmin[IdempotencyRecord]
else:  # ModelAdmin is generic for type checkers only
    RecordAdminBase = admin.ModelAdmin


class ExpiredListFilter(admin.SimpleListFilter):
    """Past its TTL (``expires_at <= now``): the engine already treats the key as absent."""

    title = "expired"
    parameter_name = "expired"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "Yes"), ("no", "No")]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[IdempotencyRecord]
    ) -> QuerySet[IdempotencyRecord]:
        now = timezone.now()
        if self.value() == "yes":
            return queryset.filter(expires_at__lte=now)
        if self.value() == "no":
            return queryset.filter(expires_at__gt=now)
        return queryset


def is_json_media_type(content_type: str | None) -> bool:
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )


def stored_content_type(record: IdempotencyRecord) -> str | None:
    for name, value in record.response_headers or []:
        if str(name).lower() == "content-type":
            return str(value)
    return None


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(RecordAdminBase):
    list_display = (
        "key",
        "account",
        "endpoint",
        "state",
        "response_status",
        "created_at",
        "expires_at",
    )
    list_filter = ("state", "endpoint", "response_status", ExpiredListFilter)
    # Exact, case-sensitive matches, as the engine compares keys: keys are opaque, and
    # ``account = …`` uses the unique index where ``LIKE '%…%'`` would read the whole table.
    search_fields = ("key__exact", "account__exact")
    search_help_text = "An exact Idempotency-Key, or an account (the user's primary key)."
    date_hierarchy = "created_at"
    ordering = ("-pk",)
    show_full_result_count = False
    fields = (
        "account",
        "endpoint",
        "key",
        "state",
        "fingerprint",
        "token",
        "lease_expires_at",
        "response_status",
        "response_headers",
        "stored_response",
        "created_at",
        "completed_at",
        "expires_at",
    )
    readonly_fields = fields
    actions = ("release", "delete_expired")

    def get_queryset(self, request: HttpRequest) -> QuerySet[IdempotencyRecord]:
        # The store may live in a database of its own (IDEMPOTENCY["DATABASE"]).
        return super().get_queryset(request).using(engine.store_alias())

    # -- read-only ----------------------------------------------------------------------------

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(
        self, request: HttpRequest, obj: IdempotencyRecord | None = None
    ) -> bool:
        return False

    def has_delete_permission(
        self, request: HttpRequest, obj: IdempotencyRecord | None = None
    ) -> bool:
        # No generic delete: deleting a completed record would let a retry run again.
        return False

    def has_delete_records_permission(self, request: HttpRequest) -> bool:
        """The actions delete records: they need the model's "delete" permission."""
        codename = get_permission_codename("delete", self.opts)
        return request.user.has_perm(f"{self.opts.app_label}.{codename}")

    # -- the stored response ------------------------------------------------------------------

    @admin.display(description="stored response")
    def stored_response(self, record: IdempotencyRecord) -> str | SafeString:
        if record.response_body is None:
            if record.state == State.IN_PROGRESS:
                return "— (the request is in progress)"
            return "not stored (the response was streamed or over MAX_RESPONSE_BYTES)"
        body = bytes(record.response_body)
        content_type = stored_content_type(record)
        if is_json_media_type(content_type):
            try:
                parsed = json.loads(body)
            except ValueError:  # not JSON after all (or not UTF-8): fall back to its size
                pass
            else:
                pretty = json.dumps(parsed, indent=2, ensure_ascii=False)
                return format_html('<pre class="stored-response">{}</pre>', pretty)
        described = f"{len(body)} bytes"
        return f"{described} of {content_type}" if content_type else described

    # -- actions ------------------------------------------------------------------------------

    @admin.action(
        description="Release selected in-progress keys (the next retry runs)",
        permissions=["delete_records"],
    )
    def release(self, request: HttpRequest, queryset: QuerySet[IdempotencyRecord]) -> None:
        alias = queryset.db
        selected = queryset.count()
        candidates = list(
            queryset.filter(state=State.IN_PROGRESS)
            .order_by()
            .only("pk", "account", "endpoint", "key", "token")
        )
        released = []
        for record in candidates:
            # Conditional, like every write of the engine: a record that completed (or was
            # taken over by a new claim) since it was read is left alone. ``_raw_delete``
            # keeps the conditions whatever listens to Django's delete signals.
            still_stuck = IdempotencyRecord.objects.using(alias).filter(
                pk=record.pk, token=record.token, state=State.IN_PROGRESS
            )
            if still_stuck._raw_delete(alias):
                released.append(record)
        user_id = request.user.pk
        if released and user_id is not None:
            # The admin's history ("Deleted …"), like a delete from the admin would log.
            LogEntry.objects.log_actions(
                user_id=user_id,
                queryset=released,
                action_flag=DELETION,
                change_message="Released the in-progress key.",
            )
        for record in released:
            logger.warning(
                "Idempotency key released from the admin by %s; the next retry runs the view.",
                request.user,
                extra={
                    "idempotency_account": record.account,
                    "idempotency_endpoint": record.endpoint,
                    "idempotency_key": record.key,
                },
            )
            signals.released.send(
                IdempotencyRecord,
                account=record.account,
                endpoint=record.endpoint,
                key=record.key,
            )
        if released:
            self.message_user(
                request,
                f"Released {_records(len(released))}: the next retry with "
                f"{'its key' if len(released) == 1 else 'each key'} runs the view.",
                messages.SUCCESS,
            )
        skipped = selected - len(released)
        if skipped:
            self.message_user(
                request,
                f"Skipped {_records(skipped)} not in progress: only in-progress keys can be "
                "released (a completed key keeps its stored response until it expires).",
                messages.WARNING,
            )

    @admin.action(
        description="Delete selected records that have expired",
        permissions=["delete_records"],
    )
    def delete_expired(self, request: HttpRequest, queryset: QuerySet[IdempotencyRecord]) -> None:
        selected = queryset.count()
        result = purge_records(queryset=queryset, include_stale=False, using=queryset.db)
        self.message_user(
            request,
            f"Deleted {_records(result.expired)} past {'its' if result.expired == 1 else 'their'}"
            " expiry.",
            messages.SUCCESS,
        )
        skipped = selected - result.expired
        if skipped:
            self.message_user(
                request,
                f"Kept {_records(skipped)} not yet expired (or still in progress).",
                messages.WARNING,
            )


def _records(count: int) -> str:
    return f"{count} record" if count == 1 else f"{count} records"
