"""PostgreSQL with prepared statements (``OPTIONS["prepare_threshold"]``): the hot path runs on
a server-side binding cursor that psycopg prepares, and nothing a user can observe changes.

The rest of the store's behaviour under prepared statements is the rest of the suite:
``.ci/run`` runs the store, query-budget, concurrency and atomicity modules once more with
``TEST_PREPARE_THRESHOLD`` set.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import DataError, connection, connections
from django.test import Client
from django.test.utils import CaptureQueriesContext

from idempotency_django.models import IdempotencyRecord
from idempotency_django.store import _cursor, store
from tests.conftest import Post, effects
from tests.test_query_budget import round_trips
from tests.test_store_hot_path import LOOKUP, _record

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "postgresql", reason="prepared statements: PostgreSQL only"
    ),
]

_UNSET = object()


def _set_threshold(value: Any) -> None:
    options = connections["default"].settings_dict.setdefault("OPTIONS", {})
    if value is _UNSET:
        options.pop("prepare_threshold", None)
    else:
        options["prepare_threshold"] = value
    connections["default"].close()  # the next connection is made with the new options


@pytest.fixture
def threshold() -> Iterator[Callable[[Any], None]]:
    """Reconnect with ``prepare_threshold`` set to a value (``_UNSET``: Django's default)."""
    before = (
        connections["default"].settings_dict.get("OPTIONS", {}).get("prepare_threshold", _UNSET)
    )
    yield _set_threshold
    _set_threshold(before)


def _prepared_statements() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


def _post(client: Client, path: str, key: str, amount: int = 1) -> Any:
    return client.post(
        path,
        data=json.dumps({"amount": amount}),
        content_type="application/json",
        headers={"Idempotency-Key": key, "X-User": "alice"},
    )


def test_with_a_threshold_the_claim_and_the_completion_are_prepared(
    alice: User, client: Client, threshold: Callable[[Any], None]
) -> None:
    threshold(0)  # prepare on first use
    first = _post(client, "/effect/", "k1")
    replay = _post(client, "/effect/", "k1")

    prepared = _prepared_statements()
    assert first.status_code == 201
    assert replay["Idempotent-Replayed"] == "true"
    assert any("ON CONFLICT DO NOTHING" in sql for sql in prepared), prepared
    assert any(sql.startswith("UPDATE") and "$1" in sql for sql in prepared), prepared


def test_without_a_threshold_nothing_is_prepared(
    alice: User, client: Client, threshold: Callable[[Any], None]
) -> None:
    """Django's default (``prepare_threshold`` unset): transaction-mode poolers keep working."""
    threshold(_UNSET)
    for _ in range(7):
        _post(client, "/effect/", "k1")

    assert _prepared_statements() == []
    assert effects() == 1


@pytest.mark.parametrize("path", ["/effect/", "/atomic/", "/api/charges/"])
def test_replays_from_prepared_statements_are_the_first_response(
    alice: User, client: Client, threshold: Callable[[Any], None], path: str
) -> None:
    threshold(2)
    first = _post(client, path, "k1")
    replays = [_post(client, path, "k1") for _ in range(5)]
    other = _post(client, path, "k1", amount=2)

    assert first.status_code in (200, 201)
    for replay in replays:
        assert (replay.status_code, replay.content) == (first.status_code, first.content)
        assert replay["Content-Type"] == first["Content-Type"]
        assert replay["Idempotent-Replayed"] == "true"
    assert other.status_code == 422
    assert effects() == 1


def test_a_view_that_fails_in_atomic_mode_leaves_the_key_free(
    alice: User, client: Client, threshold: Callable[[Any], None]
) -> None:
    """The server-side binding cursor shares the connection's transaction: the claim it sent
    is rolled back with the view's work."""
    threshold(0)
    client.raise_request_exception = False
    failed = client.post(
        "/atomic/",
        data=json.dumps({"amount": 1, "raise": True}),
        content_type="application/json",
        headers={"Idempotency-Key": "k1", "X-User": "alice"},
    )

    assert failed.status_code == 500
    assert not IdempotencyRecord.objects.exists()
    assert effects() == 0


def test_errors_are_django_errors_and_statements_are_seen_by_execute_wrappers(
    threshold: Callable[[Any], None],
) -> None:
    """Wrapped as Django wraps its own cursors: error translation, ``execute_wrapper`` (what
    APM tools and the query-budget tests hook into)."""
    threshold(0)
    seen: list[str] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(wrapper):
        with _cursor(connection) as cursor:
            cursor.execute("SELECT %s::int", [7])
            assert cursor.fetchone() == (7,)
        with pytest.raises(DataError), _cursor(connection) as cursor:
            cursor.execute("SELECT 1 / %s::int", [0])

    assert seen == ["SELECT %s::int", "SELECT 1 / %s::int"]
    assert "SELECT $1::int" in _prepared_statements()


def test_while_queries_are_logged_they_are_logged_with_their_sql(
    alice: User, client: Client, threshold: Callable[[Any], None]
) -> None:
    """``DEBUG`` or ``assertNumQueries``: Django's own cursor, so ``connection.queries``
    shows each statement's SQL (a prepared statement's would be None there)."""
    threshold(0)
    with CaptureQueriesContext(connection) as captured:
        _post(client, "/effect/", "k1")

    assert all(query["sql"] for query in captured.captured_queries)
    assert any("ON CONFLICT" in query["sql"] for query in captured.captured_queries)


@pytest.mark.parametrize("use_tz", [True, False])
def test_datetimes_json_and_bytes_read_through_a_prepared_statement_are_the_orms(
    settings: Any, threshold: Callable[[Any], None], use_tz: bool
) -> None:
    settings.USE_TZ = use_tz
    settings.TIME_ZONE = "Europe/Paris"
    threshold(0)
    orm = _record(fingerprint="fp", response_body=b"\x00\xff{}")
    read = [store.read("default", LOOKUP, "fp") for _ in range(3)][-1]  # prepared by now

    assert read is not None
    assert read.expires_at == IdempotencyRecord.objects.get(pk=orm.pk).expires_at
    assert (read.expires_at.tzinfo is not None) is use_tz
    assert read.stored is not None
    assert read.stored.headers == [("Location", "/x/1")]
    assert read.stored.body == b"\x00\xff{}"
    assert any(sql.startswith("SELECT") and "$1" in sql for sql in _prepared_statements())


def test_once_prepared_a_request_makes_no_more_round_trips_than_unprepared(
    alice: User, post: Post, threshold: Callable[[Any], None]
) -> None:
    """psycopg's first use of a statement prepares it (one more round trip); from then on a
    first request adds the claim and the completion, and a replay is the claim alone, as
    ``test_query_budget`` pins without prepared statements."""
    threshold(5)
    for number in range(6):  # past the threshold: every statement prepared
        post("/effect/", {"amount": 1}, key=f"warm-{number}")
        post("/effect/", {"amount": 1}, key=f"warm-{number}")
    post("/optional/", {"amount": 0}, key=None)
    unprotected, _, _ = round_trips(lambda: post("/optional/", {"amount": 1}, key=None))

    first, _, created = round_trips(lambda: post("/effect/", {"amount": 1}, key="k1"))
    again, sent, replayed = round_trips(lambda: post("/effect/", {"amount": 1}, key="k1"))

    assert (created.status_code, replayed["Idempotent-Replayed"]) == (201, "true")
    assert first - unprotected == 2  # the claim, the completion
    assert again - unprotected == 0, sent  # the claim instead of the view's INSERT
