"""An app server whose clock disagrees with the store's decides as a punctual one would.

This process's clock (``django.utils.timezone.now``, the ``skew`` fixture) is moved two
minutes, more than a lease, ahead of or behind the store's. Leases and expiry are written
and compared on the store's own clock (the database's on PostgreSQL and MariaDB, Redis's on
the Redis store), so a server that runs ahead never takes over a live lease, and one that
runs behind never writes a lease or an expiry that others read as past. SQLite keeps this
process's clock (one file, one machine): these tests are skipped there. The same with two
gunicorn servers whose clocks libfaketime moves: ``tests/e2e/test_clock_skew.py``.
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from idempotency_django.core import claims, shell
from idempotency_django.core.heartbeat import heartbeat
from idempotency_django.exceptions import InFlight
from idempotency_django.models import IdempotencyRecord
from idempotency_django.purge import purge_records
from idempotency_django.responses import StoredResponse
from idempotency_django.store.base import Snapshot, Write
from tests import records
from tests.conftest import Post, Skew, effects, post_from_thread
from tests.project.views import gate
from tests.records import ON_STORE_CLOCK

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not ON_STORE_CLOCK, reason="SQLite keeps this process's clock: one machine, one clock"
    ),
]

AHEAD = 120  # seconds: more than a lease (10 s), as in a server whose NTP gave up
HEADERS = {"Idempotency-Key": "k1", "X-User": "alice"}
# ``/fields/`` fingerprints the amount only: the first request waits at the gate, and a
# duplicate that wrongly ran would not wait there.
HELD = {"amount": 1, "gate": True}
DUPLICATE = {"amount": 1}


class Held:
    """The first request, sent from a thread: it claims the key and waits at the gate."""

    def __init__(self) -> None:
        self.responses: list[Any] = []
        self.thread = threading.Thread(target=self._send, daemon=True)
        self.thread.start()
        assert gate.entered.wait(20), "the first request never reached its view"

    def _send(self) -> None:
        self.responses.append(post_from_thread("/fields/", HELD, HEADERS))

    def finish(self) -> Any:
        gate.release.set()
        self.thread.join(20)
        assert not self.thread.is_alive()
        (response,) = self.responses
        return response


def assert_in_flight_then_replayed(post: Post, held: Held) -> None:
    """The duplicate is told 409 and runs nothing; once the first request ends, it is
    replayed: the view ran once."""
    duplicate = post("/fields/", DUPLICATE)
    assert duplicate.status_code == 409, duplicate.content
    assert duplicate["Retry-After"] == "1"  # a lease renewed on schedule: it may end any time
    assert effects("fields") == 0
    first = held.finish()
    assert first.status_code == 201, first.content
    replay = post("/fields/", DUPLICATE)
    assert replay.status_code == 201
    assert replay["Idempotent-Replayed"] == "true"
    assert replay.content == first.content
    assert effects("fields") == 1


def test_a_server_whose_clock_runs_ahead_never_takes_over_a_live_lease(
    alice: User, post: Post, skew: Skew
) -> None:
    held = Held()  # claimed by a punctual server

    skew.seconds = AHEAD  # by this server's clock, the lease lapsed 110 s ago

    assert_in_flight_then_replayed(post, held)


def test_a_claim_by_a_server_whose_clock_runs_behind_is_live_for_the_others(
    alice: User, post: Post, skew: Skew
) -> None:
    skew.seconds = -AHEAD
    held = Held()  # its lease ends 10 s after the claim, by the store's clock

    skew.seconds = 0

    assert_in_flight_then_replayed(post, held)


def test_a_renewal_by_a_server_whose_clock_runs_behind_keeps_the_lease_live(
    alice: User, post: Post, skew: Skew
) -> None:
    held = Held()
    skew.seconds = -AHEAD

    assert heartbeat.renew_once() == 1  # 10 s from the store's now, not from this clock's

    skew.seconds = 0
    assert_in_flight_then_replayed(post, held)


def test_a_server_whose_clock_runs_behind_takes_over_a_lapsed_lease_at_once(
    alice: User, post: Post, skew: Skew
) -> None:
    """The lease lapsed a second ago by the store's clock (its worker died): the retry
    runs now, not two minutes later, when this server's clock gets there."""
    post("/effect/", {"amount": 1})
    records.update(
        state=IdempotencyRecord.State.IN_PROGRESS,
        lease_expires_at=timezone.now() - timedelta(seconds=1),
    )
    skew.seconds = -AHEAD

    retry = post("/effect/", {"amount": 1})

    assert retry.status_code == 201, retry.content
    assert "Idempotent-Replayed" not in retry
    assert effects("effect") == 2


FINGERPRINT = "2:" + "a" * 64
SCOPE = claims.Scope("7", "POST /charges/", "k1")


def policy(ttl: float = 3600) -> claims.ClaimPolicy:
    return claims.ClaimPolicy("default", 10, ttl, "conflict", 0, 1)


def test_a_take_over_by_a_server_whose_clock_runs_behind_is_live_for_the_others(
    skew: Skew,
) -> None:
    first = shell.claim_or_replay(SCOPE, FINGERPRINT, policy())
    assert isinstance(first, claims.Claim)
    records.update(lease_expires_at=timezone.now() - timedelta(seconds=1))  # its worker died
    skew.seconds = -AHEAD

    taken = shell.claim_or_replay(SCOPE, FINGERPRINT, policy())

    assert isinstance(taken, claims.Claim)
    assert records.get().token == taken.token != first.token
    skew.seconds = 0
    with pytest.raises(InFlight):  # its lease: 10 s from the store's now
        shell.claim_or_replay(SCOPE, FINGERPRINT, policy())


def test_the_store_refuses_a_take_over_of_a_live_lease_from_a_server_ahead(skew: Skew) -> None:
    """Whatever the engine concluded (a read taken before a renewal, a clock two minutes
    ahead), the store re-checks the lease on its own clock when it takes the record over."""
    first = shell.claim_or_replay(SCOPE, FINGERPRINT, policy())
    assert isinstance(first, claims.Claim)
    read = policy().store.claim_or_read(_claim_values(SCOPE))
    assert isinstance(read, Snapshot)
    skew.seconds = AHEAD

    taken = shell._take_over(read, SCOPE, FINGERPRINT, "b" * 32, timezone.now(), policy())

    assert not taken
    assert records.get().token == first.token


def test_a_completion_by_a_server_whose_clock_runs_behind_keeps_its_ttl(skew: Skew) -> None:
    """A minute's TTL counts from the store's now: the key replays for a minute, though
    this server's clock is two minutes behind."""
    stored = StoredResponse(201, b'{"id": 1}', [("Content-Type", "application/json")])
    skew.seconds = -AHEAD
    claim = shell.claim_or_replay(SCOPE, FINGERPRINT, policy(ttl=60))
    assert isinstance(claim, claims.Claim)

    assert shell.complete(claim, stored)

    skew.seconds = 0
    assert shell.claim_or_replay(SCOPE, FINGERPRINT, policy(ttl=60)) == stored
    left = records.get().expires_at - datetime.now(dt_timezone.utc)  # the store's clock
    assert timedelta(seconds=50) < left <= timedelta(seconds=60)


@pytest.mark.database_store("the purge (Redis expires its keys itself)")
def test_the_purge_on_a_server_whose_clock_runs_ahead_keeps_a_live_claim_past_its_ttl(
    skew: Skew,
) -> None:
    now = timezone.now()
    running = IdempotencyRecord.objects.create(
        account="7",
        endpoint="POST /charges/",
        key="running",
        fingerprint="2:" + "a" * 64,
        token="a" * 32,
        created_at=now - timedelta(seconds=5),
        lease_expires_at=now + timedelta(seconds=10),  # its heartbeat renews it
        expires_at=now - timedelta(seconds=1),  # a TTL shorter than the run
    )
    IdempotencyRecord.objects.create(
        account="7",
        endpoint="POST /charges/",
        key="done",
        fingerprint="2:" + "a" * 64,
        token="b" * 32,
        state=IdempotencyRecord.State.COMPLETED,
        created_at=now - timedelta(seconds=5),
        completed_at=now - timedelta(seconds=4),
        expires_at=now - timedelta(seconds=1),
    )
    skew.seconds = AHEAD

    result = purge_records()

    assert (result.expired, result.stale) == (1, 0)
    assert list(IdempotencyRecord.objects.values_list("pk", flat=True)) == [running.pk]


def test_a_record_read_by_a_skewed_server_is_moved_onto_its_clock(skew: Skew) -> None:
    """What the engine compares with its own clock: the lease and expiry as far from it as
    they are from the store's now."""
    options = policy()
    values: dict[str, Any] = {}
    for seconds in (AHEAD, -AHEAD):
        skew.seconds = seconds
        scope = claims.Scope("7", "POST /charges/", f"k{seconds}")
        shell.claim_or_replay(scope, FINGERPRINT, options)
        read = options.store.claim_or_read(_claim_values(scope))
        assert isinstance(read, Snapshot)
        assert read.lease_expires_at is not None
        values[seconds] = (
            read.lease_expires_at - timezone.now(),
            read.expires_at - timezone.now(),
        )
    for lease, expires in values.values():
        assert timedelta(seconds=9) < lease <= timedelta(seconds=10)
        assert timedelta(seconds=3599) < expires <= timedelta(seconds=3600)


def _claim_values(scope: claims.Scope) -> Write:
    # another request's token: it reads the record
    return Write(
        scope, "b" * 32, FINGERPRINT, timezone.now(), timedelta(seconds=10), timedelta(hours=1)
    )
