"""The soak's re-run rule (``benchmarks/soak.py``, rule 1) on small recorded runs, and the
``releasing`` line its event recorder writes before a release (``soakproject/events.py``).

A worker killed just after its release's ``DELETE`` leaves the key free and no ``released``
line (that line follows the ``DELETE``); a claim that did not hold (rolled back with a
transaction the kill ended) leaves the key free too. The line written before the release
tells them apart: the first is a re-run after a release, the second a violation. The
live check of the same is ``python -m benchmarks.soak --sabotage rollback``, which must fail.
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import soak
from benchmarks.soakproject import events
from idempotency_django.core import claims, shell
from tests import records

T0 = 1_000_000.0
LEASE = 2.0
ACCOUNT = "1"
KEY = "soak-t-1"


def run(scenario: str, card: str) -> soak.Clients:
    clients = soak.Clients(0, run_id="t", traffic_end=0.0, drain_end=0.0, lease=LEASE)
    clients.t0 = T0
    clients.keys[1] = soak.Key(1, KEY, "alice", scenario, card)
    return clients


def event(t: float, pid: int, name: str, **fields: Any) -> dict[str, Any]:
    return {"t": T0 + t, "pid": pid, "event": name, **fields}


def signal(t: float, pid: int, name: str) -> dict[str, Any]:
    return event(t, pid, name, account=ACCOUNT, key=KEY, backend=pid + 1000)


def kill(pid: int, sent: float) -> soak.Faults:
    return soak.Faults(done=[soak.Fault(T0 + sent, T0 + sent + 0.002, "kill", pid)])


def checked(
    clients: soak.Clients,
    faults: soak.Faults,
    recorded: list[dict[str, Any]],
    charges: list[tuple[int, int, int, str, Any]] | None = None,
) -> tuple[soak.Check, soak.Check]:
    """The soak's rule 1 (re-runs) and rule 2 (charges) on this run."""
    checks = soak.check(clients, faults, charges or [], {"alice": ACCOUNT}, recorded, [], [])
    return checks[0], checks[1]


# Execution 1 claims at +1.000 s on worker 100, whose 100 ms provider call then returns; the
# worker is killed at +1.102 s; execution 2 claims the key afresh at +1.200 s, well within
# execution 1's lease of 2 s, on worker 200, and completes.
FIRST = [signal(1.000, 100, "claimed")]
SECOND = [
    signal(1.200, 200, "claimed"),
    event(1.310, 200, "request_finished"),
]


def test_a_rerun_after_a_release_whose_released_event_a_kill_cut_passes() -> None:
    recorded = [*FIRST, signal(1.101, 100, "releasing"), *SECOND]

    rule, charged = checked(run("timeout", "tok_timeout"), kill(100, 1.102), recorded)

    assert rule.ok, rule.violations
    assert "1 re-runs after a release" in rule.summary
    assert "1 of them after a kill that cut the release's event" in rule.summary
    assert rule.notes == [
        f"{KEY} (timeout): execution 2 (claimed by pid 200 on backend 1200 at +1.200s, ended "
        "+1.310s) after 1 (claimed by pid 100 on backend 1100 at +1.000s, never ended): it "
        "began to release the key at +1.101s, and the kill of worker pid 100 at +1.102s "
        "(gone +1.104s) cut its ``released`` event"
    ]
    assert charged.ok


def test_a_fresh_claim_within_the_lease_of_a_killed_run_that_never_released_fails() -> None:
    # The same, without the ``releasing`` line: execution 1's claim was gone while it ran
    # (say it rolled back with a transaction the kill ended). One charge: rule 2 passes,
    # so only this rule can tell.
    charges = [(1, int(ACCOUNT), 10, "tok_visa", T0 + 1.25)]

    rule, charged = checked(run("new", "tok_visa"), kill(100, 1.102), FIRST + SECOND, charges)

    assert not rule.ok
    assert rule.violations == [
        f"{KEY} (new): execution 2 (claimed by pid 200 on backend 1200 at +1.200s, ended "
        "+1.310s) after 1 (claimed by pid 100 on backend 1100 at +1.000s, never ended), cut by "
        "the kill of worker pid 100 at +1.102s (gone +1.104s) before it began any release, "
        "and yet the key was claimed afresh within its lease: its claim did not hold"
    ]
    assert charged.ok


def test_another_workers_release_of_the_key_excuses_nothing() -> None:
    # A release line of the same key from another worker (a concurrent duplicate's, which
    # claimed nothing) is not execution 1's release.
    recorded = [*FIRST, signal(1.101, 300, "releasing"), *SECOND]

    rule, _ = checked(run("timeout", "tok_timeout"), kill(100, 1.102), recorded)

    assert not rule.ok
    assert "its claim did not hold" in rule.violations[0]


@pytest.mark.django_db(transaction=True)
def test_the_releasing_line_is_written_before_the_store_releases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for store in events._stores():  # restored after the test
        monkeypatch.setattr(store, "release", store.release)
    seen: list[tuple[str, str, int]] = []

    def write(line: dict[str, Any]) -> None:
        seen.append((line["event"], line["key"], records.count(key=line["key"])))

    monkeypatch.setattr(events, "write", write)
    events._record_releases()
    events._record_releases()  # a second ready() wraps nothing twice
    policy = claims.ClaimPolicy(
        "default", lease=5, ttl=60, in_flight="conflict", wait_seconds=0, retry_after=1
    )
    claim = shell.claim_or_replay(claims.Scope(ACCOUNT, "POST /charges/", "k"), "f" * 64, policy)
    assert isinstance(claim, claims.Claim)

    shell.release(claim)

    assert seen == [("releasing", "k", 1)]  # one line, while the record was still there
    assert records.count(key="k") == 0
