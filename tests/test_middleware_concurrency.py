"""``IdempotencyMiddleware`` under real concurrency: threads with their own database
connections, released together by a barrier, against PostgreSQL and MariaDB. The first
request is held inside its view (``gate``) until every duplicate has been answered."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connections
from rest_framework.authtoken.models import Token

from tests import records
from tests.conftest import effects, post_from_thread
from tests.project.views import gate
from tools.threads import start_together

pytestmark = [
    pytest.mark.concurrency,
    pytest.mark.django_db(transaction=True),
    pytest.mark.urls("tests.project.middleware_urls"),
]

THREADS = 8
MIDDLEWARE = "idempotency_django.middleware.IdempotencyMiddleware"


@pytest.fixture(autouse=True)
def middleware(settings: Any) -> None:
    settings.MIDDLEWARE = [*settings.MIDDLEWARE, MIDDLEWARE]


def race(path: str, body: dict[str, Any], headers: dict[str, str]) -> list[Any]:
    """``THREADS`` identical requests at once; the one that runs is held in its view until
    the others were answered, then let go. Returns every response."""
    results, threads = start_together(THREADS, lambda: post_from_thread(path, body, headers))
    try:
        losers = [results.get(timeout=30) for _ in range(THREADS - 1)]
        # The winner claimed before any loser was answered; it may reach its view after
        # them (a loaded machine), but it cannot leave it before the gate opens.
        assert gate.entered.wait(timeout=30)
    finally:
        gate.release.set()
        for thread in threads:
            thread.join(timeout=30)
    return [*losers, results.get(timeout=30)]


def assert_one_ran(responses: list[Any]) -> None:
    assert sorted(r.status_code for r in responses) == [201] + [409] * (THREADS - 1)
    for response in responses:
        if response.status_code == 409:
            assert response["Content-Type"] == "application/problem+json"
            assert response["Retry-After"].isdigit()


def test_concurrent_duplicates_on_a_plain_view_run_it_once(alice: User) -> None:
    headers = {"Idempotency-Key": "k1", "X-User": "alice"}
    responses = race("/mw/plain/", {"gate": True}, headers)

    assert_one_ran(responses)
    assert effects("mw_plain") == 1
    assert post_from_thread("/mw/plain/", {"gate": True}, headers)["Idempotent-Replayed"] == "true"
    assert records.count() == 1


def test_concurrent_duplicates_on_a_drf_view_run_it_once(alice: User) -> None:
    token = Token.objects.create(user=alice).key
    headers = {"Idempotency-Key": "k1", "Authorization": f"Token {token}"}
    body = {"amount": 1, "gate": True}
    responses = race("/mw/drf/", body, headers)

    assert_one_ran(responses)
    assert effects("mw_drf") == 1
    assert post_from_thread("/mw/drf/", body, headers)["Idempotent-Replayed"] == "true"
    assert records.get().account == str(alice.pk)


def test_concurrent_duplicates_under_atomic_requests_run_the_view_once(
    alice: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(connections["default"].settings_dict, "ATOMIC_REQUESTS", True)
    headers = {"Idempotency-Key": "k1", "X-User": "alice"}
    responses = race("/mw/plain/", {"gate": True}, headers)

    assert_one_ran(responses)
    assert effects("mw_plain") == 1
    assert post_from_thread("/mw/plain/", {"gate": True}, headers)["Idempotent-Replayed"] == "true"


def test_concurrent_duplicates_of_a_decorated_view_are_claimed_once(alice: User) -> None:
    headers = {"Idempotency-Key": "k1", "X-User": "alice"}
    responses = race("/mw/decorated/", {"gate": True}, headers)

    assert_one_ran(responses)
    assert effects("effect") == 1
    assert records.count() == 1


@pytest.mark.parametrize(
    ("path", "label"),
    [("/mw/wrapped/", "mw_wrapped"), ("/mw/calls-charge/", "mw_charge")],
)
def test_concurrent_duplicates_of_a_nested_idempotent_layer_run_it_once(
    alice: User, path: str, label: str
) -> None:
    """Claimed by the middleware, then met again by ``@idempotent`` inside the view: the
    inner layer runs under the outer claim, and duplicates from other threads get 409."""
    headers = {"Idempotency-Key": "k1", "X-User": "alice"}
    responses = race(path, {"gate": True}, headers)

    assert_one_ran(responses)
    assert effects(label) == 1
    assert post_from_thread(path, {"gate": True}, headers)["Idempotent-Replayed"] == "true"
    assert records.count() == 1
