#!/usr/bin/env python
"""Soak the example payments API with faults, then check that no key charged twice.

    python -m benchmarks.soak --database postgres --seconds 60
    python -m benchmarks.soak --database mariadb --seconds 60
    python -m benchmarks.soak --seconds 10          # the CI version (PostgreSQL)

The example project (``/charges/``, ``@idempotent``, HTTP Basic) runs under gunicorn with 4
sync workers on a database of its own. For ``--seconds``, concurrent clients send a mix of
traffic — new keys, immediate (concurrent) duplicates, delayed retries, mismatched bodies,
``tok_timeout`` and ``tok_declined`` cards — and retry every key until it has a definitive
answer, while a fault injector SIGKILLs a random worker every few seconds and terminates the
workers' database connections now and then (``pg_terminate_backend``, ``KILL CONNECTION`` on
MariaDB). Then the faults stop, the clients finish their keys, and the invariants are
checked and printed; the exit code is 1 on any violation.

Ground truth: the client encodes each key's serial number in the amount it charges
(``amount = serial x 10 + variant``, the variant telling a mismatched body apart), so every
``Charge`` row names its key without any change to the example. The soak settings add an
app that records the server's idempotency signals and warnings (``soakproject/events.py``):
each execution of the view (a claim or take-over) with its worker's pid, its database
session and its time, and the end of each request. The injector records each fault's target
(the pid it killed, the session it terminated), when it was sent and when the target was
gone. A key's view may run again only after its previous execution released the key, or
after a fault the soak caused cut that execution mid-run and its lease lapsed: anything
else is a violation, however the server logged it.

It always ends: a hard deadline kills gunicorn, drops the database and exits (code 3).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import functools
import http.client
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools import redis_cluster
from tools.redis_cluster import StandaloneRedis
from tools.server import (
    Database,
    Server,
    create_database,
    database,
    drop_database,
    manage,
    open_connection,
    project_env,
    query,
    server_version,
    spawn_gunicorn,
)

REPO_ROOT = Path(__file__).resolve().parents[1]

SETTINGS = "benchmarks.soakproject.settings"
USERS = {"alice": "alice", "bob": "bob"}
DEFAULT_URLS = {
    "postgres": os.environ.get("SOAK_POSTGRES_URL", "postgres://root@127.0.0.1:5432/soak_pg"),
    "mariadb": os.environ.get("SOAK_MARIADB_URL", "mysql://root@127.0.0.1:3306/soak_my"),
}
RECORDS = "idempotency_django_idempotencyrecord"
HTTP_TIMEOUT = 20.0
# Answers after which a client retries the same request: no answer (a killed worker), the
# key in flight, the store unavailable, and a 500 (the view's own database call failed).
RETRYABLE = frozenset({409, 500, 503})
# key scenario -> weight
MIX = {
    "new": 30,
    "duplicate": 20,
    "delayed_retry": 15,
    "mismatch": 10,
    "mismatch_concurrent": 5,
    "timeout": 10,
    "declined": 10,
}
CARDS = {"timeout": "tok_timeout", "declined": "tok_declined"}


def log(text: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# --- the clients ----------------------------------------------------------------------------


@dataclass
class Attempt:
    serial: int
    variant: int
    purpose: str
    sent: float  # time.time()
    received: float = 0.0
    status: int | None = None  # None: no answer
    error: str | None = None
    content_type: str = ""
    body: bytes = b""
    replayed: bool = False
    retry_after: str | None = None

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None


@dataclass
class Key:
    serial: int
    key: str
    user: str
    scenario: str
    card: str
    attempts: list[Attempt] = field(default_factory=list)
    abandoned: bool = False
    # Broken expectations: (what, excused when the soak cut one of the key's executions: the
    # retry that runs it again after the lease gets a new answer, not a replay).
    expectations: list[tuple[str, bool]] = field(default_factory=list)

    def amount(self, variant: int) -> int:
        return self.serial * 10 + variant

    def body(self, variant: int) -> bytes:
        data = {"amount": self.amount(variant), "currency": "EUR", "card": self.card}
        return json.dumps(data).encode()


class Clients:
    """Threads that each run one key's scenario after another until traffic stops."""

    def __init__(
        self, port: int, run_id: str, traffic_end: float, drain_end: float, lease: float
    ) -> None:
        self.port = port
        self.run_id = run_id
        self.traffic_end = traffic_end  # time.monotonic(): no new keys after this
        self.drain_end = drain_end  # give up retrying after this
        self.lease = lease
        self.lock = threading.Lock()
        self.keys: dict[int, Key] = {}
        self.next_serial = 1
        self.crashes: list[str] = []
        self.t0 = time.time()  # the report's times are relative to this

    # -- HTTP

    def send(self, key: Key, variant: int, purpose: str) -> Attempt:
        credentials = base64.b64encode(f"{key.user}:{USERS[key.user]}".encode()).decode()
        attempt = Attempt(key.serial, variant, purpose, sent=time.time())
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=HTTP_TIMEOUT)
        try:
            connection.request(
                "POST",
                "/charges/",
                body=key.body(variant),
                headers={
                    "Content-Type": "application/json",
                    "Authorization": f"Basic {credentials}",
                    "Idempotency-Key": key.key,
                },
            )
            response = connection.getresponse()
            attempt.body = response.read()
            attempt.status = response.status
            attempt.content_type = response.getheader("Content-Type", "")
            attempt.replayed = response.getheader("Idempotent-Replayed") == "true"
            attempt.retry_after = response.getheader("Retry-After")
        except (OSError, http.client.HTTPException) as exc:
            attempt.error = f"{type(exc).__name__}: {exc}"
        finally:
            connection.close()
            attempt.received = time.time()
        with self.lock:
            key.attempts.append(attempt)
        return attempt

    def until_definitive(self, key: Key, variant: int, purpose: str) -> Attempt | None:
        """Send until the answer is not one to retry; ``None`` if the drain deadline passed."""
        while True:
            attempt = self.send(key, variant, purpose)
            if attempt.status is not None and attempt.status not in RETRYABLE:
                return attempt
            purpose = f"{purpose}+retry"
            if attempt.status == 409 and attempt.retry_after:
                pause = min(float(attempt.retry_after), 1.0) * random.uniform(0.3, 1.0)
            else:
                pause = random.uniform(0.05, 0.4)
            if time.monotonic() + pause > self.drain_end:
                key.abandoned = True
                return None
            time.sleep(pause)

    # -- scenarios

    def new_key(self, rng: random.Random) -> Key:
        scenario = rng.choices(list(MIX), weights=list(MIX.values()))[0]
        with self.lock:
            serial = self.next_serial
            self.next_serial += 1
            key = Key(
                serial=serial,
                key=f"soak-{self.run_id}-{serial}",
                user=rng.choice(list(USERS)),
                scenario=scenario,
                card=CARDS.get(scenario, "tok_visa"),
            )
            self.keys[serial] = key
        return key

    def run_key(self, key: Key, rng: random.Random) -> None:
        scenario = key.scenario
        if scenario in ("duplicate", "mismatch_concurrent"):
            variant = 0 if scenario == "duplicate" else 1

            def second() -> None:
                time.sleep(rng.uniform(0.0, 0.05))
                self.until_definitive(key, variant, "concurrent")

            thread = threading.Thread(target=second, daemon=True)
            thread.start()
            self.until_definitive(key, 0, "first")
            thread.join()
            return
        first = self.until_definitive(key, 0, "first")
        if first is None:
            return
        if scenario == "delayed_retry":
            time.sleep(rng.uniform(0.2, 1.5 * self.lease))
            again = self.until_definitive(key, 0, "delayed")
            if again is not None and not again.replayed:
                key.expectations.append(
                    (f"the delayed retry was not a replay ({again.status})", True)
                )
        elif scenario == "mismatch":
            other = self.until_definitive(key, 1, "mismatch")
            if first.status == 201 and other is not None and other.status != 422:
                key.expectations.append(
                    (f"a mismatched body after a 201 got {other.status}", False)
                )
        elif scenario == "declined":
            again = self.until_definitive(key, 0, "retry")
            if first.status != 402 or again is None or again.status != 402 or not again.replayed:
                statuses = (first.status, again and again.status, again and again.replayed)
                key.expectations.append(
                    (f"declined card: (status, retry, replayed) {statuses}", True)
                )
        elif scenario == "timeout":
            again = self.until_definitive(key, 0, "retry")
            if first.status != 504 or again is None or again.status != 504 or again.replayed:
                key.expectations.append((f"timeout card: {first.status}, then {again}", False))

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        try:
            while time.monotonic() < self.traffic_end:
                self.run_key(self.new_key(rng), rng)
        except Exception as exc:  # reported as a violation: the soak itself broke
            self.crashes.append(f"{type(exc).__name__}: {exc}")


# --- the faults -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """One fault the soak caused: a worker killed, or a database session terminated."""

    sent: float  # time.time() just before the kill or the termination was sent
    t: float  # time.time() once its target was gone
    kind: str  # "kill", "termination" or "redis_restart"
    target: int  # the worker's pid, the session's id (PostgreSQL backend / MariaDB thread),
    # or the Redis server's pid

    def hits(self, execution: Execution) -> bool:
        """Whether this fault's target is ``execution``'s worker or connection (a Redis
        restart cuts every worker's connection to the store)."""
        if self.kind == "redis_restart":
            return True
        return self.target == (execution.pid if self.kind == "kill" else execution.backend)

    def cut(self, execution: Execution) -> bool:
        """Whether this fault hit ``execution`` mid-run: sent before it ended, and its target
        gone after it began. A terminated session may be gone before the execution began:
        its worker still held it (the recorded ``backend`` is read from the driver, without a
        query) and finds it dead at its first query, when the claim did not use it (the
        Redis store); a claim that did use it would have reconnected, on another session."""
        if not (self.hits(execution) and self.sent < execution.end):
            return False
        return self.kind == "termination" or execution.start < self.t

    def describe(self, t0: float) -> str:
        what = {
            "kill": "kill of worker pid",
            "termination": "termination of backend",
            "redis_restart": "SIGKILL and restart of Redis pid",
        }[self.kind]
        return f"{what} {self.target} at +{self.sent - t0:.3f}s (gone +{self.t - t0:.3f}s)"


@dataclass
class Faults:
    done: list[Fault] = field(default_factory=list)
    rounds: int = 0  # rounds of connection terminations
    errors: list[str] = field(default_factory=list)

    def count(self, kind: str) -> int:
        return sum(fault.kind == kind for fault in self.done)


def _wait_gone(alive: Callable[[], bool], within: float = 2.0) -> None:
    """Until ``alive()`` is false (``within`` seconds at most). A fault lasts from when it
    was sent until its target is gone: whatever it cut overlaps that time."""
    deadline = time.monotonic() + within
    while alive() and time.monotonic() < deadline:
        time.sleep(0.005)


def _process_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"  # a zombie has ended


def inject_faults(
    gunicorn: Server,
    db: Database,
    until: float,
    kill_every: float,
    terminate_every: float,
    stop: threading.Event,
    faults: Faults,
    rng: random.Random,
    redis_server: StandaloneRedis | None = None,
    restart_every: float = 0.0,
) -> None:
    """SIGKILL a random worker about every ``kill_every`` s, terminate some of the soak
    database's connections about every ``terminate_every`` s and, with ``redis_server``,
    SIGKILL and restart the Redis store about every ``restart_every`` s, until ``until``."""
    now = time.monotonic()
    next_kill = now + kill_every * rng.uniform(0.5, 1.5)
    next_term = now + terminate_every * rng.uniform(0.5, 1.5)
    next_restart = now + restart_every * rng.uniform(0.5, 1.5) if redis_server else math.inf
    connection = None
    while not stop.is_set():
        now = time.monotonic()
        if now >= until:
            break
        if redis_server is not None and now >= next_restart:
            next_restart = now + restart_every * rng.uniform(0.5, 1.5)
            try:
                pid, sent = redis_server.pid(), time.time()
                redis_server.restart()
                faults.done.append(Fault(sent, time.time(), "redis_restart", pid or 0))
            except Exception as exc:
                faults.errors.append(f"Redis restart: {type(exc).__name__}: {exc}")
        if now >= next_kill:
            next_kill = now + kill_every * rng.uniform(0.5, 1.5)
            pids = gunicorn.worker_pids()
            if pids:
                pid, sent = rng.choice(pids), time.time()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    _wait_gone(functools.partial(_process_alive, pid))
                    faults.done.append(Fault(sent, time.time(), "kill", pid))
        if now >= next_term:
            next_term = now + terminate_every * rng.uniform(0.5, 1.5)
            try:
                if connection is None:
                    # On the server, outside the soak's database: never a target itself.
                    connection = open_connection(db, None)
                ended = _terminate(connection, db, rng)
                faults.rounds += 1
                faults.done.extend(Fault(sent, time.time(), "termination", i) for sent, i in ended)
            except Exception as exc:
                faults.errors.append(f"{type(exc).__name__}: {exc}")
                with contextlib.suppress(Exception):
                    if connection is not None:
                        connection.close()
                connection = None
        stop.wait(max(0.0, min(next_kill, next_term, next_restart, until) - time.monotonic()))
    if connection is not None:
        with contextlib.suppress(Exception):
            connection.close()


def _terminate(connection: Any, db: Database, rng: random.Random) -> list[tuple[float, int]]:
    """Terminate a random half (at least one) of the connections to the soak database;
    return (when it was sent, id) of each once they are gone."""
    cursor = connection.cursor()
    if db.vendor == "postgresql":
        listing = "SELECT pid FROM pg_stat_activity WHERE datname = %s"
        kill = "SELECT pg_terminate_backend(%s)"
    else:
        listing = "SELECT id FROM information_schema.processlist WHERE db = %s"
        kill = "KILL CONNECTION %s"

    def sessions() -> set[int]:
        cursor.execute(listing, (db.name,))
        return {int(row[0]) for row in cursor.fetchall()}

    ids = sorted(sessions())
    chosen = [i for i in ids if rng.random() < 0.5] or ids[:1]
    ended = []
    for ident in chosen:
        sent = time.time()
        try:
            cursor.execute(kill, (ident,))
            ended.append((sent, ident))
        except Exception:  # it ended on its own in the meantime
            continue
    _wait_gone(lambda: bool(sessions() & {ident for _, ident in ended}))
    return ended


# --- the checks -----------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    violations: list[str]
    summary: str
    notes: list[str] = field(default_factory=list)  # printed under the line, pass or fail

    @property
    def ok(self) -> bool:
        return not self.violations


@dataclass
class Execution:
    """One run of a key's view, as its worker recorded it: from its claim to its request's end."""

    key: Key
    how: str  # the signal that began it: "claimed" or "lease_taken_over"
    pid: int  # the gunicorn worker
    backend: int | None  # its database session (PostgreSQL backend pid, MariaDB thread id)
    start: float
    end: float = math.inf  # its request finished; never, if its worker died
    released: float = math.inf  # it released the key (its outcome was not stored)
    releasing: float = math.inf  # it was about to release the key (just before the store's
    # DELETE or script, while ``released`` comes after it)

    def describe(self, t0: float) -> str:
        end = f"ended +{self.end - t0:.3f}s" if self.end < math.inf else "never ended"
        return (
            f"{self.how} by pid {self.pid} on backend {self.backend} "
            f"at +{self.start - t0:.3f}s, {end}"
        )


def epoch(value: Any) -> float:
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:  # MariaDB: naive UTC (USE_TZ)
            value = value.replace(tzinfo=datetime.timezone.utc)
        return float(value.timestamp())
    return float(value)


def read_events(directory: Path) -> list[dict[str, Any]]:
    events = []
    for path in sorted(directory.glob("events-*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):  # a line cut short by SIGKILL
                events.append(json.loads(line))
    return sorted(events, key=lambda event: float(event["t"]))


def executions(
    events: list[dict[str, Any]], by_scope: dict[tuple[str, str], Key]
) -> list[Execution]:
    """Every execution of a soak key's view, in the order they began. A sync worker runs one
    request at a time: its next ``request_finished`` ends its execution."""
    found: list[Execution] = []
    running: dict[int, list[Execution]] = defaultdict(list)
    for event in events:
        name, pid, t = event.get("event"), int(event["pid"]), float(event["t"])
        if name in ("claimed", "lease_taken_over"):
            key = by_scope.get((str(event.get("account")), str(event.get("key"))))
            if key is not None:
                found.append(Execution(key, str(name), pid, event.get("backend"), t))
                running[pid].append(found[-1])
        elif name in ("releasing", "released"):
            for execution in running[pid]:
                if execution.key.key != event.get("key"):
                    continue
                if name == "releasing":
                    execution.releasing = min(execution.releasing, t)
                else:
                    execution.released = min(execution.released, t)
        elif name == "request_finished":
            for execution in running.pop(pid, []):
                execution.end = t
    return found


PROBLEM = "application/problem+json"
# A claim's lease runs from the time taken just before its INSERT; its execution's start is
# recorded just after. Allow for that INSERT's duration.
LEASE_SLACK = 0.25
CHARGE_ID = re.compile(r"ch_(\d+)")


def check(
    clients: Clients,
    faults: Faults,
    charges: list[tuple[int, int, int, str, Any]],
    users: dict[str, str],
    events: list[dict[str, Any]],
    live_leases: list[tuple[str, str, Any]],
    lapsed: list[tuple[str, str]],
) -> list[Check]:
    keys, t0 = clients.keys, clients.t0
    by_scope = {(users[k.user], k.key): k for k in keys.values()}

    # 1. A key's view runs again only after its previous execution released the key (its
    #    outcome was not stored: a 504), or after a fault the soak caused — its worker killed,
    #    its database connection terminated — cut that execution mid-run and its lease lapsed.
    #    Anything else that opened the door is a violation.
    found = executions(events, by_scope)
    runs_of: dict[int, list[Execution]] = defaultdict(list)
    for execution in found:
        runs_of[execution.key.serial].append(execution)
    cut_reruns: Counter[int] = Counter()
    after_release = 0
    excused: list[str] = []
    unexcused: list[str] = []
    release_cut: list[str] = []
    for serial, runs in sorted(runs_of.items()):
        key = keys[serial]
        for n, (before, after) in enumerate(itertools.pairwise(runs), start=2):
            if before.released < after.start:
                after_release += 1
                continue
            cuts = [f.describe(t0) for f in faults.done if f.cut(before) and f.t < after.start]
            # A lease lapses no sooner than ``lease`` after its claim (renewals only extend it).
            leased = after.start < before.start + clients.lease - LEASE_SLACK
            pair = (
                f"{key.key} ({key.scenario}): execution {n} ({after.describe(t0)}) after "
                f"{n - 1} ({before.describe(t0)})"
            )
            if cuts and not leased:
                cut_reruns[serial] += 1
                excused.append(f"{pair}, cut by the {' and the '.join(cuts)}")
            elif cuts and before.end == math.inf and before.releasing < after.start:
                # Its worker was killed after it began to release the key (the ``releasing``
                # line, written just before the store's DELETE) and before the ``released``
                # line (written after it): the release went through, its event did not.
                # A re-run after a release, as above.
                after_release += 1
                release_cut.append(
                    f"{pair}: it began to release the key at +{before.releasing - t0:.3f}s, "
                    f"and the {' and the '.join(cuts)} cut its ``released`` event"
                )
            elif cuts and before.end == math.inf:
                # Killed mid-run before it began any release, and yet the key was free again
                # within its lease: its claim did not hold while the view ran (a claim rolled
                # back with a transaction the kill ended, say).
                how = "claimed afresh" if after.how == "claimed" else "taken over"
                unexcused.append(
                    f"{pair}, cut by the {' and the '.join(cuts)} before it began any release, "
                    f"and yet the key was {how} within its lease: its claim did not hold"
                )
            elif cuts:
                unexcused.append(f"{pair}, cut by the {cuts[0]} but still leased")
            else:
                on_it = ", ".join(f.describe(t0) for f in faults.done if f.hits(before)) or "none"
                unexcused.append(
                    f"{pair}, which was neither released nor cut by the soak (faults on its "
                    f"worker or connection: {on_it})"
                )
    cut = Counter(f.kind for e in found for f in faults.done if f.cut(e))
    checks = [
        Check(
            "a key runs again only after a release, or after the soak cut its execution",
            unexcused,
            f"{len(found)} executions of {len(runs_of)} keys; "
            f"{sum(len(r) > 1 for r in runs_of.values())} keys executed more than once: "
            f"{after_release} re-runs after a release (outcome not stored; "
            f"{len(release_cut)} of them after a kill that cut the release's event), "
            f"{len(excused)} excused by a fault that cut the previous execution, "
            f"{len(unexcused)} not excused (the faults cut {cut['kill']} executions by a "
            f"kill, {cut['termination']} by a termination, {cut['redis_restart']} by a Redis "
            "restart)",
            notes=release_cut + excused,
        )
    ]

    # 2. At most one charge per key, and one more per execution of it the soak cut (which may
    #    have charged before it died); none made after the key was replayed.
    charges_of: dict[int, list[tuple[int, float]]] = defaultdict(list)
    amounts: dict[int, int] = {}
    extra: list[str] = []
    for charge_id, account_id, amount, card, created in charges:
        owner = keys.get(amount // 10)
        if owner is None or users[owner.user] != str(account_id) or card != "tok_visa":
            extra.append(f"ch_{charge_id} (amount {amount}, account {account_id}) has no key")
            continue
        charges_of[owner.serial].append((charge_id, epoch(created)))
        amounts[charge_id] = amount
    twice: list[str] = []
    for serial, made in sorted(charges_of.items()):
        key = keys[serial]
        listed = f"{key.key} ({key.scenario}): " + ", ".join(f"ch_{c}" for c, _ in made)
        if len(made) > 1 + cut_reruns[serial]:
            extra.append(f"{listed}; {cut_reruns[serial]} executions cut by the soak")
        elif len(made) > 1:
            twice.append(listed)
        first_replay = min((a.received for a in key.attempts if a.replayed), default=math.inf)
        late = [c for c, created in made if created > first_replay]
        if late and len(made) > 1:
            extra.append(f"{key.key}: ch_{late[0]} was created after the key was replayed")
        if len(runs_of[serial]) < 1:
            # A charge is made inside an execution: one the soak did not record means its
            # record of executions is broken, and rule 1 above checked nothing.
            extra.append(f"{listed}: no execution of this key was recorded")
    checks.append(
        Check(
            "at most one charge per key, one more per execution of it the soak cut",
            extra,
            f"{len(charges_of)} keys charged, {sum(len(m) for m in charges_of.values())} "
            f"charges; {len(twice)} keys charged again after an execution the soak cut",
            notes=twice,
        )
    )

    # 3-5. Every answer: a 2xx names a committed charge of its own key and body (no false
    #    success); an error is problem+json; no answer means a worker kill cut the request.
    false: list[str] = []
    malformed: list[str] = []
    unexplained: list[str] = []
    statuses = Counter(a.status for k in keys.values() for a in k.attempts)
    kill_times = [f.t for f in faults.done if f.kind == "kill"]
    for key in keys.values():
        for attempt in key.attempts:
            status, data = attempt.status, attempt.json()
            where = f"{key.key} ({attempt.purpose}) {status}"
            if status is None:
                if not any(attempt.sent - 0.5 <= t <= attempt.received + 0.5 for t in kill_times):
                    unexplained.append(f"{where}: {attempt.error}")
            elif 200 <= status < 300:
                match = CHARGE_ID.fullmatch(str(data.get("id"))) if isinstance(data, dict) else None
                amount = key.amount(attempt.variant)
                if not (
                    status == 201
                    and match
                    and data.get("amount") == amount
                    and amounts.get(int(match.group(1))) == amount
                ):
                    false.append(
                        f"{where}: {attempt.body[:120]!r} is no charge of this key and body"
                    )
            elif status == 500:
                continue  # the view's own database call failed: counted, causes shown
            elif not (400 <= status < 500 or status in (503, 504)):
                malformed.append(f"{where}: status outside 2xx/4xx/503/504")
            elif not attempt.content_type.startswith(PROBLEM):
                malformed.append(f"{where}: Content-Type {attempt.content_type!r}")
            elif not isinstance(data, dict) or data.get("status") != status:
                malformed.append(f"{where}: problem body {attempt.body[:120]!r}")
            elif not isinstance(data.get("type"), str):
                malformed.append(f"{where}: problem without a type")
    causes = Counter(
        str(event.get("error")).splitlines()[0][:90]
        for event in events
        if event.get("event") == "log"
        and event.get("logger") == "django.request"
        and event.get("error")
    )
    cause = "; ".join(f"{n}x {text}" for text, n in causes.most_common(3))
    successes = sum(n for status, n in statuses.items() if status and 200 <= status < 300)
    checks += [
        Check(
            "no false success: every 2xx names a committed charge of its own key and body",
            false,
            f"{successes} answers 2xx",
        ),
        Check(
            "every error well-formed (4xx/503/504 as problem+json)",
            malformed,
            f"{statuses[500]} answers 500 (the view's own database call failed"
            f"{': ' + cause if cause else ''}), not checked",
        ),
        Check(
            "every request without an answer was cut by a worker kill",
            unexplained,
            f"{statuses[None]} requests got no answer",
        ),
    ]

    # 6. Answers consistent per key.
    inconsistent: list[str] = []
    for key in keys.values():
        inconsistent.extend(
            f"{key.key}: {text}"
            for text, excusable in key.expectations
            if not (excusable and cut_reruns[key.serial])
        )
        told = {
            str(data.get("id"))
            for a in key.attempts
            if a.status == 201 and isinstance(data := a.json(), dict)
        }
        if len(told) > 1 + cut_reruns[key.serial]:
            inconsistent.append(f"{key.key}: told {len(told)} different charges: {sorted(told)}")
    checks.append(
        Check(
            "answers consistent per key (replays, 422 mismatches, 402 replayed, 504 not stored)",
            inconsistent,
            f"{len(keys)} keys",
        )
    )

    # 7. Nothing left in progress beyond its lease once traffic stopped.
    stuck = [f"{account} {key}: lease until {until}" for account, key, until in live_leases]
    checks.append(
        Check(
            "no record left in progress beyond its lease once traffic stopped",
            stuck,
            f"{len(lapsed)} in progress with a lapsed lease (free for a retry to take over)",
        )
    )

    # 8. The soak itself: every key resolved, no client crashed.
    soak: list[str] = [f"client crashed: {crash}" for crash in clients.crashes]
    soak += [
        f"{k.key}: no definitive answer by the drain deadline" for k in keys.values() if k.abandoned
    ]
    checks.append(
        Check(
            "every key got a definitive answer before the drain deadline; no client crashed",
            soak,
            f"{sum(1 for k in keys.values() if not k.abandoned)} of {len(keys)} keys resolved",
        )
    )
    return checks


# --- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Soak the example API with faults.")
    parser.add_argument("--database", choices=tuple(DEFAULT_URLS), default="postgres")
    parser.add_argument(
        "--database-url", default=None, help="default: $SOAK_POSTGRES_URL / $SOAK_MARIADB_URL"
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="of traffic (default 60)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--kill-every", type=float, default=3.0, metavar="SECONDS")
    parser.add_argument("--terminate-every", type=float, default=4.0, metavar="SECONDS")
    parser.add_argument("--lease", type=float, default=2.0, help="EXAMPLE_LEASE_SECONDS")
    parser.add_argument("--provider-delay-ms", type=int, default=100)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--redis-url",
        default=None,
        help="run on the Redis store at this URL (EXAMPLE_REDIS_URL), e.g. "
        "redis://127.0.0.1:6379/4, or a cluster: redis+cluster://127.0.0.1:7100/0 (its "
        "records under the key prefix 'soak', deleted first); default: the database store",
    )
    parser.add_argument(
        "--redis-restart-every",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="run on a Redis store of the soak's own (port --redis-port, AOF appendfsync "
        "always) and SIGKILL and restart it about this often",
    )
    parser.add_argument("--redis-port", type=int, default=6391)
    parser.add_argument("--keep", action="store_true", help="keep the database and logs")
    parser.add_argument(
        "--hard-deadline",
        type=float,
        default=None,
        metavar="SECONDS",
        help="end everything after this long (default: --seconds + drain + 4 minutes)",
    )
    parser.add_argument(
        "--sabotage",
        nargs="?",
        const="disabled",
        choices=("disabled", "rollback"),
        default=None,
        help="plant a defect in the server to check that the invariants catch it (the soak "
        "must FAIL): 'disabled' (a bare --sabotage) switches idempotency off (IDEMPOTENCY "
        "ENABLED=False); 'rollback' runs the view in atomic mode, so that a killed worker's "
        "claim rolls back with its transaction after the view ran its provider call",
    )
    return parser.parse_args(argv)


class HardDeadline:
    """Past ``seconds``, kill everything, drop the database and exit: the soak always ends."""

    def __init__(self, seconds: float, cleanup: Callable[[], None]) -> None:
        self.cleanup = cleanup
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True
        self.seconds = seconds

    def _fire(self) -> None:
        print(f"SOAK FAILED: hard deadline of {self.seconds:.0f}s reached", flush=True)
        worker = threading.Thread(target=self.cleanup, daemon=True)
        worker.start()
        worker.join(30)
        os._exit(3)

    def __enter__(self) -> HardDeadline:
        self.timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timer.cancel()


@dataclass
class Run:
    args: argparse.Namespace
    db: Database
    seed: int
    drain: float
    work_dir: Path
    gunicorn: Server | None = None
    redis_server: StandaloneRedis | None = None
    cleaned: threading.Event = field(default_factory=threading.Event)

    def cleanup(self) -> None:
        """Stop gunicorn, drop the database (unless --keep); once, from wherever."""
        if self.cleaned.is_set():
            return
        self.cleaned.set()
        if self.gunicorn is not None:
            self.gunicorn.stop()
        if self.redis_server is not None:
            self.redis_server.stop()
        if self.args.keep:
            print(f"kept database {self.db.name} and {self.work_dir}", file=sys.stderr)
            return
        with contextlib.suppress(Exception):
            drop_database(self.db)
        shutil.rmtree(self.work_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    db = database(args.database_url or DEFAULT_URLS[args.database])
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    drain = max(20.0, 6 * args.lease)
    work_dir = Path(tempfile.mkdtemp(prefix=f"idempotency-soak-{db.name}-"))
    run = Run(args, db, seed, drain, work_dir)

    def on_signal(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    # Setup (migrations, gunicorn) takes well under a minute; the rest is bounded by design.
    hard_limit = args.hard_deadline or args.seconds + drain + args.lease + 240
    try:
        with HardDeadline(hard_limit, run.cleanup):
            return soak(run)
    except KeyboardInterrupt:
        print("SOAK INTERRUPTED", flush=True)
        return 130
    finally:
        run.cleanup()


def database_records(db: Database) -> tuple[list[Any], list[Any]]:
    """The in-progress records with a live lease, and those with a lapsed one."""
    now_sql = "now()" if db.vendor == "postgresql" else "UTC_TIMESTAMP(6)"
    key = "key" if db.vendor == "postgresql" else "`key`"
    live = query(
        db,
        f"SELECT account, {key}, lease_expires_at "
        f"FROM {RECORDS} WHERE state = 'in_progress' AND lease_expires_at > {now_sql}",
    )
    lapsed = query(
        db,
        f"SELECT account, {key} FROM {RECORDS} WHERE state = 'in_progress' AND "
        f"(lease_expires_at IS NULL OR lease_expires_at <= {now_sql})",
    )
    return live, lapsed


# The soak's records on the Redis store are under a key prefix of their own
# (EXAMPLE_REDIS_KEY_PREFIX): a shared Redis or cluster may hold other keys (a benchmark's),
# which it neither deletes nor counts.
REDIS_KEY_PREFIX = "soak"


def redis_keys(client: Any) -> list[bytes]:
    """The soak's record keys (on every master of a cluster)."""
    pattern = f"{REDIS_KEY_PREFIX}:*"
    if isinstance(client, redis_cluster.RedisCluster):
        return list(client.keys(pattern, target_nodes=redis_cluster.RedisCluster.PRIMARIES))
    return list(client.keys(pattern))


def clear_redis_records(url: str) -> None:
    """Deletes the soak's records of an earlier run, and nothing else."""
    client = redis_cluster.connect(url)
    try:
        for key in redis_keys(client):
            client.delete(key)
    finally:
        client.close()


def redis_records(url: str) -> tuple[list[Any], list[Any]]:
    """The same, from the Redis store (``store/redis.py``: a record is one key whose value
    starts ``state|token|lease_ms|expires_ms|``, the lease on Redis's clock). The scope is
    hashed into the key, so a record is named by its key."""
    client = redis_cluster.connect(url)
    live, lapsed = [], []
    try:
        seconds, micros = client.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        for key in redis_keys(client):
            value = client.get(key)
            if value is None or not value.startswith(b"i|"):
                continue
            lease = int(value.split(b"|", 3)[2])
            (live if lease > now_ms else lapsed).append(
                (key.decode(), "", datetime.datetime.fromtimestamp(lease / 1000))
            )
    finally:
        client.close()
    return live, [(name, key) for name, key, _ in lapsed]


def soak(run: Run) -> int:
    args, db = run.args, run.db
    rng = random.Random(run.seed)
    events_dir = run.work_dir / "events"
    events_dir.mkdir()
    redis_url = args.redis_url
    if args.redis_restart_every:
        run.redis_server = StandaloneRedis(args.redis_port, appendfsync="always").start()
        redis_url = run.redis_server.url
    store = {}
    if redis_url:
        clear_redis_records(redis_url)
        store = {"EXAMPLE_REDIS_URL": redis_url, "EXAMPLE_REDIS_KEY_PREFIX": REDIS_KEY_PREFIX}
    env = project_env(
        SETTINGS,
        db.url,
        EXAMPLE_PROVIDER_DELAY_MS=str(args.provider_delay_ms),
        EXAMPLE_LEASE_SECONDS=str(args.lease),
        EXAMPLE_MAX_RUN_SECONDS=str(max(30.0, 10 * args.lease)),
        SOAK_EVENTS_DIR=str(events_dir),
        SOAK_SABOTAGE=args.sabotage or "",
        **store,
    )
    where = f", Redis store at {redis_url}" if redis_url else ""
    log(f"database {db.name} ({db.vendor}){where}, seed {run.seed}")
    create_database(db)
    manage(env, "migrate", "--noinput", "-v", "0")
    users = {name: str(pk) for pk, name in query(db, "SELECT id, username FROM auth_user")}
    run.gunicorn = gunicorn = spawn_gunicorn(
        env, run.work_dir / "gunicorn.log", workers=args.workers
    )
    credentials = base64.b64encode(b"alice:alice").decode()
    gunicorn.wait_ready("/charges/", {"Authorization": f"Basic {credentials}"})
    version = server_version(db).split(" on ")[0].split(",")[0]
    log(
        f"gunicorn with {args.workers} workers on port {gunicorn.port}; "
        f"{args.seconds:.0f}s of traffic from {args.clients} clients"
    )

    started = time.monotonic()
    traffic_end = started + args.seconds
    clients = Clients(
        gunicorn.port,
        run_id=f"{run.seed:x}",
        traffic_end=traffic_end,
        drain_end=traffic_end + run.drain,
        lease=args.lease,
    )
    faults = Faults()
    stop = threading.Event()
    injector = threading.Thread(
        target=inject_faults,
        args=(
            gunicorn,
            db,
            traffic_end,
            args.kill_every,
            args.terminate_every,
            stop,
            faults,
            random.Random(rng.random()),
            run.redis_server,
            args.redis_restart_every,
        ),
        daemon=True,
    )
    threads = [
        threading.Thread(target=clients.client, args=(rng.randrange(1 << 30),), daemon=True)
        for _ in range(args.clients)
    ]
    injector.start()
    for thread in threads:
        thread.start()
    injector.join(args.seconds + 30)
    stop.set()
    log(
        f"traffic stopped: {faults.count('kill')} workers killed, "
        f"{faults.count('termination')} database connections terminated, "
        f"{faults.count('redis_restart')} Redis restarts; "
        "draining (clients finish their keys)"
    )
    for thread in threads:
        thread.join(max(0.0, traffic_end + run.drain + HTTP_TIMEOUT + 5 - time.monotonic()))
    still_running = sum(thread.is_alive() for thread in threads)
    # Every request has ended: after one lease, no record may still hold a live lease.
    time.sleep(args.lease + 1.0)
    if redis_url:
        live, lapsed = redis_records(redis_url)
    else:
        live, lapsed = database_records(db)
    charges = query(
        db, "SELECT id, account_id, amount, card, created_at FROM payments_charge ORDER BY id"
    )
    events = read_events(events_dir)
    checks = check(
        clients,
        faults,
        [(int(a), int(b), int(c), str(d), e) for a, b, c, d, e in charges],
        users,
        events,
        [(str(a), str(b), c) for a, b, c in live],
        [(str(a), str(b)) for a, b in lapsed],
    )
    if still_running:
        checks.append(
            Check("every client finished", [f"{still_running} clients still running"], "")
        )
    if faults.errors:
        log(f"fault injector errors: {faults.errors[:3]}")

    # -- the report
    attempts = [a for k in clients.keys.values() for a in k.attempts]
    statuses = Counter("no answer" if a.status is None else str(a.status) for a in attempts)
    own = ("log", "ready", "request_finished")  # the soak's own events, not signals
    event_counts = Counter(str(e.get("event")) for e in events if e.get("event") not in own)
    libraries = sorted({str(e.get("library")) for e in events if e.get("event") == "ready"})
    warnings = Counter(
        str(e.get("message"))[:80]
        for e in events
        if e.get("event") == "log" and e.get("logger") == "idempotency_django"
    )
    scenarios = Counter(k.scenario for k in clients.keys.values())
    print(
        f"Soak: {version}, {args.seconds:.0f}s of traffic, gunicorn {args.workers} sync workers, "
        f"{args.clients} clients, lease {args.lease:g}s, provider delay "
        f"{args.provider_delay_ms} ms, seed {run.seed}"
    )
    print(f"server: idempotency_django from {', '.join(libraries) or '(no worker reported)'}")
    print(
        f"traffic: {len(clients.keys)} keys ("
        + ", ".join(f"{name} {n}" for name, n in scenarios.most_common())
        + f"), {len(attempts)} requests"
    )
    print("answers: " + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items())))
    print(
        f"faults: {faults.count('kill')} workers SIGKILLed, {faults.rounds} rounds of "
        f"connection terminations ({faults.count('termination')} connections), "
        f"{faults.count('redis_restart')} Redis restarts"
    )
    print("server signals: " + ", ".join(f"{e} {n}" for e, n in sorted(event_counts.items())))
    if warnings:
        print("server warnings: " + "; ".join(f"{n}x {m}" for m, n in warnings.most_common(6)))
    print("invariants:")
    failed = 0
    for item in checks:
        print(f"  {'PASS' if item.ok else 'FAIL'}  {item.name}: {item.summary}")
        for note in item.notes[:10]:
            print(f"        . {note}")
        if len(item.notes) > 10:
            print(f"        . ... and {len(item.notes) - 10} more")
        if not item.ok:
            failed += len(item.violations)
            print(f"        {len(item.violations)} violations:")
            for violation in item.violations[:10]:
                print(f"        - {violation}")
    print(f"result: {'PASS' if not failed else 'FAIL'} ({failed} violations)", flush=True)
    if failed:
        tail = gunicorn.log()[-3000:]
        print(f"--- the end of the gunicorn log ---\n{tail}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
