"""Unknown outcomes are never released (issue 17, item 6): a view whose database connection
broke after a write (``InterfaceError``, or an ``OperationalError`` of a lost connection) may
have committed that write, so its key stays claimed until its lease lapses, on every adapter,
whether the error propagates or the framework answers it (a DRF ``EXCEPTION_HANDLER``, a
ninja exception handler). A retry meanwhile is told 409; after the lease lapses it runs."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import DatabaseError, DataError, InterfaceError, OperationalError, connection
from django.test import Client
from django.utils import timezone

from idempotency_django import signals
from idempotency_django.models import IdempotencyRecord
from idempotency_django.tasks import TaskInFlight, idempotent_task
from tests import records
from tests.conftest import Post, effects
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
    assert effects() == 2  # the one second run §7a allows: after the lease lapsed


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


# --- work that committed, and whose outcome cannot be stored (issue 21, item 1) ---------------


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
        sent.append(kwargs)

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
