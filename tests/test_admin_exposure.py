"""What the admin lets its users see and make the database do: a warning where stored bodies
are in clear, only indexed lookups and no column sort from the query string, and no key in
the history it keeps forever. Through Django's test client, as ``test_admin``."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from idempotency_django import signals
from idempotency_django.models import IdempotencyRecord
from tests.project.factories import UserFactory
from tests.test_admin import (
    CHANGE,
    CHANGELIST,
    FERNET_KEY,
    SECRET_BODY,
    abandoned,
    completed,
    login,
    run_action,
    staff,
    stuck,
)

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.urls("tests.test_admin"),
    pytest.mark.database_store("the admin browses database rows (the Redis store has no admin)"),
]

IN_CLEAR = "Stored responses are kept in clear"


@pytest.fixture
def superuser() -> User:
    return UserFactory(username="root", is_staff=True, is_superuser=True)


@pytest.fixture
def client_(superuser: User) -> Client:
    return login(superuser)


# --- bodies in clear ---------------------------------------------------------------------------


def test_without_a_codec_the_list_and_each_record_say_the_bodies_are_in_clear() -> None:
    record = completed(response_body=json.dumps(SECRET_BODY).encode())
    reader = login(staff())  # the view permission alone

    listing = reader.get(reverse(CHANGELIST)).content.decode()
    page = reader.get(reverse(CHANGE, args=[record.pk])).content.decode()

    assert IN_CLEAR in listing
    assert IN_CLEAR in page
    assert "4242424242424242" in page  # which is what the warning is about


def test_with_a_codec_there_is_nothing_to_warn_of(settings: Any) -> None:
    settings.IDEMPOTENCY = {
        "RESPONSE_CODEC": "idempotency_django.codecs.FernetCodec",
        "ENCRYPTION_KEYS": [FERNET_KEY],
    }
    record = completed()
    reader = login(staff())

    assert IN_CLEAR not in reader.get(reverse(CHANGELIST)).content.decode()
    assert IN_CLEAR not in reader.get(reverse(CHANGE, args=[record.pk])).content.decode()


# --- the query string: indexed lookups only, no sort ------------------------------------------


@pytest.mark.parametrize(
    "lookup",
    [
        {"response_body__contains": "4242"},
        {"fingerprint__startswith": "2:"},
        {"created_at__year": "2026"},
        {"key__icontains": "order"},
        {"account__regex": ".*"},
        {"token": "a" * 32},
        {"endpoint__startswith": "POST"},
    ],
)
def test_a_lookup_no_index_serves_is_refused(client_: Client, lookup: dict[str, str]) -> None:
    completed(key="order-1")

    with CaptureQueriesContext(connection) as queries:
        response = client_.get(reverse(CHANGELIST), lookup)

    assert response.status_code == 400
    assert not [q for q in queries if "idempotency_django_idempotencyrecord" in q["sql"]]


@pytest.mark.parametrize(
    "lookup",
    [
        {"state__exact": "in_progress"},
        {"endpoint__exact": "POST /charges/"},
        {"response_status__exact": "201"},
        {"response_status__isnull": "True"},
        {"lease": "lapsed"},
        {"expired": "yes"},
    ],
)
def test_the_filters_own_lookups_still_work(client_: Client, lookup: dict[str, str]) -> None:
    completed(key="order-1", endpoint="POST /charges/")
    abandoned(key="order-2", endpoint="POST /charges/")

    response = client_.get(reverse(CHANGELIST), lookup)

    assert response.status_code == 200


@pytest.mark.parametrize("order", ["5", "-5", "2.1", "1", "8"])
def test_a_sort_in_the_query_string_is_ignored(client_: Client, order: str) -> None:
    """No column sorts (a sort of 10 million rows): the list stays newest first, on the
    primary key's index."""
    now = timezone.now()
    older = completed(key="a-older", account="2", response_status=201, expires_at=now)
    newer = stuck(key="z-newer", account="1", expires_at=now + timedelta(days=1))
    newer.response_status = 400
    newer.save()

    with CaptureQueriesContext(connection) as queries:
        response = client_.get(reverse(CHANGELIST), {"o": order})

    assert response.status_code == 200
    assert [r.pk for r in response.context["cl"].result_list] == [newer.pk, older.pk]
    listing = [
        q["sql"] for q in queries if "ORDER BY" in q["sql"] and "idempotencyrecord" in q["sql"]
    ]
    assert listing
    for sql in listing:
        ordering = sql.split("ORDER BY", 1)[1]
        for column in ("response_status", "account", "key", "expires_at", "created_at"):
            assert column not in ordering, sql


# --- the admin's history: no key, kept forever -------------------------------------------------


@pytest.mark.parametrize("action", ["release", "force_release"])
def test_the_history_of_a_release_names_the_key_by_its_digest(client_: Client, action: str) -> None:
    record = abandoned(key="order-4711", account="7", endpoint="POST /charges/")
    extra = {"post": "yes", "token": record.token} if action == "force_release" else {}

    run_action(client_, action, record, **extra)

    entry = LogEntry.objects.get()
    assert "order-4711" not in entry.object_repr
    assert "order-4711" not in str(entry.change_message)
    assert entry.object_repr.startswith(signals.key_digest("order-4711"))
    assert not IdempotencyRecord.objects.filter(pk=record.pk).exists()


def test_only_the_views_readers_get_the_warning(superuser: User) -> None:
    """The warning is for every reader, superusers too: they hold the view permission."""
    assert IN_CLEAR in login(superuser).get(reverse(CHANGELIST)).content.decode()
