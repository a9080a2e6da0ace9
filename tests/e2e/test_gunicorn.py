"""The example payments API under gunicorn (sync workers), over HTTP, on a real database.

Every test uses a fresh Idempotency-Key and counts charges the way a client would, with
``GET /charges/`` (the servers share one database, so counts are compared before/after).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

import pytest
import requests

from tools.server import (
    BOB,
    COMPLETED,
    REPLAYED,
    WORKERS,
    Database,
    Server,
    assert_in_flight,
    assert_problem,
    charge_body,
    new_key,
    post_with_header_lines,
    race_duplicates,
    record_lease,
    record_states,
    retry_until,
)
from tools.threads import concurrently

CLIENTS = 16


def assert_replay_of(response: requests.Response, status: int, charge_id: str) -> None:
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers.get(REPLAYED) == "true", response.headers
    assert response.json()["id"] == charge_id


def now() -> datetime:
    """This machine's clock, which the servers (on this machine) stamp leases with."""
    return datetime.now(timezone.utc)


def sleep_past(moment: datetime) -> None:
    """Let real time pass ``moment`` (a lease's expiry): what the tests using it are about."""
    time.sleep(max(0.0, (moment - now()).total_seconds()) + 0.05)
    assert now() > moment


def renewed_lease(database: Database, key: str, *, past: datetime, within: float) -> datetime:
    """Poll the record of ``key`` until a heartbeat has pushed its lease beyond ``past``, at
    most ``within`` seconds (the beats come with real time: waiting for them is the point)."""
    deadline = time.monotonic() + within
    while True:
        lease = record_lease(database, key)
        if lease is not None and lease > past:
            return lease
        assert time.monotonic() < deadline, f"the lease was not renewed within {within}s"
        time.sleep(0.1)


# --- 1. concurrent duplicates -----------------------------------------------------------------


def test_concurrent_duplicates_make_one_charge(server: Server, key: str) -> None:
    body = charge_body()
    before = server.charge_count()
    responses = concurrently(CLIENTS, lambda: server.post_charge(body, key=key))
    assert len(responses) == CLIENTS, responses
    statuses = sorted(response.status_code for response in responses)
    assert set(statuses) <= {201, 409}, statuses
    created = [response for response in responses if response.status_code == 201]
    # Exactly one request ran the view; a 201 that came later is a replay of it.
    ran = [response for response in created if REPLAYED not in response.headers]
    assert len(ran) == 1, statuses
    charge_id = ran[0].json()["id"]
    for response in created:
        assert response.json()["id"] == charge_id
        if response is not ran[0]:
            assert_replay_of(response, 201, charge_id)
    for response in responses:
        if response.status_code == 409:
            assert_in_flight(response)

    assert server.charge_count() == before + 1
    assert server.charge_ids().count(charge_id) == 1
    retry = server.post_charge(body, key=key)
    assert_replay_of(retry, 201, charge_id)
    assert retry.content == ran[0].content
    assert retry.headers["Location"] == ran[0].headers["Location"] == f"/charges/{charge_id}"


# --- 2. a worker dies mid-flight --------------------------------------------------------------


def test_killed_worker_lease_lapses_and_one_retry_takes_over(
    start_example: Callable[..., Server], e2e_db: Database, key: str
) -> None:
    # The lease must outlast the workers' respawn, or no retry can be answered while the
    # dead worker's claim is still valid. With every worker killed, the replacements import
    # Django at once: 2-4 s on 2 cores, so a 1 s lease lapses before anyone can ask; with
    # CI's second lane busy on the other core, 4-7 s: the lease lapses no sooner than 7 s
    # after the kill.
    lease = 12.0
    # Long enough for the request to be still running when its lease is first renewed.
    delay = 5.0
    server = start_example(
        EXAMPLE_LEASE_SECONDS=str(lease), EXAMPLE_PROVIDER_DELAY_MS=str(int(delay * 1000))
    )
    body = charge_body()
    before = server.charge_count()

    # Two duplicates: one claims the key and waits on the provider, the other is told 409.
    running, refused = race_duplicates(server, body, key=key)
    assert refused.outcome is not None, refused.error
    assert_in_flight(refused.outcome)
    # The running worker's heartbeat renews the lease every lease/3: let it do so once.
    claimed = record_lease(e2e_db, key)
    assert claimed is not None
    renewed = renewed_lease(e2e_db, key, past=claimed, within=lease)

    killed = server.kill_workers()
    killed_at = now()
    assert len(killed) == WORKERS, killed
    running.wait_done()
    assert running.outcome is None, "the request was answered although its worker died"
    # Nobody renews it any more. Renewed every lease/3 until the kill, it lapses no sooner
    # than 2/3 of a lease after it (1 s of slack for a late heartbeat).
    last_lease = record_lease(e2e_db, key)
    assert last_lease is not None
    assert last_lease >= renewed
    assert last_lease - killed_at >= timedelta(seconds=2 * lease / 3 - 1), (killed_at, last_lease)

    def attempt() -> tuple[datetime, requests.Response]:
        response = server.post_charge(body, key=key)
        return now(), response

    (answered_at, taken), waited = retry_until(
        attempt, lambda result: result[1].status_code != 409, within=30, every=0.5
    )
    # The dead worker's claim is honoured until its lease lapses…
    assert waited, "the first retry after the kill took over a claim whose lease was valid"
    for _, response in waited:
        assert_in_flight(response)
    # …and then it is not wedged: a retry takes the key over and runs the charge.
    assert taken.status_code == 201, (taken.status_code, taken.text)
    assert REPLAYED not in taken.headers
    # Taken over only once the renewed lease had lapsed (then the provider's delay ran).
    assert answered_at >= last_lease + timedelta(seconds=delay), (answered_at, last_lease)
    assert answered_at < last_lease + timedelta(seconds=delay + 10), (
        "the key stayed locked long after its lease"
    )
    charge_id = taken.json()["id"]

    assert server.charge_count() == before + 1
    assert server.charge_ids().count(charge_id) == 1
    assert_replay_of(server.post_charge(body, key=key), 201, charge_id)
    # The master replaced the killed workers.
    assert not set(killed) & set(server.worker_pids())


# --- 3. a view that runs longer than its lease ------------------------------------------------


def test_heartbeat_keeps_a_long_request_the_owner_of_its_key(
    start_example: Callable[..., Server], e2e_db: Database, key: str
) -> None:
    # A 6 s view with a 2 s lease: its worker's heartbeat renews the lease every 2/3 s, so
    # duplicates sent after the lease it claimed with, and after the next one, would have
    # lapsed are still refused, and the view runs once.
    lease = 2.0
    server = start_example(EXAMPLE_LEASE_SECONDS=str(lease), EXAMPLE_PROVIDER_DELAY_MS="6000")
    body = charge_body()
    before = server.charge_count()

    running, refused = race_duplicates(server, body, key=key)
    assert refused.outcome is not None, refused.error
    assert_in_flight(refused.outcome)
    leases = [record_lease(e2e_db, key)]
    for _ in range(2):
        previous = leases[-1]
        assert previous is not None
        sleep_past(previous)  # real time runs past the lease last read: that is the point
        assert not running.done.is_set(), "the view finished too early for this test"
        duplicate = server.post_charge(body, key=key)
        refused_at = now()
        assert_in_flight(duplicate)
        # The heartbeat moved the lease on while the view ran: it was valid when refused.
        current = record_lease(e2e_db, key)
        assert current is not None
        assert current > previous, leases
        assert current > refused_at, (current, refused_at)
        leases.append(current)

    running.wait_done()
    assert running.error is None, running.error
    assert running.outcome is not None
    assert running.outcome.status_code == 201, running.outcome
    assert REPLAYED not in running.outcome.headers
    charge_id = running.outcome.json()["id"]

    assert record_states(e2e_db, [key]) == {key: COMPLETED}
    assert server.charge_count() == before + 1
    assert server.charge_ids().count(charge_id) == 1
    assert_replay_of(server.post_charge(body, key=key), 201, charge_id)


# --- 4. the HTTP contract ----------------------------------------------------------------------


def test_declined_card_is_stored_and_replayed_without_a_charge(server: Server, key: str) -> None:
    body = charge_body("tok_declined")
    before = server.charge_count()

    first = server.post_charge(body, key=key)
    assert_problem(first, 402)
    assert REPLAYED not in first.headers
    retry = server.post_charge(body, key=key)
    assert_problem(retry, 402)
    assert retry.headers.get(REPLAYED) == "true"
    assert retry.content == first.content
    assert server.charge_count() == before


def test_provider_timeout_releases_the_key_and_the_retry_runs_again(
    server: Server, key: str
) -> None:
    body = charge_body("tok_timeout")
    before = server.charge_count()

    first = server.post_charge(body, key=key)
    assert_problem(first, 504)
    assert REPLAYED not in first.headers
    retry = server.post_charge(body, key=key)
    assert_problem(retry, 504)
    assert REPLAYED not in retry.headers
    # It ran again: it waited for the (fake) provider's 300 ms.
    assert retry.elapsed >= timedelta(milliseconds=300)
    assert server.charge_count() == before


def test_same_key_with_another_amount_is_422_without_a_charge(server: Server, key: str) -> None:
    body = charge_body()
    first = server.post_charge(body, key=key)
    assert first.status_code == 201, first.text
    after_first = server.charge_count()

    other = server.post_charge({**body, "amount": body["amount"] + 1}, key=key)
    assert_problem(other, 422, "key-mismatch")
    assert REPLAYED not in other.headers
    assert server.charge_count() == after_first


@pytest.mark.parametrize("second", ["other", "same"])
def test_two_key_header_lines_are_400_without_a_charge(
    server: Server, key: str, second: str
) -> None:
    """gunicorn joins the two lines with a comma into one environ value."""
    body = charge_body()
    first = server.post_charge(body, key=key)
    assert first.status_code == 201, first.text
    after_first = server.charge_count()
    lines = [("Idempotency-Key", key), ("Idempotency-Key", new_key() if second == "other" else key)]

    both = post_with_header_lines(server, body, lines)
    assert_problem(both, 400, "key-malformed")
    assert server.charge_count() == after_first


def test_another_account_using_the_same_key_gets_its_own_charge(server: Server, key: str) -> None:
    body = charge_body()
    alice = server.post_charge(body, key=key)
    assert alice.status_code == 201, alice.text
    alice_id = alice.json()["id"]
    alice_count = server.charge_count()
    bob_count = server.charge_count(BOB)

    bob = server.post_charge(body, key=key, auth=BOB)
    assert bob.status_code == 201, bob.text
    assert REPLAYED not in bob.headers
    bob_id = bob.json()["id"]
    assert bob_id != alice_id
    assert server.charge_count(BOB) == bob_count + 1
    assert bob_id in server.charge_ids(BOB)
    assert alice_id not in server.charge_ids(BOB)
    assert server.charge_count() == alice_count
    assert_replay_of(server.post_charge(body, key=key, auth=BOB), 201, bob_id)


def test_anonymous_request_with_a_used_key_gets_401_not_the_stored_charge(
    server: Server, key: str
) -> None:
    body = charge_body()
    alice = server.post_charge(body, key=key)
    assert alice.status_code == 201, alice.text
    alice_id = alice.json()["id"]
    count = server.charge_count()

    anonymous = server.post_charge(body, key=key, auth=None)
    assert anonymous.status_code == 401, anonymous.text
    assert "WWW-Authenticate" in anonymous.headers
    assert REPLAYED not in anonymous.headers
    assert alice_id not in anonymous.text
    assert server.charge_count() == count


def test_missing_key_is_400_without_a_charge(server: Server) -> None:
    before = server.charge_count()
    response = server.post_charge(charge_body(), key=None)
    assert_problem(response, 400, "key-missing")
    assert server.charge_count() == before


def test_malformed_key_is_400_without_a_charge(server: Server) -> None:
    before = server.charge_count()
    response = server.post_charge(charge_body(), key="k" * 256)
    assert_problem(response, 400, "key-malformed")
    assert server.charge_count() == before
