"""Database round trips per request: the cost that does not depend on the machine.

Counted on the wire, as the database server sees them: every statement, including the
``BEGIN``/``COMMIT`` that psycopg sends on its own (PostgreSQL, read from libpq's protocol
trace) and the ``SET autocommit`` that mysqlclient sends for Django's transactions
(MariaDB, from the session's ``Questions`` counter). Each scenario is compared with the same
view body run unprotected (one ``INSERT`` in autocommit), so a budget is what the app adds,
whatever the view and middleware do; any extra round trip fails it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.utils import timezone

from tests.conftest import Post, effects

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.database_store("counts SQL queries"),
]


@pytest.fixture(autouse=True)
def _on_postgresql_and_mariadb() -> None:
    # SQLite is a file in the process: a round trip is a function call there.
    if connection.vendor not in ("postgresql", "mysql"):
        pytest.skip("the query budget is pinned on PostgreSQL and MariaDB")


@contextmanager
def _pg_trace() -> Iterator[list[str]]:
    """PostgreSQL: what the client sends, from libpq's trace. One round trip is one
    simple ``Query`` or one ``Sync`` (the end of an extended-protocol exchange)."""
    import psycopg

    sent: list[str] = []
    pgconn = connection.connection.pgconn  # type: ignore[union-attr]
    with tempfile.TemporaryFile(mode="w+") as trace:
        pgconn.trace(trace.fileno())
        pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            yield sent
        finally:
            pgconn.untrace()
            trace.seek(0)
            text = ""
            for line in trace.read().splitlines():
                fields = line.split("\t")
                if len(fields) < 3 or fields[0] != "F":
                    continue
                if fields[2] == "Parse" and len(fields) > 3:
                    text = fields[3].split('"')[3] if fields[3].count('"') >= 4 else fields[3]
                elif fields[2] == "Query" and len(fields) > 3:
                    sent.append(fields[3].strip().strip('"'))
                elif fields[2] == "Sync":
                    sent.append(text)


def _questions() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SHOW SESSION STATUS LIKE 'Questions'")
        row = cursor.fetchone()
    assert row is not None
    return int(row[1])


@contextmanager
def _mysql_count() -> Iterator[list[str]]:
    """MariaDB: the session's ``Questions`` (statements the client sent), less the two
    ``SHOW``s that read it."""
    sent: list[str] = []
    before = _questions()
    try:
        yield sent
    finally:
        sent.extend(["?"] * (_questions() - before - 1))


def round_trips(send: Callable[[], Any]) -> tuple[int, list[str], Any]:
    """How many round trips ``send()`` made on the default connection, the statements
    (PostgreSQL), and what it returned."""
    connection.ensure_connection()
    counting = _pg_trace if connection.vendor == "postgresql" else _mysql_count
    with counting() as sent:
        response = send()
    return len(sent), sent, response


def vendor(postgresql: int, mariadb: int) -> int:
    return postgresql if connection.vendor == "postgresql" else mariadb


@pytest.fixture
def unprotected(alice: User, post: Post) -> int:
    """Round trips of the view body alone: its one ``INSERT``, in autocommit."""
    post("/optional/", {"amount": 0}, key=None)  # connect, and load what loads once
    count, _, response = round_trips(lambda: post("/optional/", {"amount": 1}, key=None))
    assert response.status_code == 201
    return count


VIEW = 1  # the view's own INSERT


def test_the_trace_sees_every_round_trip(alice: User, post: Post) -> None:
    """The counter itself: a transaction is BEGIN, the statement and COMMIT (PostgreSQL),
    or SET autocommit=0, the statement, COMMIT and SET autocommit=1 (MariaDB)."""
    from django.db import transaction

    from tests.models import SideEffect

    def one_write() -> None:
        with transaction.atomic():
            SideEffect.objects.create(label="counted")

    count, sent, _ = round_trips(one_write)

    assert count == vendor(postgresql=3, mariadb=4)
    if connection.vendor == "postgresql":
        assert sent[0] == "BEGIN"
        assert sent[-1] == "COMMIT"


def test_a_first_request_in_commit_mode_adds_the_claim_and_the_completion(
    post: Post, unprotected: int
) -> None:
    count, _, response = round_trips(lambda: post("/effect/", {"amount": 1}))

    assert response.status_code == 201
    assert count - unprotected == 2  # INSERT (the claim), UPDATE (the completion)


def test_a_first_request_in_atomic_mode_adds_its_transaction_the_claim_and_the_completion(
    post: Post, unprotected: int
) -> None:
    count, _, response = round_trips(lambda: post("/atomic/", {"amount": 1}))

    assert response.status_code == 201
    assert effects("atomic") == 1
    # The claim and the completion, and the transaction that makes them one with the work:
    # BEGIN and COMMIT on PostgreSQL; SET autocommit=0, COMMIT and SET autocommit=1 on
    # MariaDB (mysqlclient sends each). No savepoint. PostgreSQL also bounds the claim's
    # lock wait (lock_timeout set before it and put back after); MariaDB does it in the
    # claim's own statement (SET STATEMENT … FOR).
    assert count - unprotected == vendor(postgresql=6, mariadb=5)


def test_a_replay_is_one_round_trip_on_postgresql_and_two_on_mariadb(
    post: Post, unprotected: int
) -> None:
    post("/effect/", {"amount": 1})
    count, sent, response = round_trips(lambda: post("/effect/", {"amount": 1}))

    assert response["Idempotent-Replayed"] == "true"
    assert effects("effect") == 1
    # PostgreSQL: the claim attempt and the read are one statement. MariaDB: the
    # INSERT that loses, then the read.
    assert count - (unprotected - VIEW) == vendor(postgresql=1, mariadb=2)
    if connection.vendor == "postgresql":
        assert sent[-1].startswith("WITH ins AS (INSERT")


def test_a_replay_in_atomic_mode_opens_and_rolls_back_its_transaction(
    post: Post, unprotected: int
) -> None:
    post("/atomic/", {"amount": 1})
    count, _, response = round_trips(lambda: post("/atomic/", {"amount": 1}))

    assert response["Idempotent-Replayed"] == "true"
    assert effects("atomic") == 1
    # BEGIN, lock_timeout set, the claim attempt with its read, lock_timeout put back,
    # ROLLBACK (PostgreSQL); SET autocommit=0, INSERT, SELECT, ROLLBACK, SET autocommit=1
    # (MariaDB).
    assert count - (unprotected - VIEW) == vendor(postgresql=5, mariadb=5)


def test_a_mismatch_costs_what_a_replay_costs_and_reads_no_body(
    post: Post, unprotected: int
) -> None:
    post("/effect/", {"amount": 1})
    count, _, response = round_trips(lambda: post("/effect/", {"amount": 2}))

    assert response.status_code == 422
    assert count - (unprotected - VIEW) == vendor(postgresql=1, mariadb=2)


def test_an_in_flight_conflict_costs_what_a_replay_costs(post: Post, unprotected: int) -> None:
    from idempotency_django.models import IdempotencyRecord

    post("/effect/", {"amount": 1})
    IdempotencyRecord.objects.update(
        state=IdempotencyRecord.State.IN_PROGRESS,
        lease_expires_at=timezone.now() + timedelta(seconds=60),
    )
    count, _, response = round_trips(lambda: post("/effect/", {"amount": 1}))

    assert response.status_code == 409
    assert count - (unprotected - VIEW) == vendor(postgresql=1, mariadb=2)


def test_a_release_is_one_statement(post: Post, unprotected: int) -> None:
    """A 5xx releases the key with one DELETE (the ORM's delete() would add a
    transaction around it)."""
    from idempotency_django.models import IdempotencyRecord

    count, _, response = round_trips(lambda: post("/effect/", {"amount": 1, "status": 503}))

    assert response.status_code == 503
    assert not IdempotencyRecord.objects.exists()
    assert count - unprotected == 2  # INSERT (the claim), DELETE (the release)


def test_a_malformed_key_costs_no_round_trip(post: Post, unprotected: int) -> None:
    count, _, response = round_trips(lambda: post("/effect/", {"amount": 1}, key=""))

    assert response.status_code == 400
    assert count - (unprotected - VIEW) == 0


def test_the_pg_trace_parser_reads_statements() -> None:
    """Guard the parser against a libpq trace format it does not understand: it would
    count nothing, and every budget above would pass vacuously."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's trace")
    connection.ensure_connection()
    with _pg_trace() as sent, connection.cursor() as cursor:
        cursor.execute("SELECT %s", [os.getpid()])
    assert len(sent) == 1, sent
    assert sent[0].startswith("SELECT"), sent
