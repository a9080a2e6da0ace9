"""Signals and log records: one per event, with the scope as arguments and fields."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import OperationalError, connection
from django.dispatch import Signal
from django.utils import timezone

from idempotency_django import signals
from idempotency_django.models import IdempotencyRecord
from tests.conftest import Post

pytestmark = pytest.mark.django_db(transaction=True)

ALL = [
    "claimed",
    "replayed",
    "in_flight",
    "mismatch",
    "released",
    "lease_taken_over",
    "completion_lost",
    "store_unavailable",
]


@pytest.fixture
def sent() -> Iterator[Callable[[str], list[dict[str, Any]]]]:
    calls: dict[str, list[dict[str, Any]]] = {name: [] for name in ALL}
    receivers = []
    for name in ALL:

        def receiver(sender: Any, name: str = name, **kwargs: Any) -> None:
            calls[name].append({"sender": sender, **kwargs})

        signal: Signal = getattr(signals, name)
        signal.connect(receiver, weak=False)
        receivers.append((signal, receiver))
    yield calls.__getitem__
    for signal, receiver in receivers:
        signal.disconnect(receiver)


def test_claimed_then_replayed(alice: User, post: Post, sent: Any) -> None:
    post("/effect/", {"amount": 1})
    post("/effect/", {"amount": 1})

    scope = {"account": str(alice.pk), "endpoint": "POST /effect/", "key": "k1"}
    assert [{k: c[k] for k in scope} for c in sent("claimed")] == [scope]
    assert sent("claimed")[0]["sender"] is IdempotencyRecord
    assert [c["status"] for c in sent("replayed")] == [201]


def test_mismatch_and_released(alice: User, post: Post, sent: Any) -> None:
    post("/effect/", {"amount": 1})
    post("/effect/", {"amount": 2})
    post("/effect/", {"status": 503}, key="k2")

    assert len(sent("mismatch")) == 1
    assert [c["key"] for c in sent("released")] == ["k2"]


def test_in_flight_and_lease_taken_over(alice: User, post: Post, sent: Any) -> None:
    post("/effect/", {"amount": 1})
    IdempotencyRecord.objects.update(
        state=IdempotencyRecord.State.IN_PROGRESS,
        lease_expires_at=timezone.now() + timedelta(seconds=30),
    )
    post("/effect/", {"amount": 1})
    IdempotencyRecord.objects.update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    post("/effect/", {"amount": 1})

    assert len(sent("in_flight")) == 1
    assert len(sent("lease_taken_over")) == 1


def test_store_unavailable_names_the_policy(alice: User, post: Post, sent: Any) -> None:
    def fail(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
        if IdempotencyRecord._meta.db_table in sql:
            raise OperationalError("server closed the connection unexpectedly")
        return execute(sql, params, many, context)

    with connection.execute_wrapper(fail):
        post("/effect/", {})

    assert [c["policy"] for c in sent("store_unavailable")] == ["closed"]


def test_log_records_carry_the_scope(
    alice: User, post: Post, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="idempotency_django"):
        post("/effect/", {"amount": 1})
        post("/effect/", {"amount": 2})

    mismatch = next(r for r in caplog.records if "different request" in r.getMessage())
    assert mismatch.idempotency_key == "k1"  # type: ignore[attr-defined]
    assert mismatch.idempotency_account == str(alice.pk)  # type: ignore[attr-defined]
    assert mismatch.idempotency_endpoint == "POST /effect/"  # type: ignore[attr-defined]


def test_keys_can_be_logged_as_a_digest(
    alice: User, post: Post, caplog: pytest.LogCaptureFixture, settings: Any
) -> None:
    settings.IDEMPOTENCY = {"LOG_KEYS": "hash"}
    with caplog.at_level(logging.DEBUG, logger="idempotency_django"):
        post("/effect/", {"amount": 1}, key="order-4711")

    keys = {getattr(r, "idempotency_key", None) for r in caplog.records} - {None}
    assert keys == {"sha256:" + hashlib.sha256(b"order-4711").hexdigest()[:32]}
    assert "order-4711" not in caplog.text
