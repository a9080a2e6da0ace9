"""PostgreSQL with prepared statements (``OPTIONS["prepare_threshold"]``): the hot path runs on
a server-side binding cursor that psycopg prepares, and nothing a user can observe changes.

The rest of the store's behaviour under prepared statements is the rest of the suite:
``.ci/run`` runs the store, query-budget, concurrency and atomicity modules once more with
``TEST_PREPARE_THRESHOLD`` set.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import DataError, connection, connections
from django.test import Client
from django.test.utils import CaptureQueriesContext

from idempotency_django.models import IdempotencyRecord
from idempotency_django.store.database import _cursor, store
from tests.conftest import Post, effects
from tests.test_query_budget import round_trips
from tests.test_store_hot_path import LOOKUP, _record

pytestmark = [
    pytest.mark.database_store("prepared SQL statements"),
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
    read = [store.read(LOOKUP, "fp") for _ in range(3)][-1]  # prepared by now

    assert read is not None
    # Moved onto this process's clock by a few milliseconds (the database's now is read in
    # the same statement); a time zone taken wrongly would be an hour off.
    shift = read.expires_at - IdempotencyRecord.objects.get(pk=orm.pk).expires_at
    assert abs(shift) < timedelta(seconds=1)
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


# --- statements the server refuses -------------------------


def _from_another_connection(sql: str) -> None:
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute(sql)
    finally:
        other.close()


def test_a_column_type_changed_under_prepared_statements_costs_no_request(
    alice: User, post: Post, threshold: Callable[[Any], None], caplog: pytest.LogCaptureFixture
) -> None:
    """A migration run by another process changes a column's type: PostgreSQL refuses the
    statements this connection prepared before (0A000, "cached plan must not change result
    type"). They are sent again unprepared: no request of this connection gets a 503."""
    threshold(0)
    assert post("/effect/", {"amount": 1}, key="before").status_code == 201
    table = IdempotencyRecord._meta.db_table
    _from_another_connection(f"ALTER TABLE {table} ALTER COLUMN response_status TYPE bigint")
    try:
        with caplog.at_level(logging.WARNING, logger="idempotency_django"):
            first = post("/effect/", {"amount": 1}, key="after")
            replay = post("/effect/", {"amount": 1}, key="after")
            older = post("/effect/", {"amount": 1}, key="before")
    finally:
        _from_another_connection(f"ALTER TABLE {table} ALTER COLUMN response_status TYPE integer")

    assert first.status_code == 201
    assert replay["Idempotent-Replayed"] == "true"
    assert older["Idempotent-Replayed"] == "true"
    assert effects() == 2
    assert "0A000" in caplog.text


def test_a_completion_whose_prepared_statement_the_server_forgot_is_stored(
    alice: User, post: Post, threshold: Callable[[Any], None], caplog: pytest.LogCaptureFixture
) -> None:
    """Behind a transaction-mode pooler without prepared-statement support, the completion's
    prepared statement may not exist on the server connection it reaches (26000) after the
    work committed. Retried unprepared, the outcome is stored: the retry is a replay, not a
    second run once the lease lapses."""
    threshold(0)
    assert post("/effect/", {}, key="warm").status_code == 201  # prepares the statements

    with caplog.at_level(logging.WARNING, logger="idempotency_django"):
        first = post("/forgets-prepared-statements/", {}, key="k1")
    retry = post("/forgets-prepared-statements/", {}, key="k1")

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert effects("forgets_prepared_statements") == 1
    assert IdempotencyRecord.objects.get(key="k1").state == IdempotencyRecord.State.COMPLETED
    assert "26000" in caplog.text


def test_a_prepared_statement_name_taken_on_the_server_costs_no_request(
    alice: User, post: Post, threshold: Callable[[Any], None]
) -> None:
    """Behind such a pooler, the server connection may already hold another client's
    statement of the name psycopg picks (42P05, "already exists")."""
    threshold(0)
    connection.ensure_connection()
    connection.connection.pgconn.exec_(b"PREPARE _pg3_0 AS SELECT 1")  # psycopg's first name

    first = post("/effect/", {"amount": 1}, key="k1")
    replay = post("/effect/", {"amount": 1}, key="k1")

    assert first.status_code == 201
    assert replay["Idempotent-Replayed"] == "true"
    assert effects() == 1


def test_inside_the_request_transaction_a_forgotten_statement_rolls_back_once(
    alice: User,
    post: Post,
    threshold: Callable[[Any], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under ATOMIC_REQUESTS the completion runs in the work's transaction, which PostgreSQL
    aborts on the error: nothing can be retried in it. The work rolls back, the answer is a
    503 and the key is free (the rollback is certain); the connection prepares nothing more,
    so the retry runs once and is stored."""
    monkeypatch.setitem(connections["default"].settings_dict, "ATOMIC_REQUESTS", True)
    threshold(0)
    assert post("/effect/", {}, key="warm").status_code == 201  # prepares the statements

    failed = post("/forgets-prepared-statements/", {}, key="k1")
    retry = post("/forgets-prepared-statements/", {}, key="k1")
    replay = post("/forgets-prepared-statements/", {}, key="k1")

    assert failed.status_code == 503
    assert json.loads(failed.content)["type"].endswith("store-unavailable")
    assert retry.status_code == 201
    assert replay["Idempotent-Replayed"] == "true"
    assert effects("forgets_prepared_statements") == 1  # its first work rolled back


def test_the_heartbeat_says_a_refused_statement_in_its_transaction_is_not_sent_again(
    threshold: Callable[[Any], None], caplog: pytest.LogCaptureFixture
) -> None:
    """The renewal runs inside a short transaction (its statement timeout is ``SET LOCAL``),
    where PostgreSQL aborts on the refused statement and nothing is sent again: the log says
    so, rather than "sent again unprepared". That beat renews nothing; the next one, on the
    same connection, no longer prepares and renews."""
    from idempotency_django.core import claims, shell
    from idempotency_django.core.heartbeat import Heartbeat

    threshold(0)
    policy = claims.ClaimPolicy(
        "default", lease=30, ttl=60, in_flight="conflict", wait_seconds=0, retry_after=1
    )
    claim = shell.claim_or_replay(claims.Scope("1", "POST /x/", "k"), "f" * 64, policy)
    assert isinstance(claim, claims.Claim)
    beat = Heartbeat()
    beat._entries[claim.token] = _entry(claim)
    assert beat.renew_once() == 1  # prepares the renewal on this thread's connection
    connection.connection.pgconn.exec_(b"DEALLOCATE ALL")  # a pooler's doing, unseen

    with caplog.at_level(logging.WARNING, logger="idempotency_django"):
        assert beat.renew_once() == 0
    refused = [r.getMessage() for r in caplog.records if "refused a prepared" in r.getMessage()]
    assert len(refused) == 1
    assert "26000" in refused[0]
    assert "not sent again" in refused[0]
    assert "sent again unprepared" not in refused[0]
    assert beat.renew_once() == 1


def _entry(claim: Any) -> Any:
    import time

    from idempotency_django.core.heartbeat import _Entry

    return _Entry(claim, 30, time.monotonic() + 60, time.monotonic())
