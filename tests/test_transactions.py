"""The two transaction modes and ATOMIC_REQUESTS (docs/transactions.md)."""

from __future__ import annotations

import logging

import pytest
from django.contrib.auth.models import User
from django.db import connections

from idempotency_django.models import IdempotencyRecord
from tests.conftest import Post, effects

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def atomic_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(connections["default"].settings_dict, "ATOMIC_REQUESTS", True)


@pytest.mark.database_store("atomic mode")
def test_atomic_mode_stores_and_replays(alice: User, post: Post) -> None:
    first = post("/atomic/", {"amount": 1})
    retry = post("/atomic/", {"amount": 1})

    assert first.status_code == retry.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert effects() == 1


@pytest.mark.database_store("atomic mode")
def test_atomic_mode_5xx_rolls_back_the_work_and_the_claim(alice: User, post: Post) -> None:
    response = post("/atomic/", {"status": 503})

    assert response.status_code == 503
    assert effects() == 0
    assert not IdempotencyRecord.objects.exists()


def test_atomic_mode_exception_rolls_back_the_work_and_the_claim(
    alice: User, post: Post, client
) -> None:  # type: ignore[no-untyped-def]
    client.raise_request_exception = False
    response = post("/atomic/", {"raise": True})

    assert response.status_code == 500
    assert effects() == 0
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.database_store("atomic mode")
def test_atomic_mode_mismatch_is_422(alice: User, post: Post) -> None:
    post("/atomic/", {"amount": 1})

    assert post("/atomic/", {"amount": 2}).status_code == 422
    assert effects() == 1


@pytest.mark.database_store("a claim inside the request's transaction (the Redis store has none)")
def test_atomic_requests_commits_the_work_with_the_completion(
    alice: User, post: Post, atomic_requests: None
) -> None:
    post("/effect/", {"amount": 1})
    retry = post("/effect/", {"amount": 1})

    assert retry["Idempotent-Replayed"] == "true"
    assert effects() == 1
    assert IdempotencyRecord.objects.get().state == IdempotencyRecord.State.COMPLETED


def test_atomic_requests_still_rolls_back_a_failed_view_and_releases_the_key(
    alice: User, post: Post, atomic_requests: None, client
) -> None:  # type: ignore[no-untyped-def]
    client.raise_request_exception = False
    response = post("/effect/", {"raise": True})

    assert response.status_code == 500
    assert effects() == 0  # ATOMIC_REQUESTS rolled the view's work back, as the project expects
    assert not IdempotencyRecord.objects.exists()


def test_protected_views_give_the_request_transactions_back_themselves(
    atomic_requests: None,
) -> None:
    """Django must not wrap the claim in ATOMIC_REQUESTS (in either mode): the lifecycle
    reopens each transaction around the view, except those the author opted out."""
    from tests.project import views

    for view in (views.effect, views.atomic):
        assert "default" in view._non_atomic_requests  # type: ignore[attr-defined]
        assert view._non_atomic_requests.to_reopen() == ["default"]  # type: ignore[attr-defined]


def test_non_atomic_requests_on_top_of_idempotent_is_not_reopened(
    atomic_requests: None,
) -> None:
    from django.db import transaction

    from idempotency_django.decorators import idempotent

    @transaction.non_atomic_requests(using="default")
    @idempotent(mode="atomic")
    def view(request: object) -> None: ...

    assert view._non_atomic_requests.to_reopen() == []  # type: ignore[attr-defined]


@pytest.mark.database_store("a claim inside the request's transaction (the Redis store has none)")
def test_commit_mode_inside_an_open_transaction_runs_atomically_and_says_so(
    alice: User, post: Post, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="idempotency_django"):
        first = post("/inside-atomic/", {"amount": 1})
    retry = post("/inside-atomic/", {"amount": 1})
    failed = post("/inside-atomic/", {"status": 500}, key="k2")

    assert "it runs in atomic mode" in caplog.text
    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert failed.status_code == 500
    assert effects("inside_atomic") == 1
