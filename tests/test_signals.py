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
from django.urls import re_path
from django.utils import timezone
from django.utils.crypto import salted_hmac

from idempotency_django import signals
from idempotency_django.models import IdempotencyRecord
from tests import records
from tests.conftest import Post
from tests.project import views
from tests.project.logs import everything_logged

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
            calls[name].append({"sender": sender, **kwargs, "raw_key": signals.raw_key()})

        signal: Signal = getattr(signals, name)
        signal.connect(receiver, weak=False)
        receivers.append((signal, receiver))
    yield calls.__getitem__
    for signal, receiver in receivers:
        signal.disconnect(receiver)


def test_claimed_then_replayed(alice: User, post: Post, sent: Any) -> None:
    post("/effect/", {"amount": 1})
    post("/effect/", {"amount": 1})

    scope = {"account": str(alice.pk), "endpoint": "POST /effect/", "raw_key": "k1"}
    assert [{k: c[k] for k in scope} for c in sent("claimed")] == [scope]
    assert sent("claimed")[0]["sender"] is IdempotencyRecord
    assert [c["status"] for c in sent("replayed")] == [201]


def test_mismatch_and_released(alice: User, post: Post, sent: Any) -> None:
    post("/effect/", {"amount": 1})
    post("/effect/", {"amount": 2})
    post("/effect/", {"status": 503}, key="k2")

    assert len(sent("mismatch")) == 1
    assert [c["raw_key"] for c in sent("released")] == ["k2"]


def test_in_flight_and_lease_taken_over(alice: User, post: Post, sent: Any) -> None:
    post("/effect/", {"amount": 1})
    records.update(
        state=IdempotencyRecord.State.IN_PROGRESS,
        lease_expires_at=timezone.now() + timedelta(seconds=30),
    )
    post("/effect/", {"amount": 1})
    records.update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    post("/effect/", {"amount": 1})

    assert len(sent("in_flight")) == 1
    assert len(sent("lease_taken_over")) == 1


@pytest.mark.database_store("injects SQL failures; the Redis store's: test_redis_store")
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


def test_keys_can_be_logged_as_a_keyed_digest(
    alice: User, post: Post, caplog: pytest.LogCaptureFixture, settings: Any
) -> None:
    settings.IDEMPOTENCY = {"LOG_KEYS": "hash"}
    with caplog.at_level(logging.DEBUG, logger="idempotency_django"):
        post("/effect/", {"amount": 1}, key="order-4711")
        post("/effect/", {"amount": 2}, key="order-4711")  # a mismatch: logged at WARNING

    assert len(caplog.records) >= 2
    assert not [text for text in everything_logged(caplog.records) if "order-4711" in text]
    keys = {getattr(r, "idempotency_key", None) for r in caplog.records} - {None}
    assert keys == {signals.log_key("order-4711")}
    (digest,) = keys
    assert digest.startswith("hmac-sha256:")
    assert len(digest) == len("hmac-sha256:") + 64  # the full SHA-256, not truncated


def test_plain_keys_are_logged_as_they_are(
    alice: User, post: Post, caplog: pytest.LogCaptureFixture, settings: Any
) -> None:
    """The same check as above finds the key when it is logged: it can fail."""
    settings.IDEMPOTENCY = {"LOG_KEYS": "plain"}
    with caplog.at_level(logging.DEBUG, logger="idempotency_django"):
        post("/effect/", {"amount": 1}, key="order-4711")

    assert [text for text in everything_logged(caplog.records) if "order-4711" in text]
    assert {getattr(r, "idempotency_key", None) for r in caplog.records} - {None} == {"order-4711"}


def test_the_key_digest_needs_the_secret_key(settings: Any) -> None:
    """Stable within one deployment (to correlate), unguessable without ``SECRET_KEY``."""
    settings.IDEMPOTENCY = {"LOG_KEYS": "hash"}
    digest = signals.log_key("order-4711")

    assert signals.log_key("order-4711") == digest
    assert signals.log_key("order-4712") != digest
    unsalted = hashlib.sha256(b"order-4711").hexdigest()
    assert unsalted[:32] not in digest
    assert (
        digest
        == "hmac-sha256:"
        + salted_hmac(
            "idempotency_django.signals.log_key", "order-4711", algorithm="sha256"
        ).hexdigest()
    )
    settings.SECRET_KEY = "another-deployment"
    assert signals.log_key("order-4711") != digest


@pytest.mark.parametrize(
    ("raw", "logged"),
    [
        ("POST /a\r\nINFO forged line", "POST /a\\r\\nINFO forged line"),
        ("k\x00\x1b[31m\x7f", "k\\x00\\x1b[31m\\x7f"),
        ("a\u2028b\u202ec\x85", "a\\u2028b\\u202ec\\x85"),
        ("tab\there", "tab\\there"),
        ("back\\slash", "back\\\\slash"),
        ("POST /caf\u00e9/ ok", "POST /caf\u00e9/ ok"),
    ],
)
def test_log_fields_escape_control_characters(raw: str, logged: str) -> None:
    fields = signals.log_fields(raw, raw, raw, policy=raw, status=201)

    assert fields == {
        "idempotency_account": logged,
        "idempotency_endpoint": logged,
        "idempotency_key": logged,
        "idempotency_policy": logged,
        "idempotency_status": 201,
    }
    for value in fields.values():
        assert "\n" not in str(value)
        assert "\r" not in str(value)


@pytest.mark.urls(__name__)
def test_a_forged_path_stays_on_one_log_line(
    alice: User, post: Post, caplog: pytest.LogCaptureFixture
) -> None:
    """A CR/LF in the path (percent-encoded on the wire) reaches the endpoint decoded: every
    record that names it has it escaped, so it cannot start a line of its own."""
    with caplog.at_level(logging.DEBUG, logger="idempotency_django"):
        post("/forged/%0D%0AINFO%20forged%00/", {"amount": 1})
        post("/forged/%0D%0AINFO%20forged%00/", {"amount": 2})  # a mismatch: a WARNING

    endpoints = {getattr(r, "idempotency_endpoint", None) for r in caplog.records} - {None}
    assert endpoints == {"POST /forged/\\r\\nINFO forged\\x00/"}
    for text in everything_logged(caplog.records):
        assert "\n" not in text
        assert "\r" not in text
        assert "\x00" not in text


def test_receivers_get_the_keys_digest_and_ask_for_the_key_itself(
    alice: User, post: Post, sent: Any
) -> None:
    """A receiver that forwards its arguments (an error tracker, a metrics label) never
    carries the client's key: ``key`` is its keyed digest, whatever ``LOG_KEYS`` says."""
    post("/effect/", {"amount": 1}, key="order-4711")
    post("/effect/", {"amount": 2}, key="order-4711")  # a mismatch
    post("/effect/", {"status": 503}, key="order-4712")  # released

    every = [call for name in ALL for call in sent(name)]
    assert len(every) >= 4
    for call in every:
        assert call["key"] == signals.key_digest(call["raw_key"])
        assert "order-47" not in repr({k: v for k, v in call.items() if k != "raw_key"})
    assert {call["raw_key"] for call in every} == {"order-4711", "order-4712"}


def test_the_key_is_given_to_receivers_only_while_the_signal_is_sent() -> None:
    with pytest.raises(LookupError, match="receiver"):
        signals.raw_key()
    seen: list[str] = []

    def receiver(**kwargs: Any) -> None:
        seen.append(signals.raw_key())

    signals.mismatch.connect(receiver)
    try:
        signals.send(signals.mismatch, "a", "POST /x/", "k-raw")
    finally:
        signals.mismatch.disconnect(receiver)

    assert seen == ["k-raw"]
    with pytest.raises(LookupError):
        signals.raw_key()


def test_an_async_receiver_asks_for_the_key_too() -> None:
    seen: list[tuple[str, str]] = []

    async def receiver(key: str, **kwargs: Any) -> None:
        seen.append((key, signals.raw_key()))

    signals.mismatch.connect(receiver)
    try:
        signals.send(signals.mismatch, "a", "POST /x/", "k-async")
    finally:
        signals.mismatch.disconnect(receiver)

    assert seen == [(signals.key_digest("k-async"), "k-async")]


def test_the_docs_receiver_gets_the_digest_and_asks_for_the_key(alice: User, post: Post) -> None:
    from tests.docs_snippets import signals_raw_key

    try:
        post("/effect/", {"status": 503}, key="order-4711")  # released
    finally:
        signals.released.disconnect(signals_raw_key.on_released)

    assert signals_raw_key.audit == [f"released {signals.key_digest('order-4711')}"]
    assert signals_raw_key.notified == [(str(alice.pk), "order-4711")]


# This module is also the URLconf of the test above: a view whose path can hold anything.
urlpatterns = [re_path(r"^forged/", views.effect)]
