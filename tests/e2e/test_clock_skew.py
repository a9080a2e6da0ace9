"""Two gunicorn servers of the example share one store; one of them runs two minutes ahead.

libfaketime (``FAKETIME=+120``, preloaded into the second server and its workers:
``ahead_of_time``) moves that server's clock, and only its clock: the database, Redis and
the other server keep the real one. The first server holds a live, renewed lease (its view
waits on a lock of the charges table); the duplicate sent to the fast server must be told
409, never run the charge; once the first request ends, the duplicate replays it. On
PostgreSQL or MariaDB (the database store, on the database's clock) and on the Redis store
(on Redis's clock).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from email.utils import parsedate_to_datetime
from pathlib import Path

import pytest
import requests

from tests.conftest import REDIS_URL
from tests.e2e.test_gunicorn import assert_replay_of
from tools import redis_cluster
from tools.server import (
    REPLAYED,
    Database,
    InFlightRequest,
    Server,
    assert_in_flight,
    charge_body,
    charges_locked,
    lock_waits,
    record_lease,
    retry_until,
)

AHEAD = 120  # seconds: forty leases
LEASE = 3.0  # renewed every second
PREFIX = "idemskew"  # the Redis store's keys, in the test Redis database (flushed)


# Python's time.sleep() waits for a deadline on the monotonic clock (clock_nanosleep with
# TIMER_ABSTIME), which libfaketime 0.9.10 rejects (EINVAL) when it leaves that clock alone;
# faking it too makes every timed wait on a lock last two more minutes. So the monotonic
# clock stays real, and the server's sleeps wait with a relative timeout instead.
SLEEP_WITH_SELECT = """\
import select
import time


def _sleep(seconds):
    if seconds > 0:
        select.select([], [], [], seconds)


time.sleep = _sleep
"""


def ahead_of_time(seconds: int, tmp_path: Path) -> dict[str, str]:
    """The environment of a server whose wall clock runs ``seconds`` ahead (libfaketime),
    its monotonic clock, which measures durations, left as it is."""
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1"))
    if not found:
        pytest.skip("libfaketime is not installed (apt-get install faketime)")
    shim = tmp_path / "faketime-shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(SLEEP_WITH_SELECT)
    return {
        "LD_PRELOAD": found[0],
        "FAKETIME": f"+{seconds}",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")])),
    }


@pytest.fixture(params=["database", "redis"])
def store(request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """The example's settings for the store under test (``EXAMPLE_*``)."""
    if request.param == "database":
        yield {}
        return
    try:
        redis_cluster.flush(REDIS_URL)
    except Exception as error:
        pytest.skip(f"no Redis at {REDIS_URL}: {error}")
    yield {"EXAMPLE_REDIS_URL": REDIS_URL, "EXAMPLE_REDIS_KEY_PREFIX": PREFIX}
    redis_cluster.flush(REDIS_URL)


def lease_of(e2e_db: Database, store: dict[str, str], key: str) -> datetime | None:
    """The record's lease, by the store's clock (which is this machine's)."""
    if not store:
        return record_lease(e2e_db, key)
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        (name,) = list(client.scan_iter(f"{PREFIX}:*"))  # one record: the test's
        value = client.get(name)
    finally:
        client.close()
    assert value is not None
    lease_ms = int(value.split(b"|")[2])
    return datetime.fromtimestamp(lease_ms / 1000, tz=timezone.utc) if lease_ms else None


def clock_of(server: Server) -> datetime:
    """The server's clock, as its ``Date`` header tells it (to the second)."""
    response = requests.get(f"{server.base_url}/charges/", auth=("alice", "alice"), timeout=30)
    assert response.status_code == 200, response.text
    return parsedate_to_datetime(response.headers["Date"])


def test_a_server_whose_clock_runs_ahead_never_takes_over_a_live_lease(
    start_example: Callable[..., Server],
    e2e_db: Database,
    store: dict[str, str],
    key: str,
    tmp_path: Path,
) -> None:
    settings = {"EXAMPLE_LEASE_SECONDS": str(LEASE), "EXAMPLE_PROVIDER_DELAY_MS": "0", **store}
    punctual = start_example(**settings)
    ahead = start_example(**ahead_of_time(AHEAD, tmp_path), **settings)
    now = datetime.now(timezone.utc)
    assert clock_of(ahead) - now > timedelta(seconds=AHEAD - 10), "libfaketime did not apply"
    assert abs(clock_of(punctual) - now) < timedelta(seconds=10)
    body = charge_body()
    before = punctual.charge_count()

    with charges_locked(e2e_db) as charges:
        running = InFlightRequest(punctual, body, key=key).start()
        # Claimed, and its view waits on its charge's INSERT.
        retry_until(
            lambda: lock_waits(e2e_db, "INSERT%payments_charge%"),
            lambda waiting: waiting == 1,
            within=20,
            every=0.05,
        )
        claimed = lease_of(e2e_db, store, key)
        assert claimed is not None
        # The punctual server's heartbeat renews the lease every second (real time passing
        # is the point): a live, renewed lease, which the fast server reads as lapsed for
        # two minutes by its own clock.
        renewed, _ = retry_until(
            lambda: lease_of(e2e_db, store, key),
            lambda lease: lease is not None and lease > claimed,
            within=4 * LEASE,
            every=0.1,
        )
        assert renewed is not None

        duplicate = InFlightRequest(ahead, body, key=key).start()
        answered = duplicate.done.wait(15)
        # Not answered: it took the claim over and waits on the charges table, running the
        # charge a second time.
        assert answered, "the fast server took the live claim over and ran the charge"
        assert duplicate.outcome is not None, duplicate.error
        assert_in_flight(duplicate.outcome)
        assert duplicate.outcome.headers["Retry-After"] == "1"  # renewed on schedule
        assert lock_waits(e2e_db, "INSERT%payments_charge%") == 1
        charges.release()

    running.wait_done()
    assert running.outcome is not None, running.error
    assert running.outcome.status_code == 201, running.outcome
    assert REPLAYED not in running.outcome.headers
    charge_id = running.outcome.json()["id"]
    assert_replay_of(ahead.post_charge(body, key=key), 201, charge_id)
    assert punctual.charge_count() == before + 1
    assert punctual.charge_ids().count(charge_id) == 1
