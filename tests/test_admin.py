"""The read-only admin of idempotency records, through Django's test client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.apps import apps
from django.contrib import admin
from django.contrib.auth.models import Permission, User
from django.db.models.signals import post_init
from django.test import Client
from django.urls import path, reverse
from django.utils import timezone

from idempotency_django import engine, purge, signals
from idempotency_django.exceptions import InFlight
from idempotency_django.models import IdempotencyRecord
from tests.factories import IdempotencyRecordFactory, UserFactory


def __getattr__(name: str) -> Any:
    """``urlpatterns``: this module is the URLconf of its tests, with the admin's URLs. Built
    on first use, so that the module imports (and fails clearly) without the admin app."""
    if name == "urlpatterns":
        return [path("admin/", admin.site.urls)]
    raise AttributeError(name)


pytestmark = [pytest.mark.django_db, pytest.mark.urls(__name__)]

NEEDED = ("django.contrib.admin", "django.contrib.sessions", "django.contrib.messages")


@pytest.fixture(autouse=True)
def _admin_installed() -> None:
    missing = [name for name in NEEDED if not apps.is_installed(name)]
    if missing:
        pytest.fail(
            f"tests/settings.py must install {', '.join(missing)} (with the session, auth and "
            "messages middleware and a DjangoTemplates backend) for the admin tests."
        )


State = IdempotencyRecord.State
CHANGELIST = "admin:idempotency_django_idempotencyrecord_changelist"
CHANGE = "admin:idempotency_django_idempotencyrecord_change"
ADD = "admin:idempotency_django_idempotencyrecord_add"
DELETE = "admin:idempotency_django_idempotencyrecord_delete"


def login(user: User) -> Client:
    """A client logged in as ``user``: by session, and by the test suite's ``X-User`` header
    (``tests.middleware``), whichever of the two the middleware order lets decide."""
    client = Client(headers={"X-User": user.username})
    client.force_login(user)
    return client


@pytest.fixture
def superuser() -> User:
    return UserFactory(username="root", is_staff=True, is_superuser=True)


@pytest.fixture
def client_(superuser: User) -> Client:
    return login(superuser)


def completed(**kwargs: Any) -> IdempotencyRecord:
    values = {
        "state": State.COMPLETED,
        "lease_expires_at": None,
        "response_status": 201,
        "response_body": b'{"stored": true}',
        "response_headers": [["Content-Type", "application/json"]],
        "completed_at": timezone.now(),
        **kwargs,
    }
    return IdempotencyRecordFactory(**values)


def stuck(**kwargs: Any) -> IdempotencyRecord:
    """In progress, with a lease that a (wedged) worker keeps renewing."""
    return IdempotencyRecordFactory(
        lease_expires_at=timezone.now() + timedelta(minutes=5), **kwargs
    )


def expired(**kwargs: Any) -> IdempotencyRecord:
    now = timezone.now()
    return completed(
        created_at=now - timedelta(days=2), expires_at=now - timedelta(days=1), **kwargs
    )


def listed(client: Client, **params: str) -> set[str]:
    response = client.get(reverse(CHANGELIST), params)
    assert response.status_code == 200
    return {record.key for record in response.context["cl"].result_list}


def run_action(client: Client, action: str, *records: IdempotencyRecord, **extra: str) -> Any:
    data = {"action": action, "_selected_action": [str(r.pk) for r in records], **extra}
    return client.post(reverse(CHANGELIST), data, follow=True)


def messages_of(response: Any) -> list[tuple[str, str]]:
    return [(m.level_tag, m.message) for m in response.context["messages"]]


@pytest.fixture
def released_reports() -> Iterator[list[dict[str, Any]]]:
    reports: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        reports.append(kwargs)

    signals.released.connect(receiver)
    yield reports
    signals.released.disconnect(receiver)


# --- list, filters, search ---------------------------------------------------------------------


def test_changelist_shows_the_columns(client_: Client) -> None:
    completed(key="order-42", account="7", endpoint="POST /charges/", response_status=402)
    stuck(key="order-43", account="8")

    response = client_.get(reverse(CHANGELIST))

    assert response.status_code == 200
    html = response.content.decode()
    for text in ("order-42", "order-43", "POST /charges/", "in progress", "completed", "402"):
        assert text in html
    columns = response.context["cl"].list_display
    assert columns == [
        "action_checkbox",
        "key",
        "account",
        "endpoint",
        "state",
        "response_status",
        "created_at",
        "expires_at",
    ]
    assert response.context["cl"].date_hierarchy == "created_at"
    assert "created_at__year=" in html  # the date drill-down's links


def test_date_hierarchy_drills_down_by_creation_date(client_: Client) -> None:
    today = timezone.localdate()
    completed(key="today")
    completed(key="last-year", created_at=timezone.now() - timedelta(days=400))

    assert listed(
        client_, created_at__year=str(today.year), created_at__month=str(today.month)
    ) == {"today"}


def test_filter_by_state(client_: Client) -> None:
    completed(key="done")
    stuck(key="running")

    assert listed(client_, state__exact="in_progress") == {"running"}
    assert listed(client_, state__exact="completed") == {"done"}


def test_filter_by_endpoint(client_: Client) -> None:
    completed(key="charge", endpoint="POST /charges/")
    completed(key="refund", endpoint="POST /refunds/")

    response = client_.get(reverse(CHANGELIST))
    assert "POST /refunds/" in response.content.decode()  # offered as a choice
    assert listed(client_, endpoint="POST /charges/") == {"charge"}


def test_filter_by_response_status(client_: Client) -> None:
    completed(key="created", response_status=201)
    completed(key="declined", response_status=402)
    stuck(key="running")

    assert listed(client_, response_status="402") == {"declined"}
    assert listed(client_, response_status__isnull="True") == {"running"}


def test_filter_expired(client_: Client) -> None:
    expired(key="old")
    completed(key="fresh")

    assert listed(client_, expired="yes") == {"old"}
    assert listed(client_, expired="no") == {"fresh"}
    assert listed(client_) == {"old", "fresh"}


def test_search_by_exact_key_or_account(client_: Client) -> None:
    completed(key="order-42", account="7")
    completed(key="order-420", account="8")
    completed(key="other", account="77")

    assert listed(client_, q="order-42") == {"order-42"}
    assert listed(client_, q="7") == {"order-42"}
    assert listed(client_, q="order") == set()
    assert listed(client_, q="ORDER-42") == set()  # keys are case-sensitive


# --- detail: read-only, with the stored response shown readably ----------------------------------


def test_detail_is_read_only(client_: Client) -> None:
    record = completed(key="order-42")

    response = client_.get(reverse(CHANGE, args=[record.pk]))

    assert response.status_code == 200
    html = response.content.decode()
    assert "order-42" in html
    assert 'name="key"' not in html
    assert 'name="fingerprint"' not in html
    assert 'name="state"' not in html
    assert 'name="_save"' not in html
    assert response.context["has_change_permission"] is False


def test_no_add_no_edit_no_generic_delete(client_: Client) -> None:
    record = completed(key="order-42", response_status=201)

    assert client_.get(reverse(ADD)).status_code == 403
    posted = client_.post(
        reverse(CHANGE, args=[record.pk]),
        {"key": "changed", "state": "in_progress", "fingerprint": "f" * 64, "response_status": 500},
    )
    assert posted.status_code == 403
    assert client_.post(reverse(DELETE, args=[record.pk]), {"post": "yes"}).status_code == 403
    record.refresh_from_db()
    assert (record.key, record.state, record.response_status) == ("order-42", State.COMPLETED, 201)


def test_stored_json_response_is_pretty_printed(client_: Client) -> None:
    body = {"id": "ch_1", "amount": 1000, "note": "<script>x</script> €"}
    record = completed(
        response_body=json.dumps(body, separators=(",", ":")).encode(),
        response_headers=[["Content-Type", "application/json; charset=utf-8"]],
    )

    html = client_.get(reverse(CHANGE, args=[record.pk])).content.decode()

    assert "<pre" in html
    assert "  &quot;amount&quot;: 1000,\n" in html  # indented, one member per line
    assert "&lt;script&gt;x&lt;/script&gt; €" in html  # escaped, and readable
    assert "<script>x</script>" not in html


@pytest.mark.parametrize(
    ("body", "headers", "shown"),
    [
        (b'{"type": "about:blank"}', [["Content-Type", "application/problem+json"]], "<pre"),
        (b"hello", [["Location", "/x"], ["Content-Type", "text/plain"]], "5 bytes of text/plain"),
        (b"\x89PNG\r\n", [], "6 bytes"),
        (b"{not json", [["Content-Type", "application/json"]], "9 bytes of application/json"),
        (b"\xff\xfe", [["content-type", "application/json"]], "2 bytes of application/json"),
        (None, [], "not stored (the response was streamed or over MAX_RESPONSE_BYTES)"),
    ],
)
def test_stored_response_display(
    client_: Client, body: bytes | None, headers: list[list[str]], shown: str
) -> None:
    record = completed(response_body=body, response_headers=headers)

    html = client_.get(reverse(CHANGE, args=[record.pk])).content.decode()

    assert shown in html
    if shown != "<pre":
        assert '<pre class="stored-response">' not in html


def test_in_progress_record_has_no_response_yet() -> None:
    record = stuck()
    shown = admin.site.get_model_admin(IdempotencyRecord).stored_response(record)
    assert shown == "— (the request is in progress)"


# --- actions -------------------------------------------------------------------------------------


def test_release_deletes_a_stuck_key_so_the_next_retry_runs(
    client_: Client, superuser: User, released_reports: list[dict[str, Any]]
) -> None:
    record = stuck(key="order-42", account="7", endpoint="POST /charges/")
    scope = engine.Scope("7", "POST /charges/", "order-42")
    options = engine.Options("default", 10, 86400, "conflict", 0, 1)
    with pytest.raises(InFlight):
        engine.begin(scope, record.fingerprint, options)

    response = run_action(client_, "release", record)

    assert response.status_code == 200
    assert messages_of(response) == [
        ("success", "Released 1 record: the next retry with its key runs the view.")
    ]
    assert not IdempotencyRecord.objects.filter(pk=record.pk).exists()
    assert released_reports == [{"signal": signals.released, **scope.lookup()}]
    from django.contrib.admin.models import DELETION, LogEntry

    entry = LogEntry.objects.get()
    assert (entry.action_flag, entry.user_id, entry.object_id) == (
        DELETION,
        superuser.pk,
        str(record.pk),
    )
    # The next retry with the key claims it and runs.
    assert isinstance(engine.begin(scope, record.fingerprint, options), engine.Claim)


def test_release_skips_completed_records(
    client_: Client, released_reports: list[dict[str, Any]]
) -> None:
    running = [stuck(key="a"), stuck(key="b")]
    done = completed(key="c")

    response = run_action(client_, "release", *running, done)

    assert messages_of(response) == [
        ("success", "Released 2 records: the next retry with each key runs the view."),
        (
            "warning",
            "Skipped 1 record not in progress: only in-progress keys can be released (a "
            "completed key keeps its stored response until it expires).",
        ),
    ]
    assert set(IdempotencyRecord.objects.values_list("key", flat=True)) == {"c"}
    assert [report["key"] for report in released_reports] == ["a", "b"]


def test_release_keeps_a_record_that_completed_after_it_was_read(client_: Client) -> None:
    """The release is conditional: a view that completed in the meantime keeps its outcome."""
    record = stuck(key="finishing")

    def complete_it(sender: Any, instance: IdempotencyRecord, **kwargs: Any) -> None:
        if instance.pk == record.pk:  # the action has just read it
            IdempotencyRecord.objects.filter(pk=record.pk).update(
                state=State.COMPLETED, response_status=201, lease_expires_at=None
            )

    post_init.connect(complete_it, sender=IdempotencyRecord)
    try:
        response = run_action(client_, "release", record)
    finally:
        post_init.disconnect(complete_it, sender=IdempotencyRecord)

    assert [level for level, _ in messages_of(response)] == ["warning"]
    assert IdempotencyRecord.objects.get(pk=record.pk).state == State.COMPLETED


def test_release_of_only_completed_records_releases_nothing(client_: Client) -> None:
    done = completed(key="c")

    response = run_action(client_, "release", done)

    assert [level for level, _ in messages_of(response)] == ["warning"]
    assert IdempotencyRecord.objects.filter(pk=done.pk).exists()
    from django.contrib.admin.models import LogEntry

    assert not LogEntry.objects.exists()


def test_delete_expired_deletes_only_expired_selected_records(client_: Client) -> None:
    old = expired(key="old")
    old_running = stuck(key="old-running", expires_at=timezone.now() - timedelta(hours=1))
    fresh = completed(key="fresh")
    unselected = expired(key="not-selected")
    reports: list[dict[str, Any]] = []
    purge.purged.connect(lambda sender, **kwargs: reports.append(kwargs), weak=False)
    try:
        response = run_action(client_, "delete_expired", old, old_running, fresh)
    finally:
        purge.purged.receivers.clear()

    assert messages_of(response) == [
        ("success", "Deleted 1 record past its expiry."),
        ("warning", "Kept 2 records not yet expired (or still in progress)."),
    ]
    assert set(IdempotencyRecord.objects.values_list("key", flat=True)) == {
        old_running.key,
        fresh.key,
        unselected.key,
    }
    assert old.key not in {r.key for r in IdempotencyRecord.objects.all()}
    assert [(r["expired"], r["stale"]) for r in reports] == [(1, 0)]


def test_delete_expired_across_all_filtered_records(client_: Client) -> None:
    expired(key="old-1")
    expired(key="old-2")
    completed(key="fresh")
    shown = expired(key="old-3")

    response = client_.post(
        reverse(CHANGELIST) + "?expired=yes",
        {"action": "delete_expired", "select_across": "1", "_selected_action": [str(shown.pk)]},
        follow=True,
    )

    assert ("success", "Deleted 3 records past their expiry.") in messages_of(response)
    assert set(IdempotencyRecord.objects.values_list("key", flat=True)) == {"fresh"}


def test_actions_offered(client_: Client) -> None:
    completed()

    response = client_.get(reverse(CHANGELIST))

    choices = [name for name, _ in response.context["action_form"].fields["action"].choices]
    assert choices == ["", "release", "delete_expired"]  # no generic "delete selected"


def test_actions_need_the_delete_permission() -> None:
    viewer = UserFactory(username="viewer", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_idempotencyrecord"))
    record = stuck(key="stuck")
    client = login(viewer)

    response = client.get(reverse(CHANGELIST))
    assert response.status_code == 200
    assert "stuck" in response.content.decode()
    assert response.context["action_form"] is None or [
        name for name, _ in response.context["action_form"].fields["action"].choices
    ] == [""]
    run_action(client, "release", record)
    assert IdempotencyRecord.objects.filter(pk=record.pk).exists()

    viewer.user_permissions.add(Permission.objects.get(codename="delete_idempotencyrecord"))
    client = login(User.objects.get(pk=viewer.pk))
    run_action(client, "release", record)
    assert not IdempotencyRecord.objects.filter(pk=record.pk).exists()
