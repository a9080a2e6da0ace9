"""A store in a database of its own (``IDEMPOTENCY["DATABASE"]``), the work in another with
``ATOMIC_REQUESTS``: the completion never commits before the work does (issue 9, item 5)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connections

from idempotency_django.models import IdempotencyRecord
from tests.conftest import Post
from tests.models import SideEffect

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "store"])


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

    assert failed.status_code == 503
    assert failed["Retry-After"] == "1"
    assert json.loads(failed.content)["type"].endswith("store-unavailable")
    assert SideEffect.objects.filter(label="orphan").count() == 0
    # Released, not completed: a retry runs (and this one commits).
    assert not records().exists()
    retry = post("/orphan/", {"parent": 10**9}, key="k2")
    assert retry.status_code == 503
    good = post("/orphan/", {})
    assert good.status_code == 201
    assert SideEffect.objects.filter(label="orphan").count() == 1
