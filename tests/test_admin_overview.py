"""The admin's overview page: records in flight, lapsed claims, the purge lag, the table's
estimated size and the busiest endpoints of the last hour; who may see it; what it says on
the Redis store."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import path, reverse
from django.utils import timezone

from idempotency_django.models import IdempotencyRecord
from idempotency_django.operations import overview
from tests.project.factories import IdempotencyRecordFactory, UserFactory


def __getattr__(name: str) -> Any:
    """``urlpatterns``: this module is the URLconf of its tests, with the admin's URLs."""
    if name == "urlpatterns":
        return [path("admin/", admin.site.urls)]
    raise AttributeError(name)


pytestmark = [pytest.mark.django_db, pytest.mark.urls(__name__)]

State = IdempotencyRecord.State
OVERVIEW = "admin:idempotency_django_idempotencyrecord_overview"
CHANGE = "admin:idempotency_django_idempotencyrecord_change"
CHANGELIST = "admin:idempotency_django_idempotencyrecord_changelist"
database_store = pytest.mark.database_store("the overview reads database rows")


def login(user: User) -> Client:
    client = Client(headers={"X-User": user.username})
    client.force_login(user)
    return client


@pytest.fixture
def client_() -> Client:
    return login(UserFactory(username="root", is_staff=True, is_superuser=True))


def record(**kwargs: Any) -> IdempotencyRecord:
    now = timezone.now()
    values: dict[str, Any] = {
        "state": State.COMPLETED,
        "lease_expires_at": None,
        "response_status": 201,
        "created_at": now - timedelta(minutes=5),
        "completed_at": now - timedelta(minutes=5),
        "expires_at": now + timedelta(days=1),
        **kwargs,
    }
    return IdempotencyRecordFactory(**values)


def in_progress(lease: timedelta, age: timedelta, **kwargs: Any) -> IdempotencyRecord:
    now = timezone.now()
    return record(
        state=State.IN_PROGRESS,
        lease_expires_at=now + lease,
        response_status=None,
        completed_at=None,
        created_at=now - age,
        **kwargs,
    )


def text(html: bytes, element_id: str) -> str:
    """The text of the element ``element_id``, tags removed, spaces collapsed."""
    source = html.decode()
    start = source.index(f'id="{element_id}"')
    end = source.index("</div>", start) if "panel" in element_id else source.index("</p>", start)
    return " ".join(re.sub(r"<[^>]+>", " ", source[start:end]).split()[1:])


@database_store
def test_the_overview_shows_every_panel(client_: Client) -> None:
    charges, refunds = "POST /charges/", "POST /refunds/"
    oldest = in_progress(timedelta(seconds=30), timedelta(minutes=7), key="slow", endpoint=charges)
    in_progress(timedelta(seconds=30), timedelta(seconds=2), key="quick", endpoint=charges)
    dead = in_progress(-timedelta(minutes=3), timedelta(minutes=20), key="dead", endpoint=refunds)
    now = timezone.now()
    for key, days in (("old-1", 2), ("old-2", 1)):
        record(
            key=key,
            created_at=now - timedelta(days=days + 1),
            expires_at=now - timedelta(days=days, hours=1),
        )
    for number in range(3):
        record(key=f"charge-{number}", endpoint=charges)
    record(key="declined", endpoint=charges, response_status=402)
    record(key="refund", endpoint=refunds)
    record(key="yesterday", endpoint=refunds, created_at=now - timedelta(hours=2))

    response = client_.get(reverse(OVERVIEW))

    assert response.status_code == 200
    html = response.content
    flight = text(html, "panel-in-flight")
    assert flight.startswith("In flight 2 records in progress under a live lease")
    assert "Oldest: slow (POST /charges/), claimed 7 min" in flight
    assert f'href="{reverse(CHANGE, args=[oldest.pk])}"' in html.decode()
    lapsed = text(html, "panel-lapsed")
    assert lapsed.startswith("Lapsed claims nobody took over 1 ")
    assert "Lapsed first: dead (POST /refunds/), 3 min" in lapsed
    assert f'href="{reverse(CHANGE, args=[dead.pk])}"' in html.decode()
    lag = text(html, "panel-purge-lag")
    assert lag.startswith(
        "Expired records still present (purge lag) 2 The oldest expired 2 d 1 h ago"
    )
    size = text(html, "panel-table-size")
    assert size.startswith("Table size (estimated)")
    busiest = response.context["panels"]["busiest"].data["value"]
    # The records of the last hour by endpoint, busiest first; outcome columns: in progress,
    # 2xx, 3xx, 4xx, 5xx. Not the one created two hours ago.
    assert [(row.endpoint, row.total, row.outcomes) for row in busiest.rows] == [
        (charges, 6, [2, 3, 0, 1, 0]),
        (refunds, 2, [1, 1, 0, 0, 0]),
    ]
    assert not busiest.capped
    shown = " ".join(re.sub(r"<[^>]+>", " ", html.decode()).split())
    assert "POST /charges/ 6 2 3 0 1 0 POST /refunds/ 2 1 1 0 0 0" in shown


@database_store
def test_counts_stop_at_their_limit_and_say_more_than(
    client_: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(overview, "COUNT_LIMIT", 2)
    monkeypatch.setattr(overview, "RECENT_LIMIT", 3)
    for number in range(4):
        in_progress(-timedelta(minutes=1), timedelta(minutes=number + 1), key=f"dead-{number}")
    record(key="newest", endpoint="POST /newest/", created_at=timezone.now() - timedelta(seconds=1))

    with CaptureQueriesContext(connection) as queries:
        response = client_.get(reverse(OVERVIEW))

    assert text(response.content, "panel-lapsed").startswith(
        "Lapsed claims nobody took over more than 2 "
    )
    busiest = response.context["panels"]["busiest"].data["value"]
    assert busiest.capped
    assert busiest.counted == 3  # the newest three of the hour's five
    assert [(row.endpoint, row.total, row.outcomes) for row in busiest.rows] == [
        ("POST /effect/", 2, [2, 0, 0, 0, 0]),  # dead-0 and dead-1, not the older two
        ("POST /newest/", 1, [0, 1, 0, 0, 0]),
    ]
    statements = [q["sql"].upper() for q in queries.captured_queries]
    for sql in statements:
        if "IDEMPOTENCYRECORD" in sql and "COUNT(" in sql:
            assert "LIMIT 3" in sql, sql  # COUNT_LIMIT + 1: never the whole table


@database_store
def test_the_overview_reads_no_stored_body_and_counts_nothing_unbounded(client_: Client) -> None:
    record(key="a")
    with CaptureQueriesContext(connection) as queries:
        assert client_.get(reverse(OVERVIEW)).status_code == 200
    on_records = [
        q["sql"].upper()
        for q in queries.captured_queries
        if "IDEMPOTENCYRECORD" in q["sql"].upper()
    ]
    assert on_records
    for sql in on_records:
        assert "RESPONSE_BODY" not in sql
        assert "LIMIT" in sql or sql.startswith("SELECT RELTUPLES") or "TABLE_ROWS" in sql, sql


def test_the_overview_needs_the_view_permission() -> None:
    staff = UserFactory(username="staff", is_staff=True)
    client = login(staff)

    assert client.get(reverse(OVERVIEW)).status_code == 403

    staff.user_permissions.add(Permission.objects.get(codename="view_idempotencyrecord"))
    client = login(User.objects.get(pk=staff.pk))
    assert client.get(reverse(OVERVIEW)).status_code == 200


def test_the_overview_needs_a_login() -> None:
    response = Client().get(reverse(OVERVIEW))
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("admin:login"))


def test_the_changelist_links_to_the_overview(client_: Client) -> None:
    response = client_.get(reverse(CHANGELIST))
    assert f'href="{reverse(OVERVIEW)}"' in response.content.decode()


def test_on_the_redis_store_it_says_what_it_cannot_show(client_: Client, settings: Any) -> None:
    settings.IDEMPOTENCY = {
        "STORE": "idempotency_django.store.redis.RedisStore",
        "STORE_OPTIONS": {"URL": "redis://127.0.0.1:1/0"},  # never contacted
    }

    response = client_.get(reverse(OVERVIEW))

    assert response.status_code == 200
    html = response.content
    assert "This process's heartbeat" in text(html, "panel-heartbeat")
    said = text(html, "overview-not-shown")
    assert "keeps no index by state, lease or creation time" in said
    assert "Redis expires keys itself, so there is no purge lag" in said
    assert b"panel-in-flight" not in html
