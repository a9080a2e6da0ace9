"""What a PostgreSQL failover under Patroni loses, with synchronous replication and without.

``python -m tools.ha.failover_loss`` runs, for each mode asked (``--mode sync async``), the
example project under gunicorn on a fresh ``PatroniTopology`` (the database store, its
records and the charges in PostgreSQL), sends keyed charges from several threads, and
SIGKILLs the primary's host (Patroni and PostgreSQL) in the middle; the replica is
promoted once the leader key's TTL runs out. With ``--freeze-replica`` the replica's WAL
receiver is frozen (SIGSTOP) for a moment before the kill: the replica lags, as a loaded
one does.

Then, on the new primary, for every key the app answered 201 before the kill:

- **kept**: its record is completed and its charge is there: a retry replays it;
- **outcome lost**: its record is back in progress (its completion did not reach the
  replica): retries get 409 until the lease lapses, then one runs the charge again;
- **claim lost**: no record at all: the next retry runs the charge again at once.

Each lost key is a second execution waiting for its retry: here the charge row was lost with
it, but a card provider outside the database would charge twice. The report prints one line
per mode; ``--json`` writes them to a file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import requests

from tools import server
from tools.ha.patroni import PatroniTopology

FREEZE_SECONDS = 2.0
PROMOTION_WITHIN_SECONDS = 45.0
BODY: dict[str, Any] = {"amount": 1000, "currency": "eur", "card": "tok_visa"}


@dataclass
class Loss:
    mode: str
    cut_off: bool
    answered_201: int = 0
    kept: int = 0
    outcome_lost: int = 0
    claim_lost: int = 0
    charges_lost: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    failover_seconds: float = 0.0
    lost_keys: list[str] = field(default_factory=list)
    promoted: bool = True

    def line(self) -> str:
        return (
            f"{self.mode:<6} replica cut off: {'yes' if self.cut_off else 'no ':<3}  "
            f"201s before the kill: {self.answered_201:>4}  kept: {self.kept:>4}  "
            f"outcome lost: {self.outcome_lost:>3}  claim lost: {self.claim_lost:>3}  "
            f"charges lost: {self.charges_lost:>3}  "
            + (
                f"failover: {self.failover_seconds:4.1f} s  "
                if self.promoted
                else f"NOT PROMOTED within {PROMOTION_WITHIN_SECONDS:.0f} s  "
            )
            + f"statuses: {dict(sorted(self.statuses.items()))}"
        )


@contextlib.contextmanager
def cut_off_replica(topology: PatroniTopology) -> Iterator[None]:
    """For the block, the replica hears nothing: its WAL receiver is frozen (SIGSTOP) and
    the primary's WAL sender to it terminated, so what the primary commits meanwhile is not
    sent (freezing alone is not enough: what was sent waits in the receiver's socket and is
    applied on resume)."""
    leader = topology.leader()
    replica = next(node for node in topology.nodes if node.name != leader.name)
    with topology.node_connect(replica, "postgres") as connection:
        row = connection.execute("SELECT pid FROM pg_stat_wal_receiver").fetchone()
    pid = int(row[0]) if row else None
    if pid is not None:
        os.kill(pid, signal.SIGSTOP)
    try:
        with topology.node_connect(leader, "postgres") as connection:
            connection.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_replication")
        yield
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def run(mode: str, *, freeze: bool, threads: int, before: int, log_dir: Path) -> Loss:
    loss = Loss(mode=mode, cut_off=freeze)
    with PatroniTopology(sync=mode != "async", strict=mode == "strict") as topology:
        env = server.example_env(
            topology.url(), EXAMPLE_PROVIDER_DELAY_MS="20", EXAMPLE_CONN_MAX_AGE="0"
        )
        server.manage(env, "migrate", "--noinput", "-v", "0")
        app = server.spawn_gunicorn(env, log_dir / f"gunicorn-{mode}.log")
        try:
            app.wait_ready()
            answered: dict[str, tuple[int, float, dict[str, Any] | None]] = {}
            lock = threading.Lock()
            stop = threading.Event()

            def load() -> None:
                session = requests.Session()
                while not stop.is_set():
                    key = f"k-{uuid.uuid4()}"
                    try:
                        response = session.post(
                            f"{app.base_url}/charges/",
                            json=BODY,
                            headers={"Idempotency-Key": key},
                            auth=server.ALICE,
                            timeout=30,
                        )
                    except requests.RequestException:
                        continue  # an unknown outcome: not counted as answered
                    body = response.json() if response.status_code == 201 else None
                    with lock:
                        answered[key] = (response.status_code, time.monotonic(), body)

            workers = [threading.Thread(target=load) for _ in range(threads)]
            for worker in workers:
                worker.start()
            try:
                _wait(lambda: len(answered) >= before, "load before the kill")
                with cut_off_replica(topology) if freeze else contextlib.nullcontext():
                    if freeze:
                        # Answers the primary gives while the replica hears nothing; in sync
                        # mode none come (commits wait for the replica): the fault lasts
                        # FREEZE_SECONDS at most.
                        mark = len(answered)
                        _wait(
                            lambda: len(answered) >= mark + 2 * threads,
                            "load while frozen",
                            FREEZE_SECONDS,
                            strict=False,
                        )
                    killed_at = time.monotonic()
                    old = topology.leader()
                    topology._kill(old)
                survivor = next(node for node in topology.nodes if node.name != old.name)
                _wait(
                    lambda: _safely(lambda: topology._leads(survivor)),
                    "the replica promoted",
                    PROMOTION_WITHIN_SECONDS,
                    strict=False,
                )
                if _safely(lambda: topology._leads(survivor)):
                    loss.failover_seconds = time.monotonic() - killed_at
                    settled = len(answered)
                    _wait(lambda: len(answered) >= settled + threads, "load after failover", 60)
                else:
                    loss.promoted = False
            finally:
                stop.set()
                for worker in workers:
                    worker.join(60)
            for status, _, _ in answered.values():
                loss.statuses[str(status)] = loss.statuses.get(str(status), 0) + 1
            acknowledged = {
                key: body
                for key, (status, at, body) in answered.items()
                if status == 201 and at < killed_at
            }
            loss.answered_201 = len(acknowledged)
            # On the survivor (the new primary, or the replica Patroni would not promote:
            # what a forced promotion would serve), with the driver (tools.server's
            # helpers read HOST, which a multi-host URL leaves empty).
            charge_ids = [
                int(str(body["id"]).removeprefix("ch_")) for body in acknowledged.values() if body
            ]
            with topology.node_connect(survivor) as connection:
                states = dict(
                    connection.execute(
                        f"SELECT key, state FROM {server.RECORDS_TABLE} WHERE key = ANY(%s)",
                        [list(acknowledged)],
                    ).fetchall()
                )
                present = {
                    int(row[0])
                    for row in connection.execute(
                        f"SELECT id FROM {server.CHARGES_TABLE} WHERE id = ANY(%s)", [charge_ids]
                    ).fetchall()
                }
            loss.charges_lost = len(set(charge_ids) - present)
            for key in acknowledged:
                state = states.get(key)
                if state == server.COMPLETED:
                    loss.kept += 1
                    continue
                loss.lost_keys.append(key)
                if state is None:
                    loss.claim_lost += 1
                else:
                    loss.outcome_lost += 1
        finally:
            app.stop()
    return loss


def _safely(check: Any) -> bool:
    try:
        return bool(check())
    except Exception:
        return False


def _wait(check: Any, what: str, within: float = 60, *, strict: bool = True) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            if not strict:
                return
            raise TimeoutError(f"{what} not reached within {within:.0f} s")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.ha.failover_loss")
    parser.add_argument(
        "--mode",
        nargs="+",
        choices=["sync", "strict", "async"],
        default=["strict", "sync", "async"],
    )
    parser.add_argument(
        "--cut-off-replica",
        dest="freeze",
        action="store_true",
        help="a replica that hears nothing for 2 s before the kill",
    )
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--before", type=int, default=200, help="answers before the kill")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--log-dir", type=Path, help="keep gunicorn's logs here")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="ha-failover-loss-") as temporary:
        logs = args.log_dir or temporary
        for mode in args.mode:
            loss = run(
                mode,
                freeze=args.freeze,
                threads=args.threads,
                before=args.before,
                log_dir=Path(logs),
            )
            print(loss.line(), flush=True)
            results.append(loss)
    if args.json:
        args.json.write_text(json.dumps([asdict(loss) for loss in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
