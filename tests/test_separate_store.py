"""A store in a database of its own (``IDEMPOTENCY["DATABASE"]``), the work in another with
``ATOMIC_REQUESTS``: the completion never commits before the work does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from django.contrib.auth.models import User
from django.db import IntegrityError, connections
from django.utils import timezone

from idempotency_django import signals
from idempotency_django.models import IdempotencyRecord
from tests.conftest import Post
from tests.models import SideEffect

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=["default", "store"]),
    pytest.mark.database_store("a store in a second database alias"),
]


@pytest.fixture
def separate_store(settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    settings.IDEMPOTENCY = {"DATABASE": "store"}
    monkeypatch.setitem(connections["default"].settings_dict, "ATOMIC_REQUESTS", True)


def records() -> Any:
    return IdempotencyRecord.objects.using("store")


def test_the_record_lives_in_the_store_and_the_work_in_default(
    alice: User, post: Post, separate_store: None
) -> None:
    first = post("/orphan/", {})
    retry = post("/orphan/", {})

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert SideEffect.objects.filter(label="orphan").count() == 1
    assert records().get().state == IdempotencyRecord.State.COMPLETED
    assert not IdempotencyRecord.objects.using("default").exists()


def test_work_that_fails_to_commit_is_never_replayed_as_a_success(
    alice: User, post: Post, separate_store: None
) -> None:
    if connections["default"].vendor != "postgresql":
        pytest.skip("needs a foreign key checked at COMMIT (PostgreSQL's deferred constraints)")
    # The view returns 201; then default's COMMIT fails on the dangling foreign key.
    failed = post("/orphan/", {"parent": 10**9})

    # Its own problem, not a store to wait for: a 500 without Retry-After.
    assert failed.status_code == 500
    assert "Retry-After" not in failed
    assert json.loads(failed.content)["type"].endswith("work-not-committed")
    assert SideEffect.objects.filter(label="orphan").count() == 0
    # Released, not completed: a retry runs (and fails the same way).
    assert not records().exists()
    retry = post("/orphan/", {"parent": 10**9})
    assert retry.status_code == 500
    good = post("/orphan/", {}, key="k2")
    assert good.status_code == 201
    assert SideEffect.objects.filter(label="orphan").count() == 1


def test_the_packages_client_does_not_retry_work_that_failed_to_commit(
    alice: User, separate_store: None
) -> None:
    """End to end: ``IdempotentClient`` against the app. A 503 would be retried until the
    attempts run out, each run failing the same way; ``work-not-committed`` is final."""
    if connections["default"].vendor != "postgresql":
        pytest.skip("needs a foreign key checked at COMMIT (PostgreSQL's deferred constraints)")
    from django.core.handlers.wsgi import WSGIHandler

    from idempotency_django.client import IdempotentClient

    http = httpx.Client(
        base_url="http://testserver",
        transport=httpx.WSGITransport(app=WSGIHandler()),
        headers={"X-User": "alice"},
    )
    with IdempotentClient(http, sleep=lambda seconds: None) as client:
        result = client.post("/orphan/", key="order-1", json={"parent": 10**9})

    assert result.status_code == 500
    assert result.json()["type"].endswith("work-not-committed")
    assert result.attempts == 1
    assert not records().exists()


# --- the store's COMMIT fails after the work's committed -------------------


@pytest.fixture
def both_atomic(separate_store: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(connections["store"].settings_dict, "ATOMIC_REQUESTS", True)


@pytest.fixture
def not_stored() -> Iterator[list[dict[str, Any]]]:
    sent: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        sent.append({**kwargs, "key": signals.raw_key()})

    signals.outcome_not_stored.connect(receiver)
    yield sent
    signals.outcome_not_stored.disconnect(receiver)


def lapse_the_lease() -> None:
    records().update(lease_expires_at=timezone.now() - timedelta(seconds=1))


def assert_kept_not_released(failed: Any, retry: Any, not_stored: list[dict[str, Any]]) -> None:
    assert failed.status_code == 503
    assert failed["Retry-After"] == "1"
    problem = json.loads(failed.content)
    assert problem["type"].endswith("store-unavailable")
    assert "may have been carried out" in problem["detail"]  # not "it failed"
    assert SideEffect.objects.filter(label="orphan_in_store").count() == 1  # committed
    # Kept, as after a lost connection: the retry is refused, not run a second time.
    assert records().get().state == IdempotencyRecord.State.IN_PROGRESS
    assert retry.status_code == 409
    assert SideEffect.objects.filter(label="orphan_in_store").count() == 1
    assert [sent["key"] for sent in not_stored] == ["k1"]


def test_a_store_commit_refused_after_the_work_committed_keeps_the_key(
    alice: User, post: Post, both_atomic: None, not_stored: list[dict[str, Any]]
) -> None:
    if connections["store"].vendor != "postgresql":
        pytest.skip("needs a foreign key checked at COMMIT (PostgreSQL's deferred constraints)")
    # default (the work) commits; then the store's COMMIT fails on its dangling foreign key.
    failed = post("/orphan-in-store/", {"parent": 10**9})
    retry = post("/orphan-in-store/", {"parent": 10**9})

    assert_kept_not_released(failed, retry, not_stored)
    lapse_the_lease()
    assert post("/orphan-in-store/", {"parent": 10**9}).status_code == 503
    assert SideEffect.objects.filter(label="orphan_in_store").count() == 2  # after the lapse


def test_a_store_commit_that_fails_after_the_work_committed_keeps_the_key_on_every_backend(
    alice: User,
    post: Post,
    both_atomic: None,
    not_stored: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same on backends without deferred constraints: the store's server refuses its
    COMMIT (an integrity error, not a lost connection) after default's went through."""
    store = connections["store"]
    commit = store._commit

    def refused() -> None:
        store._rollback()
        raise IntegrityError("the store refused the COMMIT")

    monkeypatch.setattr(store, "_commit", refused)
    failed = post("/orphan-in-store/", {})
    monkeypatch.setattr(store, "_commit", commit)
    retry = post("/orphan-in-store/", {})

    assert_kept_not_released(failed, retry, not_stored)
    lapse_the_lease()
    assert post("/orphan-in-store/", {}).status_code == 201
    assert SideEffect.objects.filter(label="orphan_in_store").count() == 2


def test_under_both_request_transactions_the_work_commits_before_the_store(
    alice: User, post: Post, both_atomic: None
) -> None:
    """Both databases under ATOMIC_REQUESTS: the completion is written in the store's
    transaction, which must commit *after* the work's. Were it first, a work whose COMMIT then
    fails would leave a stored 201 behind, replayed to every retry."""
    if connections["default"].vendor != "postgresql":
        pytest.skip("needs a foreign key checked at COMMIT (PostgreSQL's deferred constraints)")
    failed = post("/orphan/", {"parent": 10**9})
    retry = post("/orphan/", {"parent": 10**9})

    assert failed.status_code == 500
    assert json.loads(failed.content)["type"].endswith("work-not-committed")
    assert "Idempotent-Replayed" not in retry
    assert retry.status_code == 500
    assert not records().exists()
    assert SideEffect.objects.filter(label="orphan").count() == 0
