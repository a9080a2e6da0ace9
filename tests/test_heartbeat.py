"""Lease renewal, driven one beat at a time: what a beat renews, and what it leaves alone."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.utils import timezone

from idempotency_django import engine
from idempotency_django.heartbeat import Heartbeat
from idempotency_django.models import IdempotencyRecord

pytestmark = pytest.mark.django_db(transaction=True)

OPTIONS = engine.Options(
    "default", lease=5, ttl=60, in_flight="conflict", wait_seconds=0, retry_after=1
)


def claim(key: str) -> engine.Claim:
    began = engine.begin(engine.Scope("1", "POST /x/", key), "f" * 64, OPTIONS)
    assert isinstance(began, engine.Claim)
    return began


def lease_of(key: str) -> object:
    return IdempotencyRecord.objects.get(key=key).lease_expires_at


@pytest.fixture
def beat() -> Iterator[Heartbeat]:
    heartbeat = Heartbeat()
    yield heartbeat
    heartbeat.stop()


def test_a_beat_renews_every_registered_claim_in_one_statement(
    beat: Heartbeat, django_assert_num_queries: object
) -> None:
    claims = [claim("a"), claim("b"), claim("c")]
    IdempotencyRecord.objects.update(lease_expires_at=timezone.now() + timedelta(seconds=1))
    for each in claims:
        beat.register(each, lease=30, max_run=60)
    # The thread sleeps for a third of the lease (10 s) before its first beat; drive one now.
    with django_assert_num_queries(1):  # type: ignore[operator]
        assert beat.renew_once() == 3

    for key in "abc":
        assert lease_of(key) > timezone.now() + timedelta(seconds=25)  # type: ignore[operator]


def test_unregistered_claims_are_not_renewed(beat: Heartbeat) -> None:
    done = claim("done")
    beat.register(done, lease=30, max_run=60)
    beat.unregister(done)
    before = lease_of("done")

    assert beat.renew_once() == 0
    assert lease_of("done") == before


def test_a_claim_past_max_run_is_no_longer_renewed(beat: Heartbeat) -> None:
    wedged = claim("wedged")
    beat.register(wedged, lease=30, max_run=0)
    before = lease_of("wedged")

    assert beat.renew_once() == 0
    assert lease_of("wedged") == before
    assert beat.renew_once() == 0  # and it was dropped, not retried


def test_a_beat_never_renews_a_claim_that_was_taken_over(beat: Heartbeat) -> None:
    lost = claim("k")
    beat.register(lost, lease=30, max_run=60)
    IdempotencyRecord.objects.update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    winner = claim("k")
    assert winner.token != lost.token
    winner_lease = lease_of("k")

    assert beat.renew_once() == 0
    assert lease_of("k") == winner_lease


def test_a_beat_never_renews_a_completed_record(beat: Heartbeat) -> None:
    from idempotency_django.responses import StoredResponse

    finished = claim("k")
    beat.register(finished, lease=30, max_run=60)
    assert engine.complete(finished, StoredResponse(201, b"{}"))

    assert beat.renew_once() == 0
    assert IdempotencyRecord.objects.get().lease_expires_at is None


def test_the_heartbeat_thread_renews_leases_by_itself(beat: Heartbeat) -> None:
    """The real thread, with a lease of 1 s: within a few beats the lease has moved."""
    live = claim("live")
    IdempotencyRecord.objects.update(lease_expires_at=timezone.now())
    beat.register(live, lease=1, max_run=60)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and lease_of("live") <= timezone.now():  # type: ignore[operator]
        time.sleep(0.05)
    assert lease_of("live") > timezone.now()  # type: ignore[operator]


def test_stop_ends_the_thread(beat: Heartbeat) -> None:
    beat.register(claim("k"), lease=30, max_run=60)
    thread = beat._thread
    assert thread is not None
    assert thread.is_alive()

    beat.stop()

    assert not thread.is_alive()
    assert beat.renew_once() == 0
