"""Unknown outcomes are never released (docs/guarantees.md): a view whose database connection
broke after a write (``InterfaceError``, or an ``OperationalError`` of a lost connection) may
have committed that write, so its key stays claimed until its lease lapses, on every adapter,
whether the error propagates or the framework answers it (a DRF ``EXCEPTION_HANDLER``, a
ninja exception handler). A retry meanwhile is told 409; after the lease lapses it runs."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import (
    DatabaseError,
    DataError,
    InterfaceError,
    OperationalError,
    connection,
    connections,
    transaction,
)
from django.test import Client
from django.utils import timezone

from idempotency_django import signals
from idempotency_django.models import IdempotencyRecord
from idempotency_django.tasks import TaskInFlight, idempotent_task
from tests import records
from tests.conftest import Post, another_waits_for_a_row_lock, effects, wait_until
from tests.models import SideEffect
from tests.project import unknown_outcome_views
from tests.test_lifecycle import is_completion

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.urls("tests.project.unknown_outcome_views"),
]

State = IdempotencyRecord.State

PATHS = {
    "decorator": "/uo/decorated/",
    "decorator-async": "/uo/decorated-async/",
    "middleware": "/uo/plain/",
    "drf-mixin": "/uo/drf/",
    "drf-mixin-handler-answers": "/uo/drf-handled/",
    "middleware-drf-handler-answers": "/uo/drf-plain-handled/",
    "ninja-handler-answers": "/uo/ninja/op/",
    "ninja-async-handler-answers": "/uo/ninja/async-op/",
}
ERRORS = [InterfaceError, OperationalError]


@pytest.fixture(autouse=True)
def middleware(settings: Any) -> None:
    settings.MIDDLEWARE = [
        *settings.MIDDLEWARE,
        "idempotency_django.middleware.IdempotencyMiddleware",
    ]


@pytest.fixture
def losing() -> Iterator[list[type[DatabaseError]]]:
    yield unknown_outcome_views.LOSING
    unknown_outcome_views.LOSING.clear()


def lapse_the_lease() -> None:
    """What time does to a claim nobody renews (its worker crashed or gave it up)."""
    records.update(lease_expires_at=timezone.now() - timedelta(seconds=1))


@pytest.mark.parametrize("error", ERRORS, ids=lambda error: error.__name__)
@pytest.mark.parametrize("path", PATHS.values(), ids=PATHS.keys())
def test_a_view_that_lost_its_connection_keeps_its_key_until_its_lease_lapses(
    alice: User,
    post: Post,
    client: Client,
    losing: list[type[DatabaseError]],
    path: str,
    error: type[DatabaseError],
) -> None:
    client.raise_request_exception = False
    losing.append(error)

    failed = post(path, {"amount": 1})
    retry = post(path, {"amount": 1})

    assert failed.status_code == 500
    assert retry.status_code == 409
    assert retry["Retry-After"] == "1"  # in flight (in the project's format, if it has one)
    assert effects() == 1  # the retry did not run the work again
    assert records.get().state == State.IN_PROGRESS

    lapse_the_lease()
    losing.clear()
    after = post(path, {"amount": 1})

    assert after.status_code == 201
    assert effects() == 2  # the one second run docs/guarantees.md allows: after the lease lapsed


@idempotent_task(scope="orders", key="message_id", name="loses-its-connection")
def task_loses_its_connection(message_id: str) -> int:
    return unknown_outcome_views._work("task")


@pytest.mark.parametrize("error", ERRORS, ids=lambda error: error.__name__)
def test_a_task_that_lost_its_connection_keeps_its_key_until_its_lease_lapses(
    losing: list[type[DatabaseError]], error: type[DatabaseError]
) -> None:
    losing.append(error)

    with pytest.raises(error):
        task_loses_its_connection("m1")
    with pytest.raises(TaskInFlight):
        task_loses_its_connection("m1")
    assert SideEffect.objects.count() == 1

    lapse_the_lease()
    losing.clear()
    task_loses_its_connection("m1")

    assert SideEffect.objects.count() == 2


# --- work that committed, and whose outcome cannot be stored ---------------


@pytest.mark.database_store("refuses the completion's SQL statement")
def test_an_outcome_the_store_refuses_after_the_work_committed_is_signalled_and_keeps_the_key(
    alice: User, post: Post
) -> None:
    """The work committed and its response is sent (it is true); the store refuses the
    completion for its data, which no resend changes: it is given up at once. The key is
    kept, not released: a retry is told 409 until the lease lapses, and
    ``outcome_not_stored`` tells the operators, with the status sent."""
    sent: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        sent.append({**kwargs, "key": signals.raw_key()})

    refused: list[str] = []

    def refuse_completions(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
        if is_completion(sql, params):
            refused.append(sql)
            raise DataError("the store refuses the completion")
        return execute(sql, params, many, context)

    signals.outcome_not_stored.connect(receiver)
    try:
        with connection.execute_wrapper(refuse_completions):
            first = post("/uo/decorated/", {"amount": 1})
    finally:
        signals.outcome_not_stored.disconnect(receiver)
    retry = post("/uo/decorated/", {"amount": 1})

    assert first.status_code == 201
    assert [(s["key"], s["status"]) for s in sent] == [("k1", 201)]
    assert len(refused) == 1  # refused for its data: not sent again, the answer not held
    assert records.get().state == State.IN_PROGRESS
    assert retry.status_code == 409
    assert effects() == 1


# --- work the database rolled back: a known failure, released -------------------------------
#
# A deadlock, a serialization failure or a lock timeout is an OperationalError too, but the
# database says with it that it rolled the work back (by SQLSTATE, or MySQL's error code):
# nothing of it committed, so its key is released and the retry runs at once, instead of
# waiting out a lease for an outcome that is known.

CONTENDED = {
    "decorator": ("/uo/contended/", "contended"),
    "drf-mixin-handler-answers": ("/uo/contended-drf-handled/", "contended_drf"),
}


@pytest.fixture
def contention() -> Iterator[unknown_outcome_views.Contention]:
    unknown_outcome_views.CONTENTION.reset()
    yield unknown_outcome_views.CONTENTION
    unknown_outcome_views.CONTENTION.reset()


@contextlib.contextmanager
def row_held(label: str) -> Iterator[None]:
    """Another connection holds the ``SideEffect`` row ``label`` locked inside the block."""
    holding, let_go = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                unknown_outcome_views.lock_row(label)
                holding.set()
                let_go.wait(60)  # bounded, so that a hanging view still ends the test
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(20)
        yield
    finally:
        let_go.set()
        holder.join(60)


@pytest.mark.concurrency
@pytest.mark.database_store("the work's own database transaction, rolled back by the database")
@pytest.mark.parametrize(("path", "label"), CONTENDED.values(), ids=CONTENDED.keys())
def test_a_view_whose_row_lock_timed_out_releases_its_key_and_the_retry_runs(
    alice: User,
    post: Post,
    client: Client,
    contention: unknown_outcome_views.Contention,
    path: str,
    label: str,
) -> None:
    client.raise_request_exception = False
    SideEffect.objects.create(label="locked-row")
    contention.kind = "lock-timeout"
    with row_held("locked-row"):
        failed = post(path, {"amount": 1})
    contention.kind = None

    retry = post(path, {"amount": 1})
    replay = post(path, {"amount": 1})

    assert failed.status_code == 500
    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry
    assert replay["Idempotent-Replayed"] == "true"
    assert effects(label) == 1  # the timed-out run's row was rolled back with its work


@pytest.mark.concurrency
@pytest.mark.database_store("the work's own database transaction, rolled back by the database")
@pytest.mark.parametrize(("path", "label"), CONTENDED.values(), ids=CONTENDED.keys())
def test_a_view_picked_as_a_deadlock_victim_releases_its_key_and_the_retry_runs(
    alice: User,
    post: Post,
    contention: unknown_outcome_views.Contention,
    path: str,
    label: str,
) -> None:
    """A real deadlock: the view holds ``row-a`` and asks for ``row-b``, which this test
    holds while it asks for ``row-a``. The database rolls the view's transaction back."""
    SideEffect.objects.bulk_create([SideEffect(label="row-a"), SideEffect(label="row-b")])
    contention.kind = "deadlock"
    answers: dict[str, Any] = {}

    def first() -> None:
        try:
            answers["failed"] = Client(raise_request_exception=False).post(
                path,
                data='{"amount": 1}',
                content_type="application/json",
                headers={"Idempotency-Key": "k1", "X-User": "alice"},
            )
        finally:
            connections.close_all()

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert contention.holding_a.wait(30)
        with transaction.atomic():
            if connection.vendor == "postgresql":
                with connection.cursor() as cursor:  # the view's 3 s runs out first
                    cursor.execute("SET LOCAL deadlock_timeout = '60s'")
            else:  # InnoDB rolls back the transaction that wrote fewer rows: the view's
                SideEffect.objects.bulk_create([SideEffect(label="heavier")] * 10)
            unknown_outcome_views.lock_row("row-b")
            contention.helper_holds_b.set()
            assert wait_until(another_waits_for_a_row_lock)
            unknown_outcome_views.lock_row("row-a")  # granted once the view is rolled back
            transaction.set_rollback(True)
    finally:
        contention.helper_holds_b.set()
        thread.join(60)
    contention.kind = None

    retry = post(path, {"amount": 1})

    assert answers["failed"].status_code == 500
    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry
    assert effects(label) == 1


@idempotent_task(scope="orders", key="message_id", name="meets-a-locked-row")
def task_meets_a_locked_row(message_id: str) -> int:
    return unknown_outcome_views._contended_work("task")


@pytest.mark.concurrency
@pytest.mark.database_store("the work's own database transaction, rolled back by the database")
def test_a_task_whose_row_lock_timed_out_releases_its_key(
    contention: unknown_outcome_views.Contention,
) -> None:
    SideEffect.objects.create(label="locked-row")
    contention.kind = "lock-timeout"
    with row_held("locked-row"), pytest.raises(OperationalError):
        task_meets_a_locked_row("m1")
    contention.kind = None

    task_meets_a_locked_row("m1")  # not TaskInFlight: the key was released

    assert effects("task") == 1
    assert records.get().state == State.COMPLETED


@pytest.mark.concurrency
def test_a_lost_connection_stays_unknown_and_a_lock_timeout_does_not() -> None:
    """The rule, on real errors of this database: a lock timeout's code says "rolled back"; an
    error without such a code (a lost connection) keeps the key."""
    from idempotency_django.core.decisions import outcome_unknown

    SideEffect.objects.create(label="locked-row")
    with row_held("locked-row"), transaction.atomic(), pytest.raises(OperationalError) as raised:
        unknown_outcome_views.lock_row("locked-row", lock_timeout=True)

    assert not outcome_unknown(raised.value)
    assert outcome_unknown(OperationalError("server closed the connection unexpectedly"))
    assert outcome_unknown(InterfaceError("connection already closed"))
