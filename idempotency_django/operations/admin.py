"""The Django admin for idempotency records: read-only, plus release, force release and
delete expired.

Nothing can be added or edited, and the generic delete is off: deleting a completed record
would let a retry repeat a side effect that already happened. Every action needs the
model's "delete" permission. Every page stays fast on a table of 10 million records
(``benchmarks/admin_scale.py``): no unbounded count, no ``DISTINCT`` over the table, an
index behind every filter and search, no date hierarchy. What each action does, and who
sees encrypted bodies and usernames: ``docs/operations.md`` ("The admin").
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.admin.views.main import ChangeList
from django.contrib.auth import get_permission_codename, get_user_model
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.db.models import BooleanField, ExpressionWrapper, Q, QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.functional import cached_property
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _

from idempotency_django import signals
from idempotency_django.adapters.tasks import ENDPOINT_PREFIX as TASK_ENDPOINT_PREFIX
from idempotency_django.conf import DEFAULTS, conf
from idempotency_django.core import claims, codecs
from idempotency_django.core.fingerprint import fingerprint_display
from idempotency_django.core.responses import StoredResponse
from idempotency_django.models import IdempotencyRecord
from idempotency_django.operations import overview
from idempotency_django.operations.purge import purge_records
from idempotency_django.store import database as database_store
from idempotency_django.store.base import get_store, in_use_q, lapsed_q
from idempotency_django.store.database import DatabaseNow
from idempotency_django.store.database import delete_returning as _delete_returning

logger = logging.getLogger("idempotency_django")

State = IdempotencyRecord.State
# A shorter prefix would match a large part of the table (keys are mostly random), all to
# be sorted newest first.
KEY_PREFIX_MIN = 4
DECRYPT_PERMISSION = "idempotency_django.view_decrypted_body"

if TYPE_CHECKING:
    RecordAdminBase = admin.ModelAdmin[IdempotencyRecord]
else:  # ModelAdmin is generic for type checkers only
    RecordAdminBase = admin.ModelAdmin


class ExpiredListFilter(admin.SimpleListFilter):
    """Past its TTL (``expires_at <= now``): a claim already treats the key as absent."""

    title = "expired"
    parameter_name = "expired"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "Yes"), ("no", "No")]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[IdempotencyRecord]
    ) -> QuerySet[IdempotencyRecord]:
        now = DatabaseNow()  # the clock that wrote the expiry
        if self.value() == "yes":
            return queryset.filter(expires_at__lte=now)
        if self.value() == "no":
            return queryset.filter(expires_at__gt=now)
        return queryset


class LeaseListFilter(admin.SimpleListFilter):
    """In-progress records by lease: *live* (a worker renews it) or *lapsed* (nobody does:
    the next retry takes the key over; "release" deletes it). Served by the
    ``(state, lease_expires_at)`` index."""

    title = "lease"
    parameter_name = "lease"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("live", "Live"), ("lapsed", "Lapsed")]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[IdempotencyRecord]
    ) -> QuerySet[IdempotencyRecord]:
        now = DatabaseNow()  # the clock that wrote the lease
        if self.value() == "lapsed":
            return queryset.filter(lapsed_q(now))
        if self.value() == "live":
            return queryset.filter(in_use_q(now))
        return queryset


class RecentValuesListFilter(admin.AllValuesFieldListFilter):
    """Django's filter by value, offering the values of the latest ``RECENT`` records (and
    the one chosen) instead of a ``SELECT DISTINCT`` over the whole table, which reads
    every row. Each choice is served by an index on ``(field, id)``."""

    RECENT = 1000

    def __init__(
        self,
        field: Any,
        request: HttpRequest,
        params: Any,
        model: Any,
        model_admin: Any,
        field_path: str,
    ) -> None:
        super().__init__(field, request, params, model, model_admin, field_path)
        latest = (
            model_admin.get_queryset(request)
            .order_by("-pk")
            .values_list(field.name, flat=True)[: self.RECENT]
        )
        values = set(latest)
        chosen = self.lookup_val  # a list of the strings given (Django 5)
        values.update(chosen if isinstance(chosen, list) else [chosen] if chosen else [])
        shown = {str(value): value for value in values if value is not None}
        choices: list[Any] = [shown[text] for text in sorted(shown)]
        if None in values:
            choices.append(None)
        self.lookup_choices = choices  # type: ignore[assignment]


class BoundedPaginator(Paginator):  # type: ignore[type-arg]
    """A paginator that never counts the whole table: ``COUNT(*)`` of a 10-million-row
    table takes seconds. It counts at most ``COUNT_LIMIT`` rows (pages past that would be
    slow ``OFFSET``s anyway); past the limit, the unfiltered list shows the database's
    estimate of the table's size instead (``estimate``)."""

    COUNT_LIMIT = 10_000

    @cached_property
    def count(self) -> int:
        queryset: QuerySet[Any] = self.object_list  # type: ignore[assignment]
        counted = int(queryset.order_by()[: self.COUNT_LIMIT + 1].count())
        self.more = counted > self.COUNT_LIMIT
        self.estimate = None
        if self.more and not queryset.query.where:
            self.estimate = database_store.estimated_rows(queryset.db)
        return min(counted, self.COUNT_LIMIT)


class RecordChangeList(ChangeList):
    """The changelist, without the stored bodies: a page of 100 records could otherwise
    read 100 times ``MAX_RESPONSE_BYTES`` to show none of it. The actions get this queryset
    too, and need no body either."""

    def get_queryset(
        self, request: HttpRequest, exclude_parameters: list[str | None] | None = None
    ) -> QuerySet[Any]:
        return super().get_queryset(request, exclude_parameters).defer("response_body")

    def get_ordering(self, request: HttpRequest, queryset: QuerySet[Any]) -> list[Any]:
        """Newest first; expired records by expiry, latest first: the ``expires_at`` index
        walked backwards, where "newest first" would pass over every unexpired record. An
        ``?o=`` in the query string is ignored: no column sorts (``sortable_by``), and a sort
        by one would read and sort the whole table."""
        if self.params.get(ExpiredListFilter.parameter_name) == "yes":
            return ["-expires_at", "-pk"]
        return ["-pk"]

    def get_results(self, request: HttpRequest) -> None:
        """Label the page's accounts with one ``ACCOUNT_DISPLAY`` call per distinct
        account (one query for the default), not one per row."""
        super().get_results(request)
        label_accounts(self.result_list)


def is_json_media_type(content_type: str | None) -> bool:
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )


def label_accounts(records: Iterable[IdempotencyRecord]) -> None:
    """Set ``account_label`` on each record, through ``ACCOUNT_DISPLAY``: once per distinct
    account, or in one call to its ``many`` method when it has one. Task records are left
    alone: their account is the scope the caller chose, not a user."""
    records = [r for r in records if not r.endpoint.startswith(TASK_ENDPOINT_PREFIX)]
    display = conf.optional_callable("ACCOUNT_DISPLAY")
    if display is None or not records:
        return
    accounts = {record.account for record in records}
    many: Callable[[Collection[str]], dict[str, str]] | None = getattr(display, "many", None)
    labels = many(accounts) if many is not None else {a: str(display(a)) for a in accounts}
    for record in records:
        record.account_label = labels.get(record.account)  # type: ignore[attr-defined]


def _default_account_is_the_user() -> bool:
    """Whether accounts are user primary keys: the default ``ACCOUNT`` (and no other, as
    far as this app can tell)."""
    from idempotency_django.core import keys

    return conf.get("ACCOUNT") in (DEFAULTS["ACCOUNT"], keys.default_account)


class UsernameDisplay:
    """The default ``ACCOUNT_DISPLAY``: ``"alice (42)"`` for the account of user 42.

    Only while ``ACCOUNT`` is the default (the user's primary key); with another
    ``ACCOUNT`` the value is not a user's, and is shown as it is. An account with no such
    user (deleted since) is shown as it is, too.
    """

    def __call__(self, account: str) -> str:
        return self.many([account]).get(account, account)

    def many(self, accounts: Collection[str]) -> dict[str, str]:
        if not _default_account_is_the_user():
            return {}
        user_model = get_user_model()
        pk_field = user_model._meta.pk
        assert pk_field is not None
        wanted: dict[Any, str] = {}
        for account in accounts:
            try:
                wanted[pk_field.to_python(account)] = account
            except ValidationError:
                continue  # not a primary key of this user model
        if not wanted:
            return {}
        rows = user_model._default_manager.filter(pk__in=list(wanted)).values_list(
            "pk", user_model.USERNAME_FIELD
        )
        return {wanted[pk]: f"{username} ({wanted[pk]})" for pk, username in rows if pk in wanted}


username_display = UsernameDisplay()


def accounts_by_username(term: str) -> list[str]:
    """The default ``ACCOUNT_SEARCH``: the account of the user whose username is exactly
    ``term`` (none while ``ACCOUNT`` is not the default)."""
    if not _default_account_is_the_user():
        return []
    user_model = get_user_model()
    found = user_model._default_manager.filter(**{user_model.USERNAME_FIELD: term})
    return [str(pk) for pk in found.values_list("pk", flat=True)]


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(RecordAdminBase):
    list_display = (
        "key",
        "account_shown",
        "endpoint",
        "state",
        "response_status",
        "lease_expires_at",
        "created_at",
        "expires_at",
    )
    list_filter = (
        "state",  # its choices, no query
        LeaseListFilter,
        ("endpoint", RecentValuesListFilter),
        ("response_status", RecentValuesListFilter),
        ExpiredListFilter,
    )
    # Exact, case-sensitive matches, as claims compare keys: keys are opaque, and
    # ``key = …`` and ``account = …`` use an index where ``LIKE '%…%'`` would read the whole
    # table. A term ending in ``*`` also finds the keys that start with it (get_search_results).
    search_fields = ("key__exact", "account__exact")
    search_help_text = (
        "An exact Idempotency-Key, an exact account (the user's primary key), or an exact "
        f"username; or the start of a key followed by * (at least {KEY_PREFIX_MIN} characters)."
    )
    # At 10M rows, a date hierarchy's ``SELECT DISTINCT DATE_TRUNC(…)`` reads the whole
    # table, the column sorts and the facet counts would sort or count it: none of them.
    ordering = ("-pk",)
    sortable_by = ()
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    paginator = BoundedPaginator
    # Rendering a row costs Django ~1 ms of CPU: a page of 50 keeps the list well inside
    # its budget (an operator finds records by search and filter, not by paging).
    list_per_page = 50
    fields = (
        "account_shown",
        "endpoint",
        "key",
        "state",
        "fingerprint_shown",
        "token",
        "lease_expires_at",
        "response_status",
        "stored_headers",
        "stored_response",
        "created_at",
        "completed_at",
        "expires_at",
    )
    readonly_fields = fields
    actions = ("release", "force_release", "delete_expired")
    force_release_confirmation_template = (
        "admin/idempotency_django/idempotencyrecord/force_release_confirmation.html"
    )
    overview_template = "admin/idempotency_django/idempotencyrecord/overview.html"

    def get_queryset(self, request: HttpRequest) -> QuerySet[IdempotencyRecord]:
        # The store may live in a database of its own (IDEMPOTENCY["DATABASE"]).
        return super().get_queryset(request).using(claims.store_alias())

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return RecordChangeList

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        """Only the filters' own lookups, each served by an index (``ALLOWED_LOOKUPS``). Any
        other field lookup in the query string (``?response_body__contains=``,
        ``?created_at__year=``) would read the whole table: Django answers it 400."""
        return lookup in ALLOWED_LOOKUPS

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> Any:
        return super().changelist_view(request, {**(extra_context or {}), **_notices()})

    # -- the overview ------------------------------------------------------------------------

    def get_urls(self) -> list[URLPattern]:
        overview = path(
            "overview/",
            self.admin_site.admin_view(self.overview_view),
            name=f"{self.opts.app_label}_{self.opts.model_name}_overview",
        )
        return [overview, *super().get_urls()]

    def overview_view(self, request: HttpRequest) -> TemplateResponse:
        """The overview (``overview.py``): who may see the records' list may see it; every
        panel is one bounded index read, timed on the page."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        store = get_store()
        alias = claims.store_alias()
        in_database = isinstance(store, database_store.DatabaseStore)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "Idempotency overview",
            "subtitle": None,
            "store_name": type(store).__name__,
            "in_database": in_database,
            "panels": {
                panel.name: panel
                for panel in (
                    overview.database_overview(self.get_queryset(request), store, alias)
                    if in_database
                    else []
                )
            },
            "outcomes": overview.OUTCOMES,
            "count_limit": f"{overview.COUNT_LIMIT:,}",
            "recent_limit": f"{overview.RECENT_LIMIT:,}",
            "heartbeat": overview.heartbeat_overview(),
            "changelist_url": reverse(
                f"admin:{self.opts.app_label}_{self.opts.model_name}_changelist",
                current_app=self.admin_site.name,
            ),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.overview_template, context)

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> Any:
        return super().change_view(
            request, object_id, form_url, {**(extra_context or {}), **_notices()}
        )

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: str | None = None
    ) -> IdempotencyRecord | None:
        """The record, marked with what this user may read of it (the display methods
        get the record, not the request)."""
        record = super().get_object(request, object_id, from_field)
        if record is not None:
            record.reader = str(request.user)  # type: ignore[attr-defined]
            record.may_read_body = (  # type: ignore[attr-defined]
                conf.RESPONSE_CODEC is None or request.user.has_perm(DECRYPT_PERMISSION)
            )
            label_accounts([record])
        return record

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[IdempotencyRecord], search_term: str
    ) -> tuple[QuerySet[IdempotencyRecord], bool]:
        """The exact key and account matches, and the accounts ``ACCOUNT_SEARCH`` names for
        the term (the default: the user with that exact username)."""
        results, may_have_duplicates = super().get_search_results(request, queryset, search_term)
        term = search_term.strip()
        prefix = term[:-1]
        if term.endswith("*") and len(prefix) >= KEY_PREFIX_MIN and "*" not in prefix:
            results = results | queryset.filter(database_store.key_prefix_q(prefix, queryset.db))
        search = conf.optional_callable("ACCOUNT_SEARCH")
        if term and search is not None:
            accounts = [str(account) for account in search(term)]
            if accounts:
                results = results | queryset.filter(account__in=accounts).exclude(
                    endpoint__startswith=TASK_ENDPOINT_PREFIX
                )
        return results, may_have_duplicates

    def action_checkbox(self, obj: IdempotencyRecord) -> SafeString:
        """Django's checkbox, without a form widget's template per row: the widget was a
        third of the list's rendering time."""
        label = format_html(_("Select this object for an action - {}"), str(obj))
        return format_html(
            '<input type="checkbox" name="{}" value="{}" class="action-select" aria-label="{}">',
            helpers.ACTION_CHECKBOX_NAME,
            str(obj.pk),
            label,
        )

    @admin.display(description="account", ordering="account")
    def account_shown(self, record: IdempotencyRecord) -> str:
        label = getattr(record, "account_label", None)
        return record.account if label is None else str(label)

    @admin.display(description="fingerprint")
    def fingerprint_shown(self, record: IdempotencyRecord) -> str:
        """A short prefix of the keyed digest, never a plain one (docs/security.md)."""
        return fingerprint_display(record.fingerprint)

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

    @admin.display(description="response headers")
    def stored_headers(self, record: IdempotencyRecord) -> str:
        opened = self._opened(record)
        if isinstance(opened, str):
            return opened
        return json.dumps([list(pair) for pair in opened.headers], ensure_ascii=False)

    @admin.display(description="stored response")
    def stored_response(self, record: IdempotencyRecord) -> str | SafeString:
        if record.response_body is None:
            if record.state == State.IN_PROGRESS:
                return "— (the request is in progress)"
            return "not stored (the response was streamed or over MAX_RESPONSE_BYTES)"
        opened = self._opened(record)
        if isinstance(opened, str):
            return opened
        body = opened.body
        content_type = next(
            (value for name, value in opened.headers if name.lower() == "content-type"), None
        )
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

    def _opened(self, record: IdempotencyRecord) -> StoredResponse | str:
        """The stored response as a replay would give it, or why it is not shown.

        Without a ``RESPONSE_CODEC`` everything is shown, as stored. With one, only to
        holders of ``view_decrypted_body`` (a record stored in clear before the codec
        was set too: the project has said its responses are sensitive); the others read
        "encrypted". Each decrypted view is logged.
        """
        stored = StoredResponse(
            record.response_status or 0,
            bytes(record.response_body or b""),
            [(str(name), str(value)) for name, value in record.response_headers or []],
        )
        if stored.body == codecs.UNSTORABLE:
            return "not stored (redaction or encoding failed when the request completed)"
        if not getattr(record, "may_read_body", conf.RESPONSE_CODEC is None):
            if codecs.is_sealed(stored.body):
                return "encrypted"
            return "encrypted (stored in clear before RESPONSE_CODEC was set; hidden all the same)"
        if not codecs.is_sealed(stored.body):
            return stored
        try:
            opened = codecs.unseal(
                stored, account=record.account, endpoint=record.endpoint, key=record.key
            )
        except codecs.ResponseUnreadable as error:
            if error.misbound:
                return "encrypted for another record (the row was copied or altered); not shown"
            if error.unbound:
                return (
                    "encrypted before responses were bound to their record; refused on "
                    "replay (REQUIRE_BOUND_RESPONSES), not shown"
                )
            return "encrypted, and the configured RESPONSE_CODEC cannot decrypt it"
        logger.info(
            "Idempotency stored response shown decrypted in the admin to %s.",
            signals.escape_log_text(getattr(record, "reader", "?")),
            extra=signals.log_fields(record.account, record.endpoint, record.key),
        )
        return opened

    # -- actions ------------------------------------------------------------------------------

    @admin.action(
        description="Release selected in-progress keys whose lease has lapsed (the next retry "
        "runs)",
        permissions=["delete_records"],
    )
    def release(self, request: HttpRequest, queryset: QuerySet[IdempotencyRecord]) -> None:
        """Delete the selected in-progress records whose lease has lapsed, in one statement.

        The conditions (in progress, lease null or past on the database's clock, which wrote
        it) are in the ``DELETE`` itself, so a record that a heartbeat renewed, a view
        completed or a retry took over since the page was shown is left alone. A live lease
        means a worker is renewing it: releasing it would let a retry run alongside the
        first attempt.
        """
        selected = queryset.count()
        released = _delete_returning(queryset.filter(lapsed_q(DatabaseNow())))
        self._record_releases(request, released, forced=False)
        # What the statement left, for the messages only (read after it, decides nothing).
        running = queryset.filter(_in_progress()).count()
        if released:
            self.message_user(
                request,
                f"Released {_records(len(released))}: the next retry with "
                f"{'its key' if len(released) == 1 else 'each key'} runs the view.",
                messages.SUCCESS,
            )
        if running:
            self.message_user(
                request,
                f"Skipped {_records(running)} still running: {_their(running)} lease is live, "
                "so a worker may still be running the view, and a retry now would run "
                "alongside it. A dead worker's lease lapses within LEASE_SECONDS; use "
                '"Force release" only if you know the worker is gone.',
                messages.WARNING,
            )
        skipped = selected - len(released) - running
        if skipped > 0:
            self.message_user(
                request,
                f"Skipped {_records(skipped)} not in progress: only in-progress keys can be "
                "released (a completed key keeps its stored response until it expires).",
                messages.WARNING,
            )

    @admin.action(
        description="Force release selected in-progress keys (the view may still be running)",
        permissions=["delete_records"],
    )
    def force_release(
        self, request: HttpRequest, queryset: QuerySet[IdempotencyRecord]
    ) -> TemplateResponse | None:
        """Delete in-progress records whatever their lease, after a confirmation page.

        For a worker known to be dead with a long lease (or a wedged view). The page lists
        the records; its form posts back their primary keys and claim tokens, and only
        records still under those claims are deleted: one taken over by a new attempt
        after the page was shown belongs to that attempt, which the operator never saw.
        """
        if request.POST.get("post") == "yes":
            tokens = request.POST.getlist("token")
            confirmed = queryset.filter(_in_progress(), token__in=tokens)
            released = _delete_returning(confirmed)
            self._record_releases(request, released, forced=True)
            if released:
                self.message_user(
                    request,
                    f"Force-released {_records(len(released))}: the next retry with "
                    f"{'its key' if len(released) == 1 else 'each key'} runs the view, even "
                    "if the first attempt is still running.",
                    messages.SUCCESS,
                )
            skipped = len(tokens) - len(released)
            if skipped > 0:
                self.message_user(
                    request,
                    f"Kept {_records(skipped)}: completed, released or claimed again since "
                    "the confirmation page was shown.",
                    messages.WARNING,
                )
            return None
        records = list(
            queryset.filter(_in_progress())
            .annotate(live=ExpressionWrapper(in_use_q(DatabaseNow()), BooleanField()))
            .order_by("pk")
            .only("pk", "account", "endpoint", "key", "token", "lease_expires_at")
        )
        if not records:
            self.message_user(
                request,
                "Nothing to force-release: none of the selected records is in progress.",
                messages.WARNING,
            )
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": "Force release: are you sure?",
            "subtitle": None,
            "opts": self.opts,
            "records": [{"record": record, "live": bool(record.live)} for record in records],
            "live": sum(bool(record.live) for record in records),
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "media": self.media,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.force_release_confirmation_template, context)

    def _record_releases(
        self, request: HttpRequest, released: Sequence[IdempotencyRecord], *, forced: bool
    ) -> None:
        """The admin history, the log and the ``released`` signal, for each release."""
        user_id = request.user.pk
        if released and user_id is not None:
            # The admin's history ("Deleted …"), like a delete from the admin would log. It
            # is kept forever: it names each key by its digest, never the key itself.
            LogEntry.objects.log_actions(
                user_id=user_id,
                queryset=[
                    IdempotencyRecord(
                        pk=record.pk,
                        account=record.account,
                        endpoint=record.endpoint,
                        key=signals.key_digest(record.key),
                    )
                    for record in released
                ],
                action_flag=DELETION,
                change_message=(
                    "Force-released the in-progress key (its lease may have been live)."
                    if forced
                    else "Released the in-progress key (its lease had lapsed)."
                ),
            )
        for record in released:
            logger.warning(
                "Idempotency key %s from the admin by %s; the next retry runs the view.",
                "force-released" if forced else "released",
                signals.escape_log_text(str(request.user)),
                extra=signals.log_fields(
                    record.account, record.endpoint, record.key, admin_forced=forced
                ),
            )
            signals.send(signals.released, record.account, record.endpoint, record.key)

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


#: The query-string lookups the records' list accepts: its filters' own. State, lease and
#: expiry are served by the ``(state, lease_expires_at)`` and ``expires_at`` indexes, endpoint
#: and status by ``(endpoint, id)`` and ``(response_status, id)``.
ALLOWED_LOOKUPS = frozenset(
    {
        *(
            f"{field}{lookup}"
            for field in ("state", "endpoint", "response_status")
            for lookup in ("", "__exact", "__isnull")
        ),
        LeaseListFilter.parameter_name,
        ExpiredListFilter.parameter_name,
    }
)


def _notices() -> dict[str, Any]:
    """What the list and each record's page warn of: stored bodies kept in clear, readable
    by everyone with the view permission (``bodies_in_clear.html``)."""
    return {"bodies_in_clear": conf.RESPONSE_CODEC is None}


def _records(count: int) -> str:
    return f"{count} record" if count == 1 else f"{count} records"


def _their(count: int) -> str:
    return "its" if count == 1 else "their"


def _in_progress() -> Q:
    return Q(state=State.IN_PROGRESS)
