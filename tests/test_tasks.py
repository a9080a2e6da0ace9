"""Non-HTTP work at most once per key (``idempotency_django.tasks``): the decorator and the
context manager, then a queue's redeliveries to several OS processes, with a crash."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import OperationalError, connection, connections, transaction
from django.utils import timezone

from idempotency_django import signals
from idempotency_django.core import shell
from idempotency_django.core.heartbeat import heartbeat
from idempotency_django.exceptions import InFlight, KeyMalformed, KeyMismatch, ResponseNotStored
from idempotency_django.models import IdempotencyRecord
from idempotency_django.tasks import (
    TaskInFlight,
    TaskKeyMalformed,
    TaskKeyMismatch,
    TaskResultNotStored,
    TaskRun,
    TaskStoreUnavailable,
    claim_once,
    idempotent_task,
    task_key,
)
from tests import records
from tests.conftest import effects, wait_until
from tests.models import SideEffect
from tests.project.views import gate

pytestmark = pytest.mark.django_db(transaction=True)

State = IdempotencyRecord.State


@idempotent_task(scope="orders", key="message_id")
def charge(message_id: str, amount: int, note: str = "") -> dict[str, Any]:
    effect = SideEffect.objects.create(label="charge")
    if amount < 0:
        raise ValueError("negative amount")
    return {"effect": effect.pk, "amount": amount}


@idempotent_task(scope="orders", key="message_id", fingerprint_args=["amount"])
def charge_amount_only(message_id: str, amount: int, note: str = "") -> dict[str, Any]:
    SideEffect.objects.create(label="charge_amount_only")
    return {"amount": amount, "note": note}


@idempotent_task(scope="orders", key="message_id", mode="atomic")
def charge_atomic(message_id: str, amount: int) -> dict[str, Any]:
    effect = SideEffect.objects.create(label="charge_atomic")
    if amount < 0:
        raise ValueError("negative amount")
    return {"effect": effect.pk, "amount": amount}


NEXT: list[Any] = []


@idempotent_task(scope="orders", key="message_id")
def returns_next(message_id: str) -> Any:
    SideEffect.objects.create(label="returns_next")
    return NEXT.pop(0)


@idempotent_task(scope="orders", key="message_id", mode="atomic")
def returns_next_atomic(message_id: str) -> Any:
    SideEffect.objects.create(label="returns_next_atomic")
    return NEXT.pop(0)


def _held(message_id: str) -> dict[str, Any]:
    gate.pass_through()
    return {"effect": SideEffect.objects.create(label="held").pk}


# One task under one stable name, decorated three ways: the in-flight policy is the caller's.
held = idempotent_task(scope="orders", key="message_id", name="held", lease_seconds=60)(_held)
held_waiting = idempotent_task(
    scope="orders", key="message_id", name="held", lease_seconds=60, in_flight="wait"
)(_held)
held_briefly_waiting = idempotent_task(
    scope="orders", key="message_id", name="held", in_flight="wait", wait_seconds=0.1
)(_held)


@pytest.fixture(autouse=True)
def _clear_next() -> Iterator[None]:
    NEXT.clear()
    yield
    NEXT.clear()


def record() -> IdempotencyRecord:
    return records.get()


def in_thread(func: Callable[..., Any], *args: Any) -> tuple[threading.Thread, queue.Queue[Any]]:
    """Call ``func`` in a thread of its own (with its own database connection)."""
    results: queue.Queue[Any] = queue.Queue()

    def run() -> None:
        try:
            results.put(func(*args))
        except BaseException as error:  # handed to the test, which asserts on it
            results.put(error)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, results


@pytest.fixture
def sent() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """Every engine signal sent during the test, as ``(name, kwargs)``."""
    received: list[tuple[str, dict[str, Any]]] = []
    receivers = {}
    for name in ("claimed", "replayed", "in_flight", "mismatch", "released", "completion_lost"):

        def receiver(name: str = name, **kwargs: Any) -> None:
            kwargs.pop("signal")
            kwargs.pop("sender")
            received.append((name, {**kwargs, "key": signals.raw_key()}))

        receivers[name] = receiver
        getattr(signals, name).connect(receiver)
    yield received
    for name, receiver in receivers.items():
        getattr(signals, name).disconnect(receiver)


# --- the decorator: run once, store, replay ---------------------------------------------------


def test_the_first_call_runs_and_stores_its_result_as_json() -> None:
    result = charge("msg-1", 5)

    assert result == {"effect": SideEffect.objects.get().pk, "amount": 5}
    stored = record()
    assert stored.state == State.COMPLETED
    assert (stored.account, stored.endpoint, stored.key) == (
        "orders",
        "task:tests.test_tasks.charge",
        "msg-1",
    )
    assert stored.response_status == 200
    assert stored.response_headers == [["Content-Type", "application/json"]]
    assert json.loads(bytes(stored.response_body)) == result
    assert stored.lease_expires_at is None


def test_a_repeat_returns_the_stored_result_without_running() -> None:
    first = charge("msg-1", 5)

    assert charge("msg-1", 5) == first
    assert charge("msg-1", amount=5, note="") == first  # defaults count as given
    assert effects("charge") == 1


def test_other_keys_and_scopes_run_on_their_own() -> None:
    charge("msg-1", 5)
    charge("msg-2", 5)
    charge_amount_only("msg-1", 5)  # another task: another endpoint

    assert effects() == 3


def test_a_repeat_with_different_arguments_is_a_mismatch(sent: list[Any]) -> None:
    charge("msg-1", 5)

    with pytest.raises(TaskKeyMismatch, match="already used with different arguments") as info:
        charge("msg-1", 6)
    with pytest.raises(KeyMismatch):
        charge("msg-1", 5, note="other")

    assert "msg-1" in str(info.value)
    assert effects("charge") == 1
    assert ("mismatch", {"account": "orders", "endpoint": record().endpoint, "key": "msg-1"}) in (
        sent
    )


def test_fingerprint_args_name_the_arguments_that_make_the_work() -> None:
    first = charge_amount_only("msg-1", 5, note="first")

    assert charge_amount_only("msg-1", 5, note="second") == first
    with pytest.raises(TaskKeyMismatch):
        charge_amount_only("msg-1", 6, note="first")
    assert effects() == 1


def test_a_fingerprint_callable_replaces_the_arguments() -> None:
    @idempotent_task(scope="s", key="message_id", fingerprint=lambda message_id, order: order.id)
    def ship(message_id: str, order: Any) -> int:
        SideEffect.objects.create(label="ship")
        return int(order.id)

    class Order:
        def __init__(self, id: int) -> None:
            self.id = id

    assert ship("msg-1", Order(7)) == 7
    assert ship("msg-1", Order(7)) == 7
    with pytest.raises(TaskKeyMismatch):
        ship("msg-1", Order(8))
    assert effects() == 1


def test_a_key_callable_and_a_scope_callable() -> None:
    @idempotent_task(
        scope=lambda tenant, order_id: f"tenant-{tenant}",
        key=lambda tenant, order_id: f"order-{order_id}",
    )
    def invoice(tenant: int, order_id: int) -> int:
        SideEffect.objects.create(label="invoice")
        return order_id

    assert invoice(1, 7) == invoice(1, 7) == 7
    invoice(2, 7)

    assert effects() == 2
    assert sorted(records.values("account", "key")) == [
        ("tenant-1", "order-7"),
        ("tenant-2", "order-7"),
    ]


def test_arguments_are_fingerprinted_as_json_with_django_types() -> None:
    @idempotent_task(scope="s", key="message_id")
    def refund(message_id: str, amount: Decimal, at: Any, ref: uuid.UUID) -> str:
        SideEffect.objects.create(label="refund")
        return "ok"

    at = timezone.now().replace(microsecond=0)
    ref = uuid.uuid4()
    refund("msg-1", Decimal("1.50"), at, ref)
    refund("msg-1", Decimal("1.50"), at, ref)
    with pytest.raises(TaskKeyMismatch):
        refund("msg-1", Decimal("1.51"), at, ref)

    assert effects() == 1


def test_an_argument_that_cannot_be_fingerprinted_is_named() -> None:
    @idempotent_task(scope="s", key="message_id")
    def notify(message_id: str, user: Any) -> None:
        SideEffect.objects.create(label="notify")

    with pytest.raises(TypeError, match=r"argument 'user', a object.*fingerprint_args"):
        notify("msg-1", object())
    with pytest.raises(TypeError, match="cannot fingerprint"):
        notify("msg-1", float("nan"))

    assert effects() == 0
    assert not records.exists()


def test_a_fingerprint_that_is_not_json_is_a_type_error() -> None:
    @idempotent_task(scope="s", key="message_id", fingerprint=lambda message_id: object())
    def opaque(message_id: str) -> None:
        pass  # pragma: no cover - never runs

    with pytest.raises(TypeError, match="cannot fingerprint its arguments: "):
        opaque("msg-1")
    with pytest.raises(TypeError, match="cannot fingerprint its arguments: "):
        claim_once("receipts", "msg-1", fingerprint={1: "mixed", "key": "types"})


def test_the_result_is_returned_as_stored_on_the_first_call_too() -> None:
    NEXT.append({"ids": (1, 2), 3: "three"})

    first = returns_next("msg-1")

    assert first == {"ids": [1, 2], "3": "three"}
    assert returns_next("msg-1") == first


def test_a_none_result_is_stored_and_replayed() -> None:
    NEXT.append(None)

    assert returns_next("msg-1") is None
    assert returns_next("msg-1") is None
    assert effects() == 1
    assert bytes(record().response_body) == b"null"


# --- failures release the key -----------------------------------------------------------------


def test_an_exception_releases_the_key_and_the_next_delivery_runs(sent: list[Any]) -> None:
    with pytest.raises(ValueError, match="negative amount"):
        charge("msg-1", -1)

    assert not records.exists()
    assert [name for name, _ in sent] == ["claimed", "released"]
    with pytest.raises(ValueError, match="negative amount"):
        charge("msg-1", -1)
    assert effects("charge") == 2


def test_an_interrupt_releases_the_key_too() -> None:
    @idempotent_task(scope="s", key="message_id")
    def interrupted(message_id: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted("msg-1")

    assert not records.exists()


@pytest.mark.parametrize(
    "result",
    [
        pytest.param(object(), id="object"),
        pytest.param({1, 2}, id="set"),
        pytest.param(float("nan"), id="nan"),
        pytest.param("\ud800", id="lone-surrogate"),
        pytest.param({"b": b"bytes"}, id="bytes"),
    ],
)
def test_a_result_that_is_not_json_raises_type_error_and_releases_the_key(result: Any) -> None:
    NEXT.extend([result, {"ok": True}])

    with pytest.raises(TypeError, match=r"not JSON-serialisable.*'msg-1' was released"):
        returns_next("msg-1")

    assert not records.exists()
    assert returns_next("msg-1") == {"ok": True}
    assert effects() == 2


def test_a_result_over_max_response_bytes_completes_without_it(settings: Any) -> None:
    settings.IDEMPOTENCY = {"MAX_RESPONSE_BYTES": 10}
    NEXT.append("x" * 20)

    assert returns_next("msg-1") == "x" * 20
    with pytest.raises(TaskResultNotStored, match="larger than MAX_RESPONSE_BYTES"):
        returns_next("msg-1")

    assert isinstance(TaskResultNotStored(), ResponseNotStored)
    assert record().state == State.COMPLETED
    assert record().response_body is None
    assert effects() == 1


# --- a repeat while the first runs: the in-flight policy --------------------------------------


def test_a_delivery_while_the_first_runs_raises_task_in_flight(sent: list[Any]) -> None:
    thread, results = in_thread(held, "msg-1")
    assert gate.entered.wait(20)

    with pytest.raises(TaskInFlight, match="still running for key 'msg-1'") as info:
        held("msg-1")
    gate.release.set()
    thread.join(20)

    assert isinstance(info.value, InFlight)
    assert info.value.retry_after == 1
    first = results.get(timeout=5)
    assert first == {"effect": SideEffect.objects.get().pk}
    assert held("msg-1") == first
    assert ("in_flight", {"account": "orders", "endpoint": "task:held", "key": "msg-1"}) in sent


def test_retry_after_follows_the_setting(settings: Any) -> None:
    settings.IDEMPOTENCY = {"RETRY_AFTER_SECONDS": 7}
    thread, _ = in_thread(held, "msg-1")
    assert gate.entered.wait(20)

    with pytest.raises(TaskInFlight) as info:
        held("msg-1")
    gate.release.set()
    thread.join(20)

    assert info.value.retry_after == 7


def test_a_dead_workers_lease_tells_the_redelivery_how_long_is_left() -> None:
    """The first delivery's worker died with 4.2 s of its 10 s lease left: deliver again
    when the lease lapses (the Celery countdown), not once a second until then."""
    charge("msg-1", 5)
    records.update(
        state=IdempotencyRecord.State.IN_PROGRESS,
        lease_expires_at=timezone.now() + timedelta(seconds=4.2),
    )

    with pytest.raises(TaskInFlight) as info:
        charge("msg-1", 5)

    assert info.value.retry_after == 5
    assert effects("charge") == 1


def test_the_wait_policy_returns_the_result_once_the_first_finishes() -> None:
    waiting = threading.Event()

    def on_in_flight(**kwargs: Any) -> None:
        waiting.set()

    signals.in_flight.connect(on_in_flight)
    try:
        first, first_result = in_thread(held, "msg-1")
        assert gate.entered.wait(20)
        second, second_result = in_thread(held_waiting, "msg-1")
        assert waiting.wait(20)  # the second delivery saw the first in flight, and waits
        gate.release.set()
        first.join(20)
        second.join(20)
    finally:
        signals.in_flight.disconnect(on_in_flight)

    result = first_result.get(timeout=5)
    assert second_result.get(timeout=5) == result
    assert effects("held") == 1


def test_the_wait_policy_raises_task_in_flight_when_its_bound_passes() -> None:
    thread, _ = in_thread(held, "msg-1")
    assert gate.entered.wait(20)

    with pytest.raises(TaskInFlight):
        held_briefly_waiting("msg-1")
    gate.release.set()
    thread.join(20)

    assert effects("held") == 1


def test_contention_reported_by_the_engine_is_task_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def contended(*args: Any) -> Any:
        raise InFlight("changing under heavy contention")

    monkeypatch.setattr(shell, "claim_or_replay", contended)

    with pytest.raises(TaskInFlight) as info:
        charge("msg-1", 5)
    assert info.value.retry_after == 1
    assert effects() == 0


# --- TTL, lease, heartbeat --------------------------------------------------------------------


def test_a_key_past_its_ttl_runs_again() -> None:
    charge("msg-1", 5)
    records.update(expires_at=timezone.now() - timedelta(seconds=1))

    charge("msg-1", 5)
    records.update(expires_at=timezone.now() - timedelta(seconds=1))
    charge("msg-1", 6)  # an expired key is absent, whatever its arguments were

    assert effects("charge") == 3
    assert record().state == State.COMPLETED


def test_ttl_and_lease_come_from_the_settings_or_the_arguments(settings: Any) -> None:
    settings.IDEMPOTENCY = {"TTL_SECONDS": 600, "LEASE_SECONDS": 30}
    leases = []

    @idempotent_task(scope="s", key="message_id")
    def by_settings(message_id: str) -> None:
        leases.append(records.lasts(record().lease_expires_at, record().created_at, 30))

    @idempotent_task(scope="s", key="message_id", ttl_seconds=60, lease_seconds=5)
    def by_arguments(message_id: str) -> None:
        leases.append(records.get(key=message_id).lease_expires_at)

    by_settings("msg-1")
    assert leases == [True]
    # The TTL counts from completion.
    assert records.lasts(record().expires_at, record().completed_at, 600)
    records.delete()

    by_arguments("msg-2")
    assert records.lasts(leases[1], record().created_at, 5)
    assert records.lasts(record().expires_at, record().completed_at, 60)


@pytest.mark.concurrency
def test_the_heartbeat_keeps_a_task_that_runs_past_its_lease_the_owner_of_its_key() -> None:
    @idempotent_task(scope="s", key="message_id", name="slow", lease_seconds=1)
    def slow(message_id: str) -> dict[str, Any]:
        gate.pass_through()
        return {"effect": SideEffect.objects.create(label="slow").pk}

    thread, results = in_thread(slow, "msg-1")
    assert gate.entered.wait(20)
    claimed = record()
    original = claimed.lease_expires_at
    # Real time runs past the lease it claimed with; the heartbeat, beating every third of
    # it, pushes the lease on meanwhile. (Waiting for time to pass is the point here.)
    assert wait_until(lambda: timezone.now() > original, timeout=5)
    assert wait_until(lambda: record().lease_expires_at > original, timeout=5), (
        "the lease was not renewed"
    )

    # Delivered again after the first lease would have lapsed: still the first one's.
    with pytest.raises(TaskInFlight):
        slow("msg-1")
    assert thread.is_alive()
    assert record().token == claimed.token
    assert record().lease_expires_at > original
    assert claimed.token in heartbeat._entries
    gate.release.set()
    thread.join(20)

    first = results.get(timeout=5)
    assert first == {"effect": SideEffect.objects.get(label="slow").pk}
    assert effects() == 1
    assert record().state == State.COMPLETED
    assert claimed.token not in heartbeat._entries  # done: nothing left to renew
    assert slow("msg-1") == first
    assert effects() == 1


@pytest.mark.concurrency
def test_past_max_run_seconds_the_lease_is_no_longer_renewed_and_a_redelivery_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs: list[int] = []

    @idempotent_task(scope="s", key="message_id", name="wedged", lease_seconds=1, max_run_seconds=2)
    def wedged(message_id: str) -> int:
        run = len(runs) + 1
        runs.append(run)
        if run == 1:
            gate.pass_through()  # the first delivery is wedged until the test lets it go
        SideEffect.objects.create(label="wedged")
        return run

    thread, results = in_thread(wedged, "msg-1")
    assert gate.entered.wait(20)
    claimed = record()
    original = claimed.lease_expires_at
    # Renewed while it runs for less than max_run_seconds…
    assert wait_until(lambda: record().lease_expires_at > original, timeout=5), (
        "the lease was not renewed"
    )
    # …then no longer renewed while it still runs, and its lease lapses. (The heartbeat keeps
    # the claim, unrenewed, until the run ends: its completion counts from its last renewal.)
    assert wait_until(lambda: not heartbeat._entries[claimed.token].renewing, timeout=10)
    assert thread.is_alive()
    # The heartbeat stops renewing the claim under its lock and logs once it has let go.
    assert wait_until(lambda: "ran past MAX_RUN_SECONDS" in caplog.text, timeout=5)
    assert wait_until(lambda: record().lease_expires_at <= timezone.now(), timeout=10)

    assert wedged("msg-1") == 2  # a redelivery takes the key over and runs
    gate.release.set()
    thread.join(20)

    assert results.get(timeout=5) == 1  # the wedged run returns, but cannot store its result
    assert effects("wedged") == 2
    assert record().state == State.COMPLETED
    assert record().token != claimed.token
    assert heartbeat._entries == {}


def test_a_task_s_claim_is_registered_for_renewal_only_while_it_runs(settings: Any) -> None:
    settings.IDEMPOTENCY = {"MAX_RUN_SECONDS": 900}
    renewing: list[tuple[str, float, int]] = []

    @idempotent_task(scope="s", key="message_id", lease_seconds=3)
    def task(message_id: str, fail: bool) -> None:
        now = time.monotonic()
        # Every claim being renewed: its key, its lease, for how much longer (MAX_RUN_SECONDS).
        renewing.extend(
            (entry.claim.scope.key, entry.lease, round(entry.stop_renewing_at - now))
            for entry in heartbeat._entries.values()
        )
        if fail:
            raise ValueError("failed")

    task("msg-1", False)
    assert heartbeat._entries == {}
    with pytest.raises(ValueError, match="failed"):
        task("msg-2", True)
    assert heartbeat._entries == {}
    task("msg-1", False)  # a replay claims nothing, runs nothing

    assert renewing == [("msg-1", 3.0, 900), ("msg-2", 3.0, 900)]


def test_a_function_that_lost_its_claim_returns_but_does_not_overwrite(
    sent: list[Any],
) -> None:
    @idempotent_task(scope="s", key="message_id", name="lost")
    def loses_its_claim(message_id: str) -> str:
        # Its lease lapsed meanwhile and another worker took the key over.
        records.update(token="f" * 32)
        return "done"

    assert loses_its_claim("msg-1") == "done"

    assert record().state == State.IN_PROGRESS
    assert record().token == "f" * 32
    assert "completion_lost" in [name for name, _ in sent]


# --- the store failing ------------------------------------------------------------------------


@pytest.mark.database_store("injects SQL failures; the Redis store's: test_redis_store")
def test_a_store_failure_when_claiming_propagates_and_nothing_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unreachable(*args: Any) -> Any:
        raise OperationalError("the database went away")

    monkeypatch.setattr(shell, "claim_or_replay", unreachable)

    with pytest.raises(TaskStoreUnavailable) as raised:
        charge("msg-1", 5)
    assert raised.value.retry_after == 1
    assert effects() == 0


@pytest.mark.database_store("injects SQL failures; the Redis store's: test_redis_store")
def test_a_store_failure_when_completing_is_logged_and_the_result_returned(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError("the database went away")

    monkeypatch.setattr(shell, "complete", unreachable)

    assert charge("msg-1", 5)["amount"] == 5
    assert "stays in progress until its lease lapses" in caplog.text
    assert record().state == State.IN_PROGRESS


@pytest.mark.database_store("injects SQL failures; the Redis store's: test_redis_store")
def test_a_store_failure_when_releasing_is_logged_and_the_error_propagates(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError("the database went away")

    monkeypatch.setattr(shell, "release", unreachable)

    with pytest.raises(ValueError, match="negative amount"):
        charge("msg-1", -1)
    assert "frees itself when its lease lapses" in caplog.text


# --- transactions -----------------------------------------------------------------------------


@pytest.mark.database_store("a claim inside the caller's transaction (the Redis store has none)")
def test_inside_an_open_transaction_it_runs_atomically_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    renewing: list[dict[str, Any]] = []

    @idempotent_task(scope="orders", key="message_id", name="observed")
    def observed(message_id: str) -> None:
        renewing.append(dict(heartbeat._entries))

    with transaction.atomic():
        first = charge("msg-1", 5)
        assert charge("msg-1", 5) == first
        with pytest.raises(TaskKeyMismatch):
            charge("msg-1", 6)
        with pytest.raises(ValueError, match="negative amount"):
            charge("msg-2", -1)  # rolls back its claim and its side effect
        observed("msg-3")
        assert effects("charge") == 1

    assert "for Task 'tests.test_tasks.charge' inside an open transaction" in caplog.text
    assert renewing == [{}]  # nothing to renew: nobody else can see the claim
    assert effects("charge") == 1
    assert sorted(records.values("key", "state")) == [
        ("msg-1", State.COMPLETED),
        ("msg-3", State.COMPLETED),
    ]


@pytest.mark.database_store("a claim inside the caller's transaction (the Redis store has none)")
def test_an_outer_rollback_takes_the_claim_with_it() -> None:
    with transaction.atomic():
        charge("msg-1", 5)
        transaction.set_rollback(True)

    assert not records.exists()
    charge("msg-1", 5)
    assert effects("charge") == 1


@pytest.mark.database_store("atomic mode")
def test_atomic_mode_rolls_back_the_work_with_the_claim(caplog: pytest.LogCaptureFixture) -> None:
    first = charge_atomic("msg-1", 5)

    assert charge_atomic("msg-1", 5) == first
    with pytest.raises(ValueError, match="negative amount"):
        charge_atomic("msg-2", -1)
    with pytest.raises(TaskKeyMismatch):
        charge_atomic("msg-1", 6)

    assert effects("charge_atomic") == 1
    assert list([r.key for r in records.all()]) == ["msg-1"]
    assert "open transaction" not in caplog.text


@pytest.mark.database_store("atomic mode")
def test_atomic_mode_rolls_back_a_result_that_is_not_json() -> None:
    NEXT.extend([object(), "ok"])

    with pytest.raises(TypeError, match="not JSON-serialisable"):
        returns_next_atomic("msg-1")

    assert effects() == 0
    assert not records.exists()
    assert returns_next_atomic("msg-1") == "ok"


@pytest.mark.database_store("atomic mode")
def test_atomic_mode_rolls_back_when_the_result_cannot_be_stored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError("the database went away")

    monkeypatch.setattr(shell, "complete", unreachable)

    with pytest.raises(TaskStoreUnavailable):
        charge_atomic("msg-1", 5)
    monkeypatch.undo()
    assert effects() == 0
    assert not records.exists()


@pytest.mark.database_store("atomic mode")
def test_atomic_mode_from_the_mode_setting(settings: Any) -> None:
    settings.IDEMPOTENCY = {"MODE": "atomic"}

    with pytest.raises(ValueError, match="negative amount"):
        charge("msg-1", -1)

    assert effects() == 0  # rolled back with the claim


# --- keys, scope, name, configuration ---------------------------------------------------------


@pytest.mark.parametrize("key", ["", "   ", "k" * 256, "café", "a\nb", "tab\there"])
def test_a_malformed_key_is_rejected_before_anything_runs(key: str) -> None:
    with pytest.raises(TaskKeyMalformed) as info:
        charge(key, 5)

    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, KeyMalformed)
    assert effects() == 0


@pytest.mark.parametrize("key", [None, b"bytes", 1.5, True, ["k"]])
def test_a_key_of_another_type_is_a_type_error(key: Any) -> None:
    with pytest.raises(TypeError, match="must be a str, int or UUID"):
        charge(key, 5)


def test_keys_may_be_ints_uuids_and_255_printable_characters() -> None:
    ref = uuid.uuid4()

    assert task_key(42) == "42"
    assert task_key(ref) == str(ref)
    assert task_key("k" * 255) == "k" * 255
    assert task_key('with "spaces" & ~') == 'with "spaces" & ~'
    charge(42, 5)
    assert record().key == "42"


def test_the_scope_must_be_a_non_empty_string_and_long_scopes_fit() -> None:
    @idempotent_task(scope=lambda message_id: "s" * 300, key="message_id")
    def long_scope(message_id: str) -> None:
        pass

    @idempotent_task(scope="", key="message_id")
    def empty_scope(message_id: str) -> None:
        pass

    long_scope("msg-1")
    assert record().account.startswith("sha256:")
    assert len(record().account) <= 128
    with pytest.raises(ValueError, match="scope must be a non-empty str"):
        empty_scope("msg-1")


def test_the_name_defaults_to_module_and_qualname_or_is_given() -> None:
    def define() -> Callable[[str], None]:
        @idempotent_task(scope="s", key="message_id")
        def nested(message_id: str) -> None:
            pass

        return nested

    @idempotent_task(scope="s", key="message_id", name="n" * 300)
    def long_name(message_id: str) -> None:
        pass

    define()("msg-1")
    long_name("msg-2")

    endpoints = dict(records.values("key", "endpoint"))
    assert endpoints["msg-1"] == (
        "task:tests.test_tasks.test_the_name_defaults_to_module_and_qualname_or_is_given."
        "<locals>.define.<locals>.nested"
    )
    assert endpoints["msg-2"].startswith("sha256:")
    assert len(endpoints["msg-2"]) <= 255


def test_the_wrapper_keeps_the_function_name() -> None:
    assert charge.__name__ == "charge"
    assert charge.__wrapped__.__name__ == "charge"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"key": "missing"}, "has no argument 'missing'"),
        ({"key": "message_id", "fingerprint_args": ["nope"]}, "has no argument 'nope'"),
        ({"key": "message_id", "in_flight": "queue"}, "in_flight='queue'"),
        ({"key": "message_id", "mode": "eventual"}, "mode='eventual'"),
        (
            {"key": "message_id", "fingerprint_args": ["a"], "fingerprint": str},
            "fingerprint_args or fingerprint, not both",
        ),
    ],
)
def test_misconfiguration_is_reported_at_decoration(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=message):

        @idempotent_task(scope="s", **kwargs)
        def task(message_id: str, a: int) -> None:
            pass


def test_async_functions_are_refused() -> None:
    with pytest.raises(ImproperlyConfigured, match="async functions are not supported"):

        @idempotent_task(scope="s", key="message_id")
        async def task(message_id: str) -> None:
            pass


def test_wrong_arguments_are_the_function_s_own_type_error() -> None:
    with pytest.raises(TypeError, match="missing a required argument: 'amount'"):
        charge("msg-1")  # type: ignore[call-arg]


def test_disabled_runs_the_function_unprotected(settings: Any) -> None:
    settings.IDEMPOTENCY = {"ENABLED": False}
    NEXT.extend([(1, 2), (1, 2)])

    assert returns_next("msg-1") == (1, 2)  # as if not decorated
    returns_next("msg-1")

    assert effects() == 2
    assert not records.exists()


def test_signals_name_the_scope_the_task_and_the_key(sent: list[Any]) -> None:
    charge("msg-1", 5)
    charge("msg-1", 5)

    scope = {"account": "orders", "endpoint": "task:tests.test_tasks.charge", "key": "msg-1"}
    assert sent == [("claimed", scope), ("replayed", {**scope, "status": 200, "waited": False})]


# --- claim_once, the context manager ----------------------------------------------------------


def send_receipt(message_id: str, order: int, name: str = "") -> Any:
    with claim_once("receipts", message_id, name=name, fingerprint={"order": order}) as run:
        if run.done:
            return run.result
        SideEffect.objects.create(label="receipt")
        run.result = {"order": order, "sent": True}
    return run.result


def test_a_tasks_own_wait_seconds_bounds_its_wait_not_the_setting(settings: Any) -> None:
    """``wait_seconds=30`` of its own under ``WAIT_SECONDS = 0``: a repeat that finds the
    key in flight waits for it (here it completes as soon as the repeat says it waits),
    and gets the stored result; bounded by the setting, it would be ``TaskInFlight``."""
    from tests.test_decorators import completed_once_a_duplicate_waits

    settings.IDEMPOTENCY = {"WAIT_SECONDS": 0}
    with claim_once("receipts", "w-1", in_flight="wait", wait_seconds=30) as first:
        first.result = {"sent": 1}

    waiting = claim_once("receipts", "w-1", in_flight="wait", wait_seconds=30)
    with completed_once_a_duplicate_waits(), waiting as again:
        assert again.done

    assert again.result == {"sent": 1}


def test_claim_once_runs_a_block_once_and_gives_repeats_its_result() -> None:
    first = send_receipt("msg-1", 7)

    assert first == {"order": 7, "sent": True}
    assert send_receipt("msg-1", 7) == first
    assert effects("receipt") == 1
    assert (record().account, record().endpoint) == ("receipts", "task")
    with pytest.raises(TaskKeyMismatch, match=r"claim_once\('receipts'\).*'msg-1'"):
        send_receipt("msg-1", 8)


def test_claim_once_names_separate_blocks_in_one_scope() -> None:
    send_receipt("msg-1", 7)
    send_receipt("msg-1", 7, name="sms")

    assert effects("receipt") == 2
    assert sorted([r.endpoint for r in records.all()]) == [
        "task",
        "task:sms",
    ]


def test_claim_once_releases_on_an_exception() -> None:
    with pytest.raises(RuntimeError, match="smtp down"), claim_once("receipts", "msg-1"):
        raise RuntimeError("smtp down")

    assert not records.exists()
    with claim_once("receipts", "msg-1") as run:
        assert not run.done


def test_claim_once_without_a_result_stores_none() -> None:
    with claim_once("receipts", "msg-1") as run:
        SideEffect.objects.create(label="receipt")

    assert run.result is None
    with claim_once("receipts", "msg-1") as repeat:
        assert repeat.done
        assert repeat.result is None
    assert repr(repeat) == "TaskRun(done=True, result=None)"


def test_claim_once_refuses_to_overwrite_a_done_result() -> None:
    send_receipt("msg-1", 7)

    with (
        pytest.raises(RuntimeError, match=r"already ran: check run\.done"),
        claim_once("receipts", "msg-1", fingerprint={"order": 7}) as run,
    ):
        run.result = "again"

    assert json.loads(bytes(record().response_body)) == {"order": 7, "sent": True}


def test_claim_once_rejects_a_result_that_is_not_json() -> None:
    with (
        pytest.raises(TypeError, match=r"claim_once\('receipts'\) returned a result that is not"),
        claim_once("receipts", "msg-1") as run,
    ):
        run.result = {"at": object()}

    assert not records.exists()


def test_claim_once_fingerprints_bytes_as_they_are() -> None:
    with claim_once("receipts", "msg-1", fingerprint=b"\x00raw body") as run:
        run.result = 1

    with claim_once("receipts", "msg-1", fingerprint=b"\x00raw body") as repeat:
        assert repeat.done
    with pytest.raises(TaskKeyMismatch), claim_once("receipts", "msg-1", fingerprint=b"other"):
        pass


def test_claim_once_is_entered_once() -> None:
    once = claim_once("receipts", "msg-1")
    with once:
        pass

    with pytest.raises(RuntimeError, match="can be entered only once"), once:
        pass


def test_claim_once_disabled_runs_the_block(settings: Any) -> None:
    settings.IDEMPOTENCY = {"ENABLED": False}

    with claim_once("receipts", "msg-1") as run:
        assert not run.done
        run.result = {1, 2}  # not stored, so not checked

    assert run.result == {1, 2}
    assert not records.exists()


def test_claim_once_in_flight_and_options() -> None:
    with claim_once("receipts", "msg-1", lease_seconds=5, ttl_seconds=60, mode="commit"):
        created = record().created_at
        assert records.lasts(record().lease_expires_at, created, 5)
        assert records.lasts(record().expires_at, created, 60)
        with pytest.raises(TaskInFlight), claim_once("receipts", "msg-1"):
            pass  # pragma: no cover - not entered

    with pytest.raises(ImproperlyConfigured):
        claim_once("receipts", "msg-1", in_flight="later")
    assert TaskRun(done=False).result is None


# --- redelivery to several OS processes -------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
RETRY_AFTER = "1"


class Worker:
    """A consumer process (``tests/project/task_worker.py``) that receives one message id."""

    def __init__(self, message_id: str, lease_seconds: float, log: Path) -> None:
        env = {**os.environ, "TASK_WORKER_DATABASE": str(connection.settings_dict["NAME"])}
        self.log = log
        self._log_file = log.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.project.task_worker", message_id, str(lease_seconds)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
            bufsize=1,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line.strip())
        self._lines.put("<exited>")

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{line}\n")
        self.process.stdin.flush()

    def next_line(self, timeout: float = 30) -> str:
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            return "<timed out>"

    def kill(self) -> None:
        self.process.kill()  # SIGKILL: no cleanup, no release, the claim stays in progress
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.close()
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self._log_file.close()


Spawn = Callable[..., list[Worker]]


@pytest.fixture
def spawn(transactional_db: None, tmp_path: Path) -> Iterator[Spawn]:
    """Start consumer processes and wait until each is connected; stopped after the test."""
    started: list[Worker] = []

    def start(count: int, message_id: str, lease_seconds: float = 10) -> list[Worker]:
        workers = [
            Worker(message_id, lease_seconds, tmp_path / f"worker-{len(started) + n}.log")
            for n in range(count)
        ]
        started.extend(workers)
        assert [worker.next_line() for worker in workers] == ["ready"] * count, logs(workers)
        return workers

    def logs(workers: list[Worker]) -> str:
        return "\n".join(f"--- {w.log.name} ---\n{w.log.read_text()}" for w in workers)

    yield start
    for worker in started:
        worker.stop()
    print(logs(started))  # shown by pytest when the test failed


def deliver(workers: list[Worker]) -> dict[Worker, str]:
    """Deliver the message to every worker at once; each one's first line of answer."""
    for worker in workers:
        worker.send("deliver")
    return {worker: worker.next_line() for worker in workers}


def the_one_that_entered(answers: dict[Worker, str]) -> Worker:
    """Exactly one worker runs the handler; every other one is told it is in flight."""
    entered = [worker for worker, line in answers.items() if line == "entered"]
    others = sorted(line for line in answers.values() if line != "entered")
    assert len(entered) == 1, answers
    assert others == [f"in_flight {RETRY_AFTER}"] * (len(answers) - 1), answers
    return entered[0]


@pytest.mark.concurrency
def test_a_message_delivered_to_four_processes_at_once_runs_once(spawn: Spawn) -> None:
    message_id = f"msg-{uuid.uuid4()}"
    workers = spawn(4, message_id)

    runner = the_one_that_entered(deliver(workers))
    assert effects(message_id) == 1
    runner.send("finish")
    outcome, result = runner.next_line().split(" ", 1)

    assert outcome == "ran"
    assert json.loads(result)["effect"] == SideEffect.objects.get(label=message_id).pk
    # Delivered again (the broker lost the ack): every process gets the stored result.
    assert set(deliver(workers).values()) == {f"replayed {result}"}
    assert effects(message_id) == 1
    assert record().state == State.COMPLETED


@pytest.mark.concurrency
def test_a_crash_past_the_lease_runs_the_work_once_more_at_most(spawn: Spawn) -> None:
    message_id = f"msg-{uuid.uuid4()}"
    lease = 2.0
    workers = spawn(4, message_id, lease_seconds=lease)

    crasher = the_one_that_entered(deliver(workers))
    others = [worker for worker in workers if worker is not crasher]
    first_lease = record().lease_expires_at
    # While the first worker lives, its heartbeat keeps the claim: past its first lease,
    # redeliveries are still told it is in flight.
    assert wait_until(lambda: timezone.now() > first_lease)
    assert set(deliver(others).values()) == {f"in_flight {RETRY_AFTER}"}
    assert record().lease_expires_at > first_lease

    crasher.kill()  # mid-work: its side effect happened, its result was never stored
    assert record().state == State.IN_PROGRESS
    # Lapsed, with room for the workers' reading of the store's clock (within a round trip,
    # which a loaded machine stretches): a lease a few ms from its end may still read live.
    margin = timedelta(seconds=0.5)
    assert wait_until(lambda: record().lease_expires_at + margin <= timezone.now())

    # Past the lease, the message delivered to the three survivors at once runs once more.
    runner = the_one_that_entered(deliver(others))
    runner.send("finish")
    outcome, result = runner.next_line().split(" ", 1)

    assert outcome == "ran"
    assert set(deliver(others).values()) == {f"replayed {result}"}
    assert effects(message_id) == 2  # the crashed attempt's and the redelivery's
    assert record().state == State.COMPLETED
    assert json.loads(bytes(record().response_body)) == json.loads(result)
