"""PostgreSQL under Patroni (``tools.ha.patroni``): the database store's primary killed
under load, with synchronous replication and without, and what the new primary lost.

Slow (each case starts etcd and two PostgreSQL nodes, runs the example under gunicorn and
waits out a leader key's TTL: about a minute), so they run only when asked for:
``IDEMPOTENCY_TEST_PATRONI=1 python -m pytest -m patroni -p no:randomly
tests/test_patroni.py`` (docs/stores.md, "PostgreSQL under Patroni").
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("psycopg", reason="PostgreSQL's driver (the postgres extra)")

from tools.ha import failover_loss
from tools.ha.patroni import PatroniTopology

pytestmark = [
    pytest.mark.patroni,
    pytest.mark.skipif(
        not os.environ.get("IDEMPOTENCY_TEST_PATRONI"),
        reason="slow: IDEMPOTENCY_TEST_PATRONI=1 runs it",
    ),
    pytest.mark.skipif(
        shutil.which("patroni") is None or shutil.which("etcd") is None,
        reason="needs patroni and etcd-server",
    ),
]


def test_the_multi_host_url_reaches_the_primary_before_and_after_a_failover() -> None:
    """libpq's ``target_session_attrs=read-write`` skips the standby: the same
    connection string reaches whichever node leads, and Django accepts it."""
    import dj_database_url

    with PatroniTopology(sync=True) as topology:
        config = dj_database_url.parse(topology.url())
        assert config["HOST"] == ""  # Django's HOST would override the OPTIONS' list
        assert config["OPTIONS"]["target_session_attrs"] == "read-write"
        for _ in range(2):
            leader = topology.leader()
            with topology.connect() as connection:
                port, standby = connection.execute(
                    "SELECT inet_server_port(), pg_is_in_recovery()"
                ).fetchone()
            assert (port, standby) == (leader.pg_port, False)
            new = topology.kill_primary()
            assert new != leader.address


@pytest.mark.parametrize(
    ("mode", "cut_off"),
    [("async", True), ("sync", False), ("strict", True)],
)
def test_what_a_failover_of_the_primary_loses(mode: str, cut_off: bool) -> None:
    """Acknowledged charges (201 before the kill) whose record the surviving node lacks:
    each is a second execution waiting for its retry.

    - asynchronous, the replica cut off for 2 s before the kill: what the primary
      committed meanwhile is lost, and the replica is promoted all the same;
    - synchronous (Patroni's ``synchronous_mode``), a healthy replica: nothing is lost;
    - strict (``synchronous_mode_strict``), the replica cut off: commits wait for it, so
      nothing acknowledged is lost; Patroni does not promote a replica it has not seen
      catch up, so the database stays without a primary (a 5xx for every request)."""
    with tempfile.TemporaryDirectory(prefix="ha-patroni-logs-") as logs:
        loss = failover_loss.run(mode, freeze=cut_off, threads=8, before=100, log_dir=Path(logs))
    print(f"\n{loss.line()}")
    lost = loss.claim_lost + loss.outcome_lost
    assert loss.answered_201 >= 100
    if mode == "async":
        assert lost > 0, loss.line()  # the documented loss
        assert loss.promoted
        assert loss.charges_lost == lost  # each with its charge: a provider would charge again
    else:
        assert lost == 0, loss.lost_keys
        assert loss.kept == loss.answered_201
        assert loss.promoted == (not cut_off)
