"""A store that really goes away: connections killed by the server, a server that refuses
connections. PostgreSQL and MariaDB; no mocks."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import DatabaseError, InterfaceError, OperationalError, connection, connections
from django.test import RequestFactory
from django.utils import timezone

from idempotency_django import signals
from idempotency_django.models import IdempotencyRecord
from idempotency_django.store.base import DEFAULT_STORE, get_store
from idempotency_django.tasks import TaskInFlight, idempotent_task
from tests.conftest import Post, effects, post_from_thread
from tests.models import SideEffect
from tests.project import views

pytestmark = [pytest.mark.concurrency, pytest.mark.django_db(transaction=True)]


def keyed_request(user: User, body: dict[str, Any], key: str = "k1") -> Any:
    request = RequestFactory().post(
        "/effect/",
        data=json.dumps(body),
        content_type="application/json",
        headers={"Idempotency-Key": key},
    )
    request.user = user
    return request


@pytest.mark.database_store("kills or locks the database store's connection or table")
def test_connection_killed_before_the_claim_costs_one_reconnect(
    alice: User, caplog: pytest.LogCaptureFixture
) -> None:
    views.terminate_backend()  # the connection the claim is about to use is dead

    with caplog.at_level(logging.WARNING, logger="idempotency_django"):
        response = views.effect(keyed_request(alice, {"amount": 1}))

    assert response.status_code == 201
    assert "retrying once" in caplog.text
    assert effects() == 1
    assert IdempotencyRecord.objects.get().state == IdempotencyRecord.State.COMPLETED


@pytest.mark.database_store("kills the database store's connection")
def test_connection_killed_before_the_completion_still_stores_the_outcome(
    alice: User, post: Post, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="idempotency_django"):
        first = post("/loses-its-connection/", {})
    retry = post("/loses-its-connection/", {})

    assert first.status_code == 201
    assert "retrying once" in caplog.text
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert effects("loses_its_connection") == 1


@pytest.fixture
def refused_connections() -> Iterator[None]:
    """Point the default database at a port where nothing listens, for real."""
    settings = connection.settings_dict
    saved = settings["HOST"], settings["PORT"]
    connection.close()
    settings["HOST"], settings["PORT"] = "127.0.0.1", "9"
    try:
        yield
    finally:
        connection.close()
        settings["HOST"], settings["PORT"] = saved


@pytest.mark.database_store(
    "the database server unreachable or its connection killed (Redis down: test_redis_store)"
)
def test_store_unreachable_fails_closed_and_the_view_does_not_run(
    alice: User, refused_connections: None
) -> None:
    response = views.effect(keyed_request(alice, {"amount": 1}))

    # Had the view run, its own INSERT would have raised: a 503 means it never started.
    assert response.status_code == 503
    assert response["Retry-After"] == "1"
    assert response["Content-Type"] == "application/problem+json"
    assert json.loads(response.content)["type"].endswith("store-unavailable")


@pytest.mark.database_store(
    "the database server unreachable or its connection killed (Redis down: test_redis_store)"
)
def test_store_unreachable_fails_closed_in_atomic_mode(
    alice: User, refused_connections: None
) -> None:
    assert views.atomic(keyed_request(alice, {"amount": 1})).status_code == 503


@pytest.mark.database_store(
    "the database server unreachable or its connection killed (Redis down: test_redis_store)"
)
def test_a_view_whose_connection_died_keeps_its_key(
    alice: User, post: Post, client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Its write may have committed unacknowledged (it did here): releasing the key would
    let the retry write again. The key stays claimed until its lease lapses."""
    client.raise_request_exception = False
    with caplog.at_level(logging.ERROR, logger="idempotency_django"):
        failed = post("/dies-mid-write/", {})
    connection.close()  # what a server does with a broken connection when the request ends
    retry = post("/dies-mid-write/", {})

    assert failed.status_code == 500
    assert "may have committed" in caplog.text
    assert retry.status_code == 409
    assert effects("dies_mid_write") == 1
    assert IdempotencyRecord.objects.get().state == IdempotencyRecord.State.IN_PROGRESS


@idempotent_task(scope="orders", key="message_id", name="dies-mid-write")
def task_dies_mid_write(message_id: str) -> None:
    SideEffect.objects.create(label="task_dies_mid_write")
    views.terminate_backend()
    SideEffect.objects.count()  # raises: the server closed the connection


@pytest.mark.database_store("kills or locks the database store's connection or table")
def test_a_task_whose_connection_died_keeps_its_key() -> None:
    """The same rule for tasks: the write committed unacknowledged, so a redelivery is told
    the work is in flight until the lease lapses, instead of doing it again."""
    with pytest.raises((OperationalError, InterfaceError)):
        task_dies_mid_write("msg-1")
    connection.close()

    with pytest.raises(TaskInFlight):
        task_dies_mid_write("msg-1")
    assert effects("task_dies_mid_write") == 1
    assert IdempotencyRecord.objects.get().state == IdempotencyRecord.State.IN_PROGRESS


# --- a statement timeout is not a duplicate in flight ----------------------


@pytest.fixture
def statement_timeout(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This thread's connections give up on a statement after 300 ms."""
    options = connection.settings_dict.setdefault("OPTIONS", {})
    if connection.vendor == "postgresql":
        monkeypatch.setitem(options, "options", "-c statement_timeout=300")
    else:
        monkeypatch.setitem(options, "init_command", "SET SESSION max_statement_time = 0.3")
    connection.close()  # the next connection takes the option
    yield
    connection.close()


@pytest.fixture
def records_table_locked() -> Iterator[Callable[[], None]]:
    """Another connection holds a lock on the records table (a migration, an operator's
    ``LOCK TABLE``): nobody holds any key. Yields the function that unlocks it."""
    table = IdempotencyRecord._meta.db_table
    other = connections.create_connection("default")
    other.ensure_connection()
    with other.cursor() as cursor:
        if other.vendor == "postgresql":
            other.set_autocommit(False)
            cursor.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        else:
            cursor.execute(f"LOCK TABLES {table} WRITE")

    def unlock() -> None:
        if other.connection is None:
            return
        if other.vendor == "postgresql":
            other.rollback()
        else:
            with other.cursor() as cursor:
                cursor.execute("UNLOCK TABLES")
        other.close()

    yield unlock
    unlock()


@pytest.mark.database_store("kills or locks the database store's connection or table")
def test_a_claim_that_times_out_on_a_locked_table_is_a_503_and_signalled(
    alice: User,
    post: Post,
    settings: Any,
    statement_timeout: None,
    records_table_locked: Callable[[], None],
) -> None:
    """Not 409 "still being processed": no request holds the key. The store cannot serve
    now: 503 with Retry-After, ``store_unavailable`` sent, never a fail-open run."""
    settings.IDEMPOTENCY = {"ON_STORE_ERROR": "open"}
    sent: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        sent.append({**kwargs, "key": signals.raw_key()})

    signals.store_unavailable.connect(receiver)
    try:
        refused = post("/effect/", {"amount": 1})
    finally:
        signals.store_unavailable.disconnect(receiver)
    records_table_locked()

    assert refused.status_code == 503
    assert refused["Retry-After"] == "1"
    assert json.loads(refused.content)["type"].endswith("store-unavailable")
    assert [(s["key"], s["policy"], s["kind"]) for s in sent] == [("k1", "closed", "other")]
    assert effects() == 0
    # The key was free all along: once the lock is gone, it runs.
    assert post("/effect/", {"amount": 1}).status_code == 201
    assert effects() == 1


# --- a store that is there but full: never "unreachable", never a fail-open run ----------------


@pytest.fixture
def store_database_full(settings: Any) -> Iterator[str]:
    """The store in a database alias of its own ("store"), which refuses our connection
    because it is full, for real: PostgreSQL's "too many connections for role" (53300), for
    a role whose CONNECTION LIMIT is 0. The work's database ("default") is fine."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL: a role's CONNECTION LIMIT (MariaDB: see the next test)")
    role = f"idempotency_full_{uuid.uuid4().hex[:8]}"
    try:
        with connection.cursor() as cursor:
            cursor.execute(f'CREATE ROLE "{role}" LOGIN CONNECTION LIMIT 0')
    except DatabaseError as error:
        pytest.skip(f"cannot create a role: {error}")
    store_alias = connections["store"]
    saved = store_alias.settings_dict["USER"]
    store_alias.close()
    store_alias.settings_dict["USER"] = role
    settings.IDEMPOTENCY = {"DATABASE": "store", "ON_STORE_ERROR": "open"}
    try:
        yield role
    finally:
        store_alias.close()
        store_alias.settings_dict["USER"] = saved
        with connection.cursor() as cursor:
            cursor.execute(f'DROP ROLE "{role}"')


@pytest.mark.django_db(transaction=True, databases=["default", "store"])
@pytest.mark.database_store("the database store's connection limit")
def test_a_store_database_with_no_connection_to_spare_never_fails_open(
    alice: User, post: Post, store_database_full: str
) -> None:
    """Whoever fills the store's connections must not get views run unprotected: a full
    server is "other" (503), even with ON_STORE_ERROR "open", and the view never runs."""
    sent: list[tuple[str, str]] = []

    def receiver(**kwargs: Any) -> None:
        sent.append((kwargs["policy"], kwargs["kind"]))

    signals.store_unavailable.connect(receiver)
    try:
        refused = post("/effect/", {"amount": 1})
    finally:
        signals.store_unavailable.disconnect(receiver)

    assert refused.status_code == 503
    assert json.loads(refused.content)["type"].endswith("store-unavailable")
    assert sent == [("closed", "other")]
    assert effects() == 0


@pytest.mark.database_store("the database store's error codes")
def test_mariadb_too_many_connections_is_other_and_a_lost_connection_unreachable() -> None:
    """MariaDB's "Too many connections" (1040) as mysqlclient raises it and Django wraps
    it. Built here rather than provoked: reaching it means filling the server's global
    max_connections, which every other client of the server shares."""
    if connection.vendor != "mysql":
        pytest.skip("MariaDB/MySQL error codes")
    import MySQLdb

    def wrapped(code: int, message: str) -> OperationalError:
        driver = MySQLdb.OperationalError(code, message)
        error = OperationalError(*driver.args)
        error.__cause__ = driver
        return error

    database_store = get_store(DEFAULT_STORE)
    assert database_store.failure_kind(wrapped(1040, "Too many connections")) == "other"
    lost = wrapped(2013, "Lost connection to server during query")
    assert database_store.failure_kind(lost) == "unreachable"


# --- a completion that fails again and again is sent again until its lease may lapse -------


class RowHeld:
    """Another connection holds the record's row (``SELECT … FOR UPDATE``), so that each
    completion sent waits on it where this test can see it, and be killed there, as an
    operator or a failover would kill a connection."""

    def __init__(self) -> None:
        self.other = connections.create_connection("default")
        self.other.ensure_connection()
        self.other.set_autocommit(False)
        table = IdempotencyRecord._meta.db_table
        with self.other.cursor() as cursor:
            cursor.execute(f"SELECT id FROM {table} FOR UPDATE")
        # Watched from outside that transaction: PostgreSQL keeps one snapshot of
        # pg_stat_activity for a whole transaction.
        self.watcher = connections.create_connection("default")

    def blocked_completions(self) -> list[int]:
        """The server's ids of the connections whose completion waits on the row."""
        with self.watcher.cursor() as cursor:
            if self.watcher.vendor == "postgresql":
                cursor.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND query LIKE %s",
                    ["UPDATE %response_status%"],
                )
            else:
                cursor.execute(
                    "SELECT t.trx_mysql_thread_id FROM information_schema.INNODB_TRX t "
                    "JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id "
                    "WHERE p.DB = DATABASE() AND t.trx_state = 'LOCK WAIT' "
                    "AND t.trx_query LIKE %s",
                    ["UPDATE %response_status%"],
                )
            return [int(row[0]) for row in cursor.fetchall()]

    def next_completion(self, seen: list[int], thread: threading.Thread) -> int | None:
        """The next completion that waits on the row (not one of ``seen``); None once the
        request has answered instead. Polled every 0.2 s, not faster: MariaDB's KILL of a
        lock wait needs the lock system's latch, which reading INNODB_TRX takes."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and thread.is_alive():
            found = [each for each in self.blocked_completions() if each not in seen]
            if found:
                return found[0]
            time.sleep(0.2)
        return None

    def kill(self, connection_id: int) -> None:
        with self.watcher.cursor() as cursor:
            if self.watcher.vendor == "postgresql":
                cursor.execute("SELECT pg_terminate_backend(%s)", [connection_id])
            else:
                cursor.execute(f"KILL CONNECTION {connection_id}")

    def release(self) -> None:
        self.watcher.close()
        if self.other.connection is not None:
            self.other.rollback()
            self.other.close()


@pytest.mark.database_store("kills the database store's connection")
def test_a_completion_whose_connection_is_killed_again_and_again_is_stored(
    alice: User, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The work committed; each completion sent waits on a row lock, and its connection is
    killed there: the first, and the one retry on a new connection that there always was.
    The completion is sent again until the store takes it, and the answer waits for it. A
    late duplicate, after the lease the claim held has lapsed, replays: the work ran once.
    (A lease of 10 s: MariaDB may take seconds to end a connection killed in a lock wait.)"""
    answers: queue.Queue[Any] = queue.Queue()
    thread = threading.Thread(
        target=lambda: answers.put(
            post_from_thread(
                "/effect/",
                {"amount": 1, "gate": True},
                {"Idempotency-Key": "k1", "X-User": "alice"},
            )
        )
    )
    thread.start()
    assert views.gate.entered.wait(10)
    held = RowHeld()
    killed: list[int] = []
    try:
        views.gate.release.set()
        with caplog.at_level(logging.WARNING, logger="idempotency_django"):
            while len(killed) < 2:
                blocked = held.next_completion(killed, thread)
                if blocked is None:
                    break  # answered: the completion was not sent again
                held.kill(blocked)
                killed.append(blocked)
            resent = held.next_completion(killed, thread)  # then let it through
    finally:
        held.release()
        views.gate.release.set()
        thread.join(30)
    response = answers.get(timeout=1)
    # Its lease lapses (as nobody renews it once the request has answered).
    lapsed = IdempotencyRecord.objects.filter(state=IdempotencyRecord.State.IN_PROGRESS).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    late = post_from_thread(
        "/effect/", {"amount": 1, "gate": True}, {"Idempotency-Key": "k1", "X-User": "alice"}
    )

    assert len(killed) == 2
    assert response.status_code == 201
    assert late.status_code == 201
    assert late.get("Idempotent-Replayed") == "true"
    assert late.content == response.content
    assert effects() == 1
    assert lapsed == 0  # it was completed: nothing to lapse
    assert resent is not None  # the answer waited for the third completion
    assert "Idempotency outcome stored after" in caplog.text
