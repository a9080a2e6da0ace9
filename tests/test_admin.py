"""The read-only admin of idempotency records, through Django's test client."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.apps import apps
from django.contrib import admin
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.auth.models import Permission, User
from django.db import connections
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import path, reverse
from django.utils import timezone

from idempotency_django import signals
from idempotency_django.core import claims, codecs, keys, shell
from idempotency_django.exceptions import InFlight
from idempotency_django.models import IdempotencyRecord
from idempotency_django.operations import admin as idempotency_admin
from idempotency_django.operations import purge
from idempotency_django.responses import StoredResponse
from idempotency_django.store import database as database_store
from tests.conftest import Skew
from tests.project.factories import IdempotencyRecordFactory, UserFactory
from tests.project.logs import everything_logged
from tests.records import ON_STORE_CLOCK


def __getattr__(name: str) -> Any:
    """``urlpatterns``: this module is the URLconf of its tests, with the admin's URLs. Built
    on first use, so that the module imports (and fails clearly) without the admin app."""
    if name == "urlpatterns":
        return [path("admin/", admin.site.urls)]
    raise AttributeError(name)


pytestmark = [
    pytest.mark.django_db,
    pytest.mark.urls(__name__),
    pytest.mark.database_store("the admin browses database rows (the Redis store has no admin)"),
]

NEEDED = ("django.contrib.admin", "django.contrib.sessions", "django.contrib.messages")


@pytest.fixture(autouse=True)
def _admin_installed() -> None:
    missing = [name for name in NEEDED if not apps.is_installed(name)]
    if missing:
        pytest.fail(
            f"tests/project/settings.py must install {', '.join(missing)} (with the session, auth "
            "and messages middleware and a DjangoTemplates backend) for the admin tests."
        )


State = IdempotencyRecord.State
on_the_databases_clock = pytest.mark.skipif(
    not ON_STORE_CLOCK,
    reason="SQLite keeps this process's clock: one machine, one clock",
)
CHANGELIST = "admin:idempotency_django_idempotencyrecord_changelist"
CHANGE = "admin:idempotency_django_idempotencyrecord_change"
ADD = "admin:idempotency_django_idempotencyrecord_add"
DELETE = "admin:idempotency_django_idempotencyrecord_delete"


def login(user: User) -> Client:
    """A client logged in as ``user``: by session, and by the test suite's ``X-User`` header
    (``tests.project.middleware``), whichever of the two the middleware order lets decide."""
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


def abandoned(**kwargs: Any) -> IdempotencyRecord:
    """In progress, with a lease that lapsed: its worker died (or lost its connection)."""
    return IdempotencyRecordFactory(
        lease_expires_at=timezone.now() - timedelta(seconds=1), **kwargs
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
        reports.append({**kwargs, "key": signals.raw_key()})  # the key itself, asked for

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
        "account_shown",
        "endpoint",
        "state",
        "response_status",
        "lease_expires_at",
        "created_at",
        "expires_at",
    ]
    assert "2 idempotency records" in html  # counted


def test_the_list_is_newest_first_by_pages(client_: Client, settings: Any) -> None:
    for number in range(60):
        completed(key=f"k{number:02}")

    first = client_.get(reverse(CHANGELIST))
    second = client_.get(reverse(CHANGELIST), {"p": "2"})

    assert [r.key for r in first.context["cl"].result_list] == [
        f"k{n:02}" for n in range(59, 9, -1)
    ]
    assert [r.key for r in second.context["cl"].result_list] == [
        f"k{n:02}" for n in range(9, -1, -1)
    ]
    assert "60 idempotency records" in first.content.decode()


def test_past_the_count_limit_the_list_says_more_than(
    client_: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The paginator stops counting at COUNT_LIMIT (10,000): it says "more than", and the
    last page it offers is the last one counted."""
    monkeypatch.setattr(idempotency_admin.BoundedPaginator, "COUNT_LIMIT", 3)
    for number in range(5):
        completed(key=f"k{number}", endpoint="POST /charges/" if number else "POST /refunds/")

    response = client_.get(reverse(CHANGELIST))
    filtered = client_.get(reverse(CHANGELIST), {"endpoint": "POST /charges/"})

    assert response.context["cl"].paginator.more
    assert "more than 3 idempotency records" in response.content.decode()
    assert response.context["cl"].paginator.num_pages == 1
    assert "more than 3 idempotency records" in filtered.content.decode()
    assert "in all" not in filtered.content.decode()  # no estimate for a filtered list


def test_no_date_hierarchy_column_sorts_or_facets(client_: Client) -> None:
    """Each would read the whole table: ``SELECT DISTINCT DATE_TRUNC``, a sort of every
    row, a ``COUNT`` per choice."""
    completed(key="k")

    response = client_.get(reverse(CHANGELIST), {"_facets": "1"})

    cl = response.context["cl"]
    assert cl.date_hierarchy is None
    assert cl.sortable_by == ()
    assert not cl.add_facets
    assert 'class="sortable' not in response.content.decode()


def test_filter_by_state(client_: Client) -> None:
    completed(key="done")
    stuck(key="running")

    assert listed(client_, state__exact="in_progress") == {"running"}
    assert listed(client_, state__exact="completed") == {"done"}


def filter_choices(response: Any, field: str) -> list[Any]:
    specs = response.context["cl"].filter_specs
    (spec,) = [s for s in specs if getattr(s, "lookup_kwarg", None) == field]
    return list(spec.lookup_choices)


def test_filter_by_lease(client_: Client) -> None:
    completed(key="done")
    stuck(key="running")
    abandoned(key="dead")
    IdempotencyRecordFactory(key="no-lease", lease_expires_at=None)

    assert listed(client_, lease="lapsed") == {"dead", "no-lease"}
    assert listed(client_, lease="live") == {"running"}


def test_filter_by_endpoint(client_: Client) -> None:
    completed(key="charge", endpoint="POST /charges/")
    completed(key="refund", endpoint="POST /refunds/")

    response = client_.get(reverse(CHANGELIST))
    assert "POST /refunds/" in response.content.decode()  # offered as a choice
    assert listed(client_, endpoint="POST /charges/") == {"charge"}


def test_filters_offer_the_values_of_the_latest_records_and_the_chosen_one(
    client_: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a DISTINCT over the table: the values of the latest RECENT records, plus the
    one in the URL (a value only older records have still filters)."""
    monkeypatch.setattr(idempotency_admin.RecentValuesListFilter, "RECENT", 2)
    completed(key="old", endpoint="POST /old/", response_status=402)
    completed(key="new-1", endpoint="POST /new/")
    completed(key="new-2", endpoint="POST /new/")

    plain = client_.get(reverse(CHANGELIST))
    chosen = client_.get(reverse(CHANGELIST), {"endpoint": "POST /old/"})

    assert filter_choices(plain, "endpoint") == ["POST /new/"]
    assert filter_choices(plain, "response_status") == [201]
    assert filter_choices(chosen, "endpoint") == ["POST /new/", "POST /old/"]
    assert "?endpoint=POST+%2Fold%2F" in chosen.content.decode()  # offered, and selected
    assert listed(client_, endpoint="POST /old/") == {"old"}
    assert listed(client_, response_status="402") == {"old"}


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


def test_expired_records_are_listed_latest_expiry_first(client_: Client) -> None:
    """By the ``expires_at`` index: newest first would pass over every unexpired record."""
    now = timezone.now()
    for key, ago in (("long-ago", 3 * 86400), ("just-now", 5), ("yesterday", 86400)):
        completed(
            key=key, created_at=now - timedelta(days=4), expires_at=now - timedelta(seconds=ago)
        )

    response = client_.get(reverse(CHANGELIST), {"expired": "yes"})

    keys = [record.key for record in response.context["cl"].result_list]
    assert keys == ["just-now", "yesterday", "long-ago"]


def test_search_by_exact_key_or_account(client_: Client) -> None:
    completed(key="order-42", account="7")
    completed(key="order-420", account="8")
    completed(key="other", account="77")

    assert listed(client_, q="order-42") == {"order-42"}
    assert listed(client_, q="7") == {"order-42"}
    assert listed(client_, q="order") == set()
    assert listed(client_, q="ORDER-42") == set()  # keys are case-sensitive


def test_search_by_key_prefix(client_: Client) -> None:
    completed(key="order-42")
    completed(key="order-420")
    completed(key="Order-43")
    completed(key="ord%r-1")

    assert listed(client_, q="order-4*") == {"order-42", "order-420"}
    assert listed(client_, q="order-42*") == {"order-42", "order-420"}
    assert listed(client_, q="ord%*") == {"ord%r-1"}  # a LIKE wildcard is a character
    assert listed(client_, q="ord*") == set()  # shorter than KEY_PREFIX_MIN: exact only
    assert listed(client_, q="or*er*") == set()


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


def test_detail_shows_no_plain_fingerprint_and_a_short_prefix_of_a_keyed_one(
    client_: Client,
) -> None:
    """A plain digest of a short body (a PIN) is guessed back in milliseconds: the admin
    shows none, and of a keyed one only a prefix and which key it was keyed with."""
    plain_digest = hashlib.sha256(b"4821").hexdigest()
    unkeyed = completed(key="unkeyed", fingerprint="2:" + plain_digest)
    keyed_value = str(keys.custom_fingerprint("4821"))
    keyed_record = completed(key="keyed", fingerprint=keyed_value)

    unkeyed_html = client_.get(reverse(CHANGE, args=[unkeyed.pk])).content.decode()
    keyed_html = client_.get(reverse(CHANGE, args=[keyed_record.pk])).content.decode()

    assert plain_digest not in unkeyed_html
    assert "written by an earlier release, unkeyed: not shown" in unkeyed_html
    assert keyed_value not in keyed_html
    assert keyed_value[10:] not in keyed_html
    assert f"{keyed_value[10:22]}… (keyed with SECRET_KEY, id {keyed_value[2:10]})" in keyed_html


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


def test_release_deletes_an_abandoned_key_so_the_next_retry_runs(
    client_: Client, superuser: User, released_reports: list[dict[str, Any]]
) -> None:
    record = abandoned(key="order-42", account="7", endpoint="POST /charges/")
    scope = claims.Scope("7", "POST /charges/", "order-42")
    options = claims.ClaimPolicy("default", 10, 86400, "conflict", 0, 1)

    response = run_action(client_, "release", record)

    assert response.status_code == 200
    assert messages_of(response) == [
        ("success", "Released 1 record: the next retry with its key runs the view.")
    ]
    assert not IdempotencyRecord.objects.filter(pk=record.pk).exists()
    assert released_reports == [{"signal": signals.released, **scope.lookup()}]
    entry = LogEntry.objects.get()
    assert (entry.action_flag, entry.user_id, entry.object_id, entry.object_repr) == (
        DELETION,
        superuser.pk,
        str(record.pk),
        f"{signals.key_digest('order-42')} (7, POST /charges/)",  # kept forever: no key
    )
    # The next retry with the key claims it and runs.
    assert isinstance(shell.claim_or_replay(scope, record.fingerprint, options), claims.Claim)


def test_release_skips_a_key_whose_lease_is_live(
    client_: Client, released_reports: list[dict[str, Any]]
) -> None:
    """A live lease: a worker is renewing it. A retry would run alongside it."""
    running = stuck(key="order-42", account="7", endpoint="POST /charges/")
    scope = claims.Scope("7", "POST /charges/", "order-42")
    options = claims.ClaimPolicy("default", 10, 86400, "conflict", 0, 1)

    response = run_action(client_, "release", running)

    assert messages_of(response) == [
        (
            "warning",
            "Skipped 1 record still running: its lease is live, so a worker may still be "
            "running the view, and a retry now would run alongside it. A dead worker's lease "
            'lapses within LEASE_SECONDS; use "Force release" only if you know the worker '
            "is gone.",
        )
    ]
    assert IdempotencyRecord.objects.filter(pk=running.pk).exists()
    assert released_reports == []
    assert not LogEntry.objects.exists()
    with pytest.raises(InFlight):  # the key is still the running attempt's
        shell.claim_or_replay(scope, running.fingerprint, options)


@on_the_databases_clock
def test_release_by_a_server_whose_clock_runs_ahead_skips_a_live_lease(
    client_: Client, skew: Skew
) -> None:
    """The lease ends in 10 s by the database's clock, which wrote it; this server's clock
    is two minutes ahead, and its release leaves the key to the running worker."""
    running = IdempotencyRecordFactory(lease_expires_at=timezone.now() + timedelta(seconds=10))
    skew.seconds = 120

    response = run_action(client_, "release", running)

    assert [level for level, _ in messages_of(response)] == ["warning"]
    assert IdempotencyRecord.objects.filter(pk=running.pk).exists()


@on_the_databases_clock
def test_force_release_by_a_server_whose_clock_runs_ahead_shows_a_live_lease(
    client_: Client, skew: Skew
) -> None:
    running = IdempotencyRecordFactory(lease_expires_at=timezone.now() + timedelta(seconds=10))
    skew.seconds = 120

    html = run_action(client_, "force_release", running).content.decode()

    assert "1 of them still has a live lease" in html
    assert "live: the view may still be running" in html


def test_release_frees_a_record_without_a_lease(client_: Client) -> None:
    """``lease_expires_at`` NULL (no lease at all) counts as lapsed."""
    record = IdempotencyRecordFactory(lease_expires_at=None)

    run_action(client_, "release", record)

    assert not IdempotencyRecord.objects.filter(pk=record.pk).exists()


def test_release_reports_what_it_skipped_and_why(
    client_: Client, released_reports: list[dict[str, Any]]
) -> None:
    dead = [abandoned(key="a"), abandoned(key="b")]
    running = [stuck(key="c"), stuck(key="d")]
    done = completed(key="e")

    response = run_action(client_, "release", *dead, *running, done)

    assert messages_of(response) == [
        ("success", "Released 2 records: the next retry with each key runs the view."),
        (
            "warning",
            "Skipped 2 records still running: their lease is live, so a worker may still be "
            "running the view, and a retry now would run alongside it. A dead worker's lease "
            'lapses within LEASE_SECONDS; use "Force release" only if you know the worker '
            "is gone.",
        ),
        (
            "warning",
            "Skipped 1 record not in progress: only in-progress keys can be released (a "
            "completed key keeps its stored response until it expires).",
        ),
    ]
    assert set(IdempotencyRecord.objects.values_list("key", flat=True)) == {"c", "d", "e"}
    assert sorted(report["key"] for report in released_reports) == ["a", "b"]


def delete_statements(queries: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in queries if q["sql"].lstrip().upper().startswith("DELETE")]


def test_release_is_one_delete_that_checks_state_and_lease_itself(client_: Client) -> None:
    records = [abandoned(key="a"), abandoned(key="b"), stuck(key="c")]

    with CaptureQueriesContext(connections["default"]) as queries:
        run_action(client_, "release", *records)

    (delete,) = delete_statements(queries)
    assert "lease_expires_at" in delete
    assert "state" in delete
    assert set(IdempotencyRecord.objects.values_list("key", flat=True)) == {"c"}


@pytest.mark.parametrize(
    "meanwhile",
    [
        # A timedelta counts from the change (a time taken at collection may have passed).
        pytest.param({"lease_expires_at": timedelta(minutes=1)}, id="renewed"),
        pytest.param(
            {"state": State.COMPLETED, "response_status": 201, "lease_expires_at": None},
            id="completed",
        ),
    ],
)
def test_release_keeps_a_record_that_changed_just_before_its_delete(
    client_: Client, meanwhile: dict[str, Any], released_reports: list[dict[str, Any]]
) -> None:
    """The conditions are the DELETE's own: a heartbeat that renewed the lease, or a view
    that completed, right before the statement runs (after anything the action read)
    keeps its record. A read-then-delete would delete it."""
    record = abandoned(key="racing")

    def change_it_first(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if sql.lstrip().upper().startswith("DELETE"):
            changes = {
                name: timezone.now() + value if isinstance(value, timedelta) else value
                for name, value in meanwhile.items()
            }
            IdempotencyRecord.objects.filter(pk=record.pk).update(**changes)
        return execute(sql, params, many, context)

    with connections["default"].execute_wrapper(change_it_first):
        response = run_action(client_, "release", record)

    assert [level for level, _ in messages_of(response)] == ["warning"]
    assert IdempotencyRecord.objects.filter(pk=record.pk).exists()
    assert released_reports == []


def test_release_of_only_completed_records_releases_nothing(client_: Client) -> None:
    done = completed(key="c")

    response = run_action(client_, "release", done)

    assert [level for level, _ in messages_of(response)] == ["warning"]
    assert IdempotencyRecord.objects.filter(pk=done.pk).exists()
    assert not LogEntry.objects.exists()


def test_release_across_all_filtered_records(client_: Client) -> None:
    abandoned(key="a", endpoint="POST /charges/")
    abandoned(key="b", endpoint="POST /charges/")
    abandoned(key="other", endpoint="POST /refunds/")
    shown = stuck(key="c", endpoint="POST /charges/")

    response = client_.post(
        reverse(CHANGELIST) + "?endpoint=POST+%2Fcharges%2F",
        {"action": "release", "select_across": "1", "_selected_action": [str(shown.pk)]},
        follow=True,
    )

    assert messages_of(response)[0] == (
        "success",
        "Released 2 records: the next retry with each key runs the view.",
    )
    assert set(IdempotencyRecord.objects.values_list("key", flat=True)) == {"c", "other"}


def test_releases_are_logged_through_log_fields(
    client_: Client, caplog: pytest.LogCaptureFixture, settings: Any
) -> None:
    settings.IDEMPOTENCY = {"LOG_KEYS": "hash"}
    record = abandoned(key="order-4711", account="7", endpoint="POST /charges/\r\nforged")

    with caplog.at_level(logging.DEBUG, logger="idempotency_django"):
        run_action(client_, "release", record)

    (logged,) = [r for r in caplog.records if "from the admin" in r.getMessage()]
    assert logged.getMessage() == (
        "Idempotency key released from the admin by root; the next retry runs the view."
    )
    assert logged.idempotency_key == signals.log_key("order-4711")  # type: ignore[attr-defined]
    assert logged.idempotency_account == "7"  # type: ignore[attr-defined]
    assert logged.idempotency_endpoint == "POST /charges/\\r\\nforged"  # type: ignore[attr-defined]
    assert logged.idempotency_admin_forced is False  # type: ignore[attr-defined]
    assert not [text for text in everything_logged(caplog.records) if "order-4711" in text]


# --- force release -------------------------------------------------------------------------------


CONFIRMATION = "admin/idempotency_django/idempotencyrecord/force_release_confirmation.html"


def test_force_release_asks_for_confirmation_first(client_: Client) -> None:
    running = stuck(key="running", account="7")
    dead = abandoned(key="dead")
    done = completed(key="done")

    response = run_action(client_, "force_release", running, dead, done)

    assert response.status_code == 200
    assert CONFIRMATION in [t.name for t in response.templates]
    html = response.content.decode()
    assert "running" in html
    assert "dead" in html
    assert ">done<" not in html  # not in progress: not offered
    assert "1 of them still has a live lease" in html
    assert "live: the view may still be running" in html
    assert 'name="post" value="yes"' in html
    assert f'name="token" value="{running.token}"' in html
    assert f'name="token" value="{dead.token}"' in html
    assert "Yes, force-release 2 records" in html
    # Nothing is deleted until the operator confirms.
    assert IdempotencyRecord.objects.count() == 3
    assert not LogEntry.objects.exists()


def confirm_force_release(client: Client, *records: IdempotencyRecord) -> Any:
    return client.post(
        reverse(CHANGELIST),
        {
            "action": "force_release",
            "_selected_action": [str(r.pk) for r in records],
            "token": [r.token for r in records],
            "post": "yes",
        },
        follow=True,
    )


def test_force_release_deletes_in_progress_records_whatever_their_lease(
    client_: Client,
    superuser: User,
    released_reports: list[dict[str, Any]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    running = stuck(key="running")
    dead = abandoned(key="dead")
    done = completed(key="done")

    with caplog.at_level(logging.WARNING, logger="idempotency_django"):
        response = confirm_force_release(client_, running, dead, done)

    assert messages_of(response) == [
        (
            "success",
            "Force-released 2 records: the next retry with each key runs the view, even if "
            "the first attempt is still running.",
        ),
        # Not offered by the confirmation page, and never deleted if posted anyway.
        (
            "warning",
            "Kept 1 record: completed, released or claimed again since the confirmation "
            "page was shown.",
        ),
    ]
    assert set(IdempotencyRecord.objects.values_list("key", flat=True)) == {"done"}
    assert sorted(report["key"] for report in released_reports) == ["dead", "running"]
    assert sorted(LogEntry.objects.values_list("object_id", flat=True)) == sorted(
        [str(running.pk), str(dead.pk)]
    )
    assert {e.change_message for e in LogEntry.objects.all()} == {
        "Force-released the in-progress key (its lease may have been live)."
    }
    logged = [r for r in caplog.records if "force-released from the admin" in r.getMessage()]
    assert sorted(r.idempotency_key for r in logged) == ["dead", "running"]  # type: ignore[attr-defined]
    assert all(r.idempotency_admin_forced is True for r in logged)  # type: ignore[attr-defined]


def test_force_release_keeps_a_record_claimed_again_after_the_confirmation_page(
    client_: Client,
) -> None:
    """The confirmation names the claims shown: a record that a new attempt took over
    since then belongs to that attempt, which the operator never saw."""
    shown = abandoned(key="taken-over")
    IdempotencyRecord.objects.filter(pk=shown.pk).update(
        token="f" * 32, lease_expires_at=timezone.now() + timedelta(minutes=1)
    )

    response = confirm_force_release(client_, shown)  # with the token the page showed

    assert messages_of(response) == [
        (
            "warning",
            "Kept 1 record: completed, released or claimed again since the confirmation "
            "page was shown.",
        )
    ]
    assert IdempotencyRecord.objects.get(pk=shown.pk).token == "f" * 32


def test_force_release_with_nothing_in_progress(client_: Client) -> None:
    done = completed(key="done")

    response = run_action(client_, "force_release", done)

    assert CONFIRMATION not in [t.name for t in response.templates]
    assert messages_of(response) == [
        ("warning", "Nothing to force-release: none of the selected records is in progress.")
    ]
    assert IdempotencyRecord.objects.filter(pk=done.pk).exists()


def test_force_release_needs_the_delete_permission() -> None:
    viewer = UserFactory(username="viewer", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_idempotencyrecord"))
    record = stuck(key="stuck")
    client = login(viewer)

    asked = run_action(client, "force_release", record)
    confirmed = confirm_force_release(client, record)

    assert CONFIRMATION not in [t.name for t in asked.templates]
    assert confirmed.status_code == 200
    assert IdempotencyRecord.objects.filter(pk=record.pk).exists()
    assert not LogEntry.objects.exists()


# --- the one conditional DELETE ------------------------------------------------------------------


@pytest.mark.parametrize("returning", [True, False], ids=["returning", "lock-then-delete"])
def test_delete_returning_returns_exactly_what_it_deleted(
    returning: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both paths: ``DELETE … RETURNING``, and MySQL's lock-then-delete in a transaction."""
    if returning and not database_store.deletes_returning(connections["default"]):
        pytest.skip("this database cannot DELETE … RETURNING")
    monkeypatch.setattr(database_store, "deletes_returning", lambda connection: returning)
    gone = [abandoned(key="a", account="1"), abandoned(key="b", account="2")]
    kept = stuck(key="c")
    records = IdempotencyRecord.objects.filter(pk__in=[r.pk for r in [*gone, kept]])

    deleted = idempotency_admin._delete_returning(
        records.filter(lease_expires_at__lte=timezone.now())
    )

    assert sorted((r.pk, r.account, r.endpoint, r.key) for r in deleted) == sorted(
        (r.pk, r.account, r.endpoint, r.key) for r in gone
    )
    assert list(IdempotencyRecord.objects.values_list("key", flat=True)) == ["c"]
    assert idempotency_admin._delete_returning(records.filter(key="nothing")) == []


def test_delete_returning_an_empty_selection_runs_no_statement() -> None:
    abandoned(key="a")

    with CaptureQueriesContext(connections["default"]) as queries:
        assert (
            idempotency_admin._delete_returning(IdempotencyRecord.objects.filter(pk__in=[])) == []
        )

    assert len(queries) == 0
    assert IdempotencyRecord.objects.count() == 1


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

    choices = response.context["action_form"].fields["action"].choices
    assert [name for name, _ in choices] == ["", "release", "force_release", "delete_expired"]
    assert dict(choices)["force_release"] == (
        "Force release selected in-progress keys (the view may still be running)"
    )  # no generic "delete selected"


def test_actions_need_the_delete_permission() -> None:
    viewer = UserFactory(username="viewer", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_idempotencyrecord"))
    record = abandoned(key="stuck")
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


# --- the list does not load stored bodies ---------------------------------------------------------


def test_changelist_never_reads_stored_bodies(client_: Client) -> None:
    """A page of records would otherwise read each one's body (up to MAX_RESPONSE_BYTES)."""
    for number in range(3):
        completed(key=f"big-{number}", response_body=b"x" * 100_000)
    stuck(key="running")
    everything = list(IdempotencyRecord.objects.only("pk"))

    with CaptureQueriesContext(connections["default"]) as queries:
        response = client_.get(reverse(CHANGELIST), {"state__exact": "completed"})
        assert response.status_code == 200
        run_action(client_, "release", *everything)
        run_action(client_, "force_release", *everything)  # its confirmation page

    assert {r.key for r in response.context["cl"].result_list} == {"big-0", "big-1", "big-2"}
    record_queries = [q["sql"] for q in queries if IdempotencyRecord._meta.db_table in q["sql"]]
    assert record_queries
    assert not [sql for sql in record_queries if "response_body" in sql]


def changelist_statements(client: Client, **params: str) -> list[str]:
    with CaptureQueriesContext(connections["default"]) as queries:
        response = client.get(reverse(CHANGELIST), params)
        assert response.status_code == 200
    table = IdempotencyRecord._meta.db_table
    return [q["sql"] for q in queries if table in q["sql"]]


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"p": "2"},
        {"state__exact": "completed"},
        {"lease": "lapsed"},
        {"endpoint": "POST /charges/"},
        {"response_status": "201"},
        {"response_status__isnull": "True"},
        {"expired": "yes"},
        {"q": "k-1"},
        {"q": "k-1*"},
        {"_facets": "1"},
    ],
    ids=lambda params: "&".join(f"{k}={v}" for k, v in params.items()) or "plain",
)
def test_the_changelist_never_counts_or_distincts_the_table(
    client_: Client, params: dict[str, str]
) -> None:
    """What would read all 10 million records: a ``DISTINCT`` (the date hierarchy, the
    filters' choices) or a ``COUNT`` that no ``LIMIT`` bounds (the paginator, the full
    result count, the facets). Every statement on the table is bounded."""
    for number in range(120):
        completed(key=f"k-{number}", endpoint="POST /charges/")
    stuck(key="running")

    statements = changelist_statements(client_, **params)

    assert statements
    for sql in statements:
        upper = sql.upper()
        assert "DISTINCT" not in upper, sql
        if "COUNT(" in upper:
            assert "LIMIT" in upper.split("COUNT(", 1)[1], sql
        assert "LIMIT" in upper or "WHERE" in upper, sql  # no read of the whole table
        assert "DATE_TRUNC" not in upper, sql


def test_the_detail_page_still_shows_the_body(client_: Client) -> None:
    record = completed(response_body=b'{"id": "ch_1"}')

    with CaptureQueriesContext(connections["default"]) as queries:
        html = client_.get(reverse(CHANGE, args=[record.pk])).content.decode()

    assert "&quot;id&quot;: &quot;ch_1&quot;" in html
    assert [q for q in queries if "response_body" in q["sql"]]


# --- encrypted stored responses: shown only with view_decrypted_body ----------------------------

FERNET_KEY = Fernet.generate_key().decode()
SECRET_BODY = {"id": "ch_1", "card": "4242424242424242"}


@pytest.fixture
def encrypted(settings: Any) -> None:
    settings.IDEMPOTENCY = {
        "RESPONSE_CODEC": "idempotency_django.codecs.FernetCodec",
        "ENCRYPTION_KEYS": [FERNET_KEY],
    }


def sealed(body: dict[str, Any], **kwargs: Any) -> IdempotencyRecord:
    """A completed record as the engine stores it under the configured codec."""
    record = completed(**kwargs)
    outcome = codecs.seal(
        StoredResponse(
            201,
            json.dumps(body).encode(),
            [("Content-Type", "application/json"), ("Location", "/charges/ch_1")],
        ),
        account=record.account,
        endpoint=record.endpoint,
        key=record.key,
    )
    assert codecs.is_sealed(outcome.body)
    record.response_body, record.response_headers = outcome.body, outcome.headers
    record.save(update_fields=["response_body", "response_headers"])
    return record


def staff(*codenames: str) -> User:
    user = UserFactory(username=f"staff-{'-'.join(codenames)}", is_staff=True)
    for codename in ("view_idempotencyrecord", *codenames):
        user.user_permissions.add(Permission.objects.get(codename=codename))
    return User.objects.get(pk=user.pk)  # no cached permissions


def detail(client: Client, record: IdempotencyRecord) -> str:
    response = client.get(reverse(CHANGE, args=[record.pk]))
    assert response.status_code == 200
    return str(response.content.decode())


def test_the_permission_exists_after_migrate() -> None:
    permission = Permission.objects.get(codename="view_decrypted_body")
    assert permission.content_type.model_class() is IdempotencyRecord


@pytest.mark.usefixtures("encrypted")
def test_holders_of_the_permission_read_the_decrypted_response(
    caplog: pytest.LogCaptureFixture,
) -> None:
    record = sealed(SECRET_BODY)
    client = login(staff("view_decrypted_body"))

    with caplog.at_level(logging.INFO, logger="idempotency_django"):
        html = detail(client, record)

    assert "&quot;card&quot;: &quot;4242424242424242&quot;" in html  # pretty-printed JSON
    assert "/charges/ch_1" in html  # the headers, decrypted too
    assert [r for r in caplog.records if "shown decrypted in the admin" in r.getMessage()]


@pytest.mark.usefixtures("encrypted")
def test_superusers_hold_every_permission(client_: Client) -> None:
    html = detail(client_, sealed(SECRET_BODY))
    assert "4242424242424242" in html


@pytest.mark.usefixtures("encrypted")
def test_staff_without_the_permission_read_encrypted() -> None:
    record = sealed(SECRET_BODY)
    plain = completed(key="from-before-the-codec", response_body=json.dumps(SECRET_BODY).encode())
    client = login(staff())

    html = detail(client, record)
    old = detail(client, plain)

    assert "4242424242424242" not in html
    assert "/charges/ch_1" not in html
    assert html.count(">encrypted</div>") == 2  # the body and the headers
    assert "4242424242424242" not in old  # stored in clear before the codec: hidden as well
    assert "encrypted (stored in clear before RESPONSE_CODEC was set" in old


def test_without_a_codec_bodies_are_shown_as_before() -> None:
    record = completed(response_body=json.dumps(SECRET_BODY).encode())
    assert "4242424242424242" in detail(login(staff()), record)


@pytest.mark.usefixtures("encrypted")
def test_a_body_the_keys_cannot_open_is_said_so_not_a_500(settings: Any) -> None:
    record = sealed(SECRET_BODY)
    settings.IDEMPOTENCY = {**settings.IDEMPOTENCY, "ENCRYPTION_KEYS": [Fernet.generate_key()]}

    html = detail(login(staff("view_decrypted_body")), record)

    assert "encrypted, and the configured RESPONSE_CODEC cannot decrypt it" in html


@pytest.mark.usefixtures("encrypted")
def test_a_body_sealed_for_another_record_is_not_shown() -> None:
    """A body copied from another record (a row-level swap) is not shown as this one's."""
    theirs = sealed(SECRET_BODY, key="theirs")
    record = completed(key="mine", response_body=theirs.response_body, response_headers=[])

    html = detail(login(staff("view_decrypted_body")), record)

    assert "4242424242424242" not in html
    assert "encrypted for another record (the row was copied or altered); not shown" in html


@pytest.mark.usefixtures("encrypted")
def test_a_body_sealed_unbound_is_not_shown_where_bound_responses_are_required(
    settings: Any,
) -> None:
    """Under ``REQUIRE_BOUND_RESPONSES`` a body sealed before binding is what a replay
    refuses: the admin does not show it either, and says why."""
    frame = b'[["Content-Type", "application/json"]]\n' + json.dumps(SECRET_BODY).encode()
    body = codecs.SEALED_UNBOUND + Fernet(FERNET_KEY).encrypt(frame)
    record = completed(key="unbound", response_body=body, response_headers=[])
    settings.IDEMPOTENCY = {**settings.IDEMPOTENCY, "REQUIRE_BOUND_RESPONSES": True}

    html = detail(login(staff("view_decrypted_body")), record)

    assert "4242424242424242" not in html
    assert "encrypted before responses were bound to their record; refused on replay" in html


@pytest.mark.usefixtures("encrypted")
def test_a_response_that_could_not_be_stored_is_said_so(client_: Client) -> None:
    record = completed(response_body=codecs.UNSTORABLE, response_headers=[])
    html = detail(client_, record)
    assert "not stored (redaction or encoding failed" in html


@pytest.mark.usefixtures("encrypted")
def test_the_list_stays_without_bodies_and_needs_no_key(client_: Client) -> None:
    sealed(SECRET_BODY, key="secret-order")
    response = client_.get(reverse(CHANGELIST))
    assert response.status_code == 200
    assert "secret-order" in response.content.decode()
    assert "4242" not in response.content.decode()


# --- accounts: shown and found by username ---------------------------------------------------


def account_column(client: Client) -> dict[str, str]:
    response = client.get(reverse(CHANGELIST))
    assert response.status_code == 200
    model_admin = admin.site.get_model_admin(IdempotencyRecord)
    return {r.key: model_admin.account_shown(r) for r in response.context["cl"].result_list}


def test_accounts_are_shown_with_the_username(client_: Client, superuser: User) -> None:
    alice = UserFactory(username="alice")
    completed(key="a1", account=str(alice.pk))
    completed(key="a2", account=str(alice.pk))
    completed(key="root", account=str(superuser.pk))
    completed(key="gone", account="999999")
    completed(key="odd", account="not-a-pk")
    completed(key="task", account=str(alice.pk), endpoint="task:charge")

    shown = account_column(client_)

    assert shown == {
        "a1": f"alice ({alice.pk})",
        "a2": f"alice ({alice.pk})",
        "root": f"root ({superuser.pk})",
        "gone": "999999",
        "odd": "not-a-pk",
        "task": str(alice.pk),  # a task's account is its scope, not a user
    }
    html = client_.get(reverse(CHANGELIST)).content.decode()
    assert f"alice ({alice.pk})" in html


def test_the_page_looks_its_users_up_in_one_query(client_: Client) -> None:
    users = [UserFactory() for _ in range(3)]
    for number in range(9):
        completed(key=f"k{number}", account=str(users[number % 3].pk))

    with CaptureQueriesContext(connections["default"]) as queries:
        assert client_.get(reverse(CHANGELIST)).status_code == 200

    user_table = User._meta.db_table
    lookups = [q["sql"] for q in queries if f'FROM "{user_table}"' in q["sql"].replace("`", '"')]
    assert len(lookups) == 2  # the logged-in user, and one lookup for the page's accounts


def test_the_detail_page_shows_the_username(client_: Client) -> None:
    alice = UserFactory(username="alice")
    record = completed(account=str(alice.pk))
    assert f"alice ({alice.pk})" in detail(client_, record)


def test_with_another_account_scope_accounts_are_shown_as_they_are(
    client_: Client, settings: Any
) -> None:
    alice = UserFactory(username="alice")
    completed(key="tenant", account=str(alice.pk))
    settings.IDEMPOTENCY = {"ACCOUNT": lambda request: "tenant-1"}

    assert account_column(client_) == {"tenant": str(alice.pk)}
    assert listed(client_, q="alice") == set()


def test_account_display_and_search_are_settings(client_: Client, settings: Any) -> None:
    completed(key="t1", account="tenant-1")
    completed(key="t2", account="tenant-2")
    settings.IDEMPOTENCY = {
        "ACCOUNT_DISPLAY": lambda account: account.replace("tenant-", "Tenant #"),
        "ACCOUNT_SEARCH": lambda term: ["tenant-2"] if term == "Acme" else [],
    }

    assert account_column(client_) == {"t1": "Tenant #1", "t2": "Tenant #2"}
    assert listed(client_, q="Acme") == {"t2"}

    settings.IDEMPOTENCY = {"ACCOUNT_DISPLAY": None, "ACCOUNT_SEARCH": None}
    assert account_column(client_) == {"t1": "tenant-1", "t2": "tenant-2"}
    assert listed(client_, q="Acme") == set()


def test_search_by_exact_username(client_: Client) -> None:
    alice = UserFactory(username="alice")
    bob = UserFactory(username="bob")
    completed(key="alice-1", account=str(alice.pk))
    completed(key="alice-2", account=str(alice.pk))
    completed(key="bob-1", account=str(bob.pk))
    completed(key="alice-task", account=str(alice.pk), endpoint="task:charge")

    assert listed(client_, q="alice") == {"alice-1", "alice-2"}
    assert listed(client_, q=" bob ") == {"bob-1"}
    assert listed(client_, q="ali") == set()  # exact, as keys and accounts are
    assert listed(client_, q="bob-1") == {"bob-1"}  # keys are still found
    assert listed(client_, q="alice", state__exact="in_progress") == set()  # with filters


def test_username_display_called_one_account_at_a_time() -> None:
    alice = UserFactory(username="alice")
    display = idempotency_admin.username_display
    assert display(str(alice.pk)) == f"alice ({alice.pk})"
    assert display("not-a-pk") == "not-a-pk"
    assert display.many(["not-a-pk", "x"]) == {}


def test_a_record_that_is_gone_is_a_redirect_not_an_error(client_: Client) -> None:
    response = client_.get(reverse(CHANGE, args=[987654]))
    assert response.status_code == 302
