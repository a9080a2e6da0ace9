"""Database round trips per request: the cost that does not depend on the machine.

Every statement is counted (savepoints included) and compared with the same view body run
unprotected, so the budget is what the app adds, whatever the view and middleware do.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from tests.conftest import Post

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _on_postgresql_and_mariadb() -> None:
    # SQLite's backend sends an explicit BEGIN for every transaction.atomic(): the budget is
    # pinned where production runs.
    if connection.vendor not in ("postgresql", "mysql"):
        pytest.skip("the query budget is pinned on PostgreSQL and MariaDB")


TRANSACTION_CONTROL = ("BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE SAVEPOINT")


def statements(send: Any, transaction_pairs: int = 0) -> tuple[int, Any]:
    """Statements sent while ``send()`` runs, less at most ``transaction_pairs`` pairs of
    transaction control (atomic mode's own transaction: BEGIN/COMMIT, or SAVEPOINT/RELEASE
    when it is nested)."""
    with CaptureQueriesContext(connection) as context:
        response = send()
    sql = [query["sql"] for query in context.captured_queries]
    control = [s for s in sql if s.upper().startswith(TRANSACTION_CONTROL)]
    assert len(control) <= 2 * transaction_pairs, control
    return len(sql) - len(control), response


def pairs(path: str) -> int:
    return 1 if path == "/atomic/" else 0


@pytest.fixture
def unprotected(alice: User, post: Post) -> int:
    count, response = statements(lambda: post("/optional/", {"amount": 1}, key=None))
    assert response.status_code == 201
    return count


@pytest.mark.parametrize("path", ["/effect/", "/atomic/"])
def test_first_request_adds_two_statements(post: Post, unprotected: int, path: str) -> None:
    count, response = statements(lambda: post(path, {"amount": 1}), pairs(path))

    assert response.status_code == 201
    assert count - unprotected <= 2  # the claim and the completion


@pytest.mark.parametrize("path", ["/effect/", "/atomic/"])
def test_replay_costs_two_statements_and_no_view_code(
    post: Post, unprotected: int, path: str
) -> None:
    post(path, {"amount": 1})
    count, response = statements(lambda: post(path, {"amount": 1}), pairs(path))

    assert response["Idempotent-Replayed"] == "true"
    # The view's own statement (one INSERT) did not run: the claim attempt and one read did.
    view_statements = 1
    assert count - (unprotected - view_statements) <= 2


def test_mismatch_costs_two_statements(post: Post, unprotected: int) -> None:
    post("/effect/", {"amount": 1})
    count, response = statements(lambda: post("/effect/", {"amount": 2}))

    assert response.status_code == 422
    assert count - (unprotected - 1) <= 2


def test_in_flight_conflict_costs_two_statements(post: Post, unprotected: int) -> None:
    from idempotency_django.models import IdempotencyRecord

    post("/effect/", {"amount": 1})
    IdempotencyRecord.objects.update(
        state=IdempotencyRecord.State.IN_PROGRESS,
        lease_expires_at=timezone.now() + timedelta(seconds=60),
    )
    count, response = statements(lambda: post("/effect/", {"amount": 1}))

    assert response.status_code == 409
    assert count - (unprotected - 1) <= 2


def test_malformed_key_costs_no_statement(post: Post, unprotected: int) -> None:
    count, response = statements(lambda: post("/effect/", {"amount": 1}, key=""))

    assert response.status_code == 400
    assert count - (unprotected - 1) == 0
