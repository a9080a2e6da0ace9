"""The example under gunicorn behind a real PgBouncer in transaction-pooling mode, with
persistent connections, prepared statements on and off: one charge per key, whatever the
pooler did to the statements.

PgBouncer before 1.21 (Debian's 1.18), or with ``max_prepared_statements = 0``, hands a
client's next transaction to whichever server connection is free, where the statements
psycopg prepared on another do not exist (SQLSTATE 26000), or exist already (42P05). The
app may answer 503 for such a request (the view did not run), but a request whose work
committed must have its outcome stored: a retry after the lease must replay, never charge
again (docs/guarantees.md). Runs on PostgreSQL with ``pgbouncer`` installed, else skipped.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tools.pgbouncer import PgBouncer, pgbouncer_binary, start_pgbouncer
from tools.server import (
    IN_PROGRESS,
    Database,
    Server,
    example_env,
    new_amount,
    new_key,
    query,
    record_lease,
    record_states,
    spawn_gunicorn,
)

pytestmark = pytest.mark.pgbouncer

KEYS = 80
CLIENTS = 8
ATTEMPTS = 40  # per key, before a key counts as never answered
LEASE_SECONDS = 2.0


@pytest.fixture(scope="module")
def pgbouncer(e2e_db: Database) -> Iterator[PgBouncer]:
    if e2e_db.vendor != "postgresql":
        pytest.skip("PgBouncer is PostgreSQL's pooler")
    if pgbouncer_binary() is None:
        pytest.skip("pgbouncer is not installed (apt-get install pgbouncer)")
    bouncer = start_pgbouncer(e2e_db)
    yield bouncer
    bouncer.stop()


def send_until_answered(server: Server, key: str, amount: int) -> list[int]:
    """POST one charge with ``key`` until it is answered with anything but a 409 (in
    flight) or a 503 (store unavailable: the view did not run), as a client retries; the
    status of each attempt."""
    body = {"amount": amount, "currency": "EUR", "card": "tok_visa"}
    statuses: list[int] = []
    for _ in range(ATTEMPTS):
        statuses.append(server.post_charge(body, key=key).status_code)
        if statuses[-1] not in (409, 503):
            break
        time.sleep(0.02)  # a client's back-off; the server's state decides the outcome
    return statuses


def one_round(server: Server, keys: dict[str, int]) -> dict[str, list[int]]:
    """Every key (``{key: amount}``) sent until answered, by ``CLIENTS`` clients at once."""
    with ThreadPoolExecutor(CLIENTS) as clients:
        answers = clients.map(lambda key: send_until_answered(server, key, keys[key]), keys)
        return dict(zip(keys, answers, strict=True))


@pytest.mark.parametrize("prepare_threshold", ["off", "5"], ids=["unprepared", "prepared"])
def test_through_pgbouncer_in_transaction_mode_one_charge_per_key(
    e2e_db: Database, pgbouncer: PgBouncer, prepare_threshold: str, tmp_path: Path
) -> None:
    server = spawn_gunicorn(
        example_env(
            pgbouncer.url(e2e_db),
            EXAMPLE_PG_PREPARE_THRESHOLD=prepare_threshold,
            EXAMPLE_CONN_MAX_AGE="60",  # persistent connections: psycopg gets to prepare
            EXAMPLE_LEASE_SECONDS=str(LEASE_SECONDS),
            EXAMPLE_PROVIDER_DELAY_MS="10",
        ),
        tmp_path / "gunicorn.log",
    )
    try:
        server.wait_ready()
        # This run's charges only (the other parametrisation's share the table), each key's
        # amount its own: a random amount drawn twice would read as a key charged twice.
        (before,) = query(e2e_db, "SELECT coalesce(max(id), 0) FROM payments_charge")[0]
        amounts: set[int] = set()
        while len(amounts) < KEYS:
            amounts.add(new_amount())
        keys = {new_key(): amount for amount in amounts}
        first = one_round(server, keys)
        # A retry of every key after every lease lapsed: a key whose outcome was not
        # stored would run (and charge) again now.
        stuck = [key for key, state in record_states(e2e_db, keys).items() if state == IN_PROGRESS]
        leases = [lease for lease in map(lambda key: record_lease(e2e_db, key), stuck) if lease]
        if leases:
            time.sleep(max(0.0, (max(leases) - datetime.now(timezone.utc)).total_seconds()) + 0.2)
        again = one_round(server, keys)
        rows = query(
            e2e_db,
            "SELECT amount, count(*) FROM payments_charge WHERE id > %s AND amount = ANY(%s) "
            "GROUP BY amount",
            [before, list(keys.values())],
        )
        charges = {int(amount): int(count) for amount, count in rows}
        states = record_states(e2e_db, keys)
    finally:
        server.stop()

    attempts = Counter(status for statuses in first.values() for status in statuses)
    summary = (
        f"PgBouncer {pgbouncer.version}, prepare_threshold {prepare_threshold}: "
        f"{len(keys)} keys, first round's attempts {dict(attempts)}, "
        f"{len(stuck)} left in progress after a 2xx"
    )
    double = {amount: count for amount, count in charges.items() if count > 1}
    assert double == {}, f"{len(double)} keys charged twice; {summary}"
    assert stuck == [], summary  # a 2xx, and its outcome not stored
    assert [key for key, state in states.items() if state == IN_PROGRESS] == [], summary
    assert sorted(charges) == sorted(keys.values()), summary
    assert {statuses[-1] for statuses in first.values()} == {201}, summary
    assert {statuses[-1] for statuses in again.values()} == {201}, summary
