#!/usr/bin/env python
"""Soak the example payments API with faults, then check that no key charged twice.

    python benchmarks/soak.py --database postgres --seconds 60
    python benchmarks/soak.py --database mariadb --seconds 60
    python benchmarks/soak.py --seconds 10          # the CI version (PostgreSQL)

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
app that records the server's idempotency signals and warnings (``soakproject/events.py``).

It always ends: a hard deadline kills gunicorn, drops the database and exits (code 3).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import http.client
import json
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

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import common  # noqa: E402

SETTINGS = "benchmarks.soakproject.settings"
ENDPOINT = "POST /charges/"
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
    # Broken expectations: (what, excused when the key's lease was taken over). A claim that
    # never completed (its worker killed, or its completion not written) is run again by a
    # retry after its lease: that retry's answer is new, not a replay.
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


@dataclass
class Faults:
    kills: list[tuple[float, int]] = field(default_factory=list)  # (time.time(), pid)
    terminations: list[tuple[float, int]] = field(default_factory=list)  # (time, how many)
    errors: list[str] = field(default_factory=list)


def inject_faults(
    gunicorn: common.Gunicorn,
    db: common.Database,
    until: float,
    kill_every: float,
    terminate_every: float,
    stop: threading.Event,
    faults: Faults,
    rng: random.Random,
) -> None:
    """SIGKILL a random worker about every ``kill_every`` s and terminate some of the
    workers' database connections about every ``terminate_every`` s, until ``until``."""
    now = time.monotonic()
    next_kill = now + kill_every * rng.uniform(0.5, 1.5)
    next_term = now + terminate_every * rng.uniform(0.5, 1.5)
    connection = None
    while not stop.is_set():
        now = time.monotonic()
        if now >= until:
            break
        if now >= next_kill:
            next_kill = now + kill_every * rng.uniform(0.5, 1.5)
            pids = gunicorn.worker_pids()
            if pids:
                pid = rng.choice(pids)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    faults.kills.append((time.time(), pid))
        if now >= next_term:
            next_term = now + terminate_every * rng.uniform(0.5, 1.5)
            try:
                if connection is None:
                    # On the server, outside the soak's database: never a target itself.
                    connection = common.connect(db, server_only=True)
                count = _terminate(connection, db, rng)
                faults.terminations.append((time.time(), count))
            except Exception as exc:
                faults.errors.append(f"{type(exc).__name__}: {exc}")
                with contextlib.suppress(Exception):
                    if connection is not None:
                        connection.close()
                connection = None
        stop.wait(max(0.0, min(next_kill, next_term, until) - time.monotonic()))
    if connection is not None:
        with contextlib.suppress(Exception):
            connection.close()


def _terminate(connection: Any, db: common.Database, rng: random.Random) -> int:
    """Terminate a random half (at least one) of the connections to the soak database."""
    cursor = connection.cursor()
    if db.vendor == "postgresql":
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (db.name,),
        )
    else:
        cursor.execute(
            "SELECT id FROM information_schema.processlist WHERE db = %s AND id <> CONNECTION_ID()",
            (db.name,),
        )
    ids = [int(row[0]) for row in cursor.fetchall()]
    chosen = [i for i in ids if rng.random() < 0.5] or ids[:1]
    done = 0
    for ident in chosen:
        try:
            if db.vendor == "postgresql":
                cursor.execute("SELECT pg_terminate_backend(%s)", (ident,))
            else:
                cursor.execute(f"KILL CONNECTION {ident}")
            done += 1
        except Exception:  # it ended on its own in the meantime
            continue
    return done


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
    return events


PROBLEM = "application/problem+json"


def check(
    clients: Clients,
    faults: Faults,
    charges: list[tuple[int, int, int, str, Any]],
    users: dict[str, str],
    events: list[dict[str, Any]],
    live_leases: list[tuple[str, str, Any]],
    lapsed: list[tuple[str, str]],
) -> list[Check]:
    keys = clients.keys
    by_scope = {(users[k.user], k.key): k for k in keys.values()}
    takeovers: Counter[int] = Counter()
    for event in events:
        if event.get("event") == "lease_taken_over":
            key = by_scope.get((str(event.get("account")), str(event.get("key"))))
            if key is not None:
                takeovers[key.serial] += 1

    # Every charge, by key; every charge id that some client was told about.
    charges_of: dict[int, list[tuple[int, float]]] = defaultdict(list)
    stray: list[str] = []
    for charge_id, account_id, amount, card, created in charges:
        serial = amount // 10
        key = keys.get(serial)
        if key is None or users[key.user] != str(account_id) or card != "tok_visa":
            stray.append(
                f"charge ch_{charge_id} (amount {amount}, account {account_id}) has no key"
            )
            continue
        charges_of[serial].append((charge_id, epoch(created)))
    delivered: set[int] = set()
    for key in keys.values():
        for attempt in key.attempts:
            if attempt.status == 201:
                data = attempt.json()
                match = re.fullmatch(r"ch_(\d+)", str(data.get("id"))) if data else None
                if match:
                    delivered.add(int(match.group(1)))

    # 1. At most one charge per key; one more only after a lapsed lease was taken over.
    one: list[str] = list(stray)
    second = 0
    twice: list[str] = []
    for serial, made in sorted(charges_of.items()):
        key = keys[serial]
        replays = [a.received for a in key.attempts if a.replayed]
        first_replay = min(replays, default=float("inf"))
        if len(made) > 1:
            allowed = min(2, 1 + takeovers[serial])
            if len(made) > allowed:
                one.append(
                    f"{key.key}: {len(made)} charges "
                    f"({', '.join(f'ch_{c}' for c, _ in made)}), {takeovers[serial]} takeovers"
                )
            else:
                second += 1
            cut = [a for a in key.attempts if a.status is None]
            twice.append(
                f"{key.key} ({key.scenario}): "
                + ", ".join(f"ch_{c}" for c, _ in made)
                + f"; {takeovers[serial]} take-over(s); {len(cut)} attempt(s) cut by a kill"
            )
        late = [c for c, created in made if created > first_replay]
        if late and len(made) > 1:
            one.append(f"{key.key}: ch_{late[0]} was created after the key was replayed")
    checks = [
        Check(
            "at most one charge per key (one more only after a lapsed lease was taken over)",
            one,
            f"{len(charges_of)} keys charged, {sum(len(m) for m in charges_of.values())} "
            f"charges; {second} keys charged twice after a take-over of a claim that never "
            f"completed; {sum(takeovers.values())} take-overs in all",
            notes=twice,
        )
    ]

    # 2. Well-formed answers; 500s checked apart.
    malformed: list[str] = []
    answers = 0
    fivehundreds: list[Attempt] = []
    for key in keys.values():
        for attempt in key.attempts:
            if attempt.status is None:
                continue
            answers += 1
            status = attempt.status
            where = f"{key.key} ({attempt.purpose}) {status}"
            if status == 500:
                fivehundreds.append(attempt)
                continue
            if not (200 <= status < 300 or 400 <= status < 500 or status in (503, 504)):
                malformed.append(f"{where}: status outside 2xx/4xx/503/504")
                continue
            data = attempt.json()
            if status >= 400:
                if not attempt.content_type.startswith(PROBLEM):
                    malformed.append(f"{where}: Content-Type {attempt.content_type!r}")
                elif not isinstance(data, dict) or data.get("status") != status:
                    malformed.append(f"{where}: problem body {attempt.body[:120]!r}")
                elif not isinstance(data.get("type"), str):
                    malformed.append(f"{where}: problem without a type")
            elif status == 201:
                amount = key.amount(attempt.variant)
                if not isinstance(data, dict) or data.get("amount") != amount:
                    malformed.append(f"{where}: body {attempt.body[:120]!r} is not its charge")
                    continue
                match = re.fullmatch(r"ch_(\d+)", str(data.get("id")))
                own = {c for c, _ in charges_of.get(key.serial, [])}
                if match is None or int(match.group(1)) not in own:
                    malformed.append(f"{where}: {data.get('id')} is not a charge of this key")
            else:
                malformed.append(f"{where}: unexpected success status")
    checks.append(
        Check(
            "every answer well-formed (2xx/4xx/503/504, errors as problem+json)",
            malformed,
            f"{answers - len(fivehundreds)} answers checked",
        )
    )

    # 3. 500s: none may have lost a charge's response (a charge made while it ran that no
    #    client was ever told about, on a key that was neither released nor completed) —
    #    except where the server kept the key claimed because the view's database connection
    #    died mid-write: that outcome is unknown, exactly as a killed worker's, and is
    #    counted with the take-overs of invariant 1 (one more charge at most, after the
    #    lease). Such keys are reported here, not hidden.
    kept = {
        str(event.get("key"))
        for event in events
        if event.get("event") == "log"
        and str(event.get("message", "")).startswith("Idempotency key kept")
    }
    lost: list[str] = []
    unknown: list[str] = []
    for serial in {attempt.serial for attempt in fivehundreds}:
        key = keys[serial]
        for charge_id, created in charges_of.get(serial, []):
            if charge_id in delivered:
                continue
            # The attempts without a proper answer that were running when this charge was
            # made: if one of them was cut by a worker kill, that explains the lost response;
            # if they were all 500s, a 500 lost it.
            suspects = [
                a
                for a in key.attempts
                if a.status in (None, 500) and a.sent - 0.5 <= created <= a.received + 0.5
            ]
            if suspects and all(a.status == 500 for a in suspects):
                if key.key in kept:
                    unknown.append(f"{key.key}: ch_{charge_id}")
                else:
                    lost.append(f"{key.key}: ch_{charge_id} made during a 500, never delivered")
    causes = Counter(
        str(event.get("error")).splitlines()[0][:90]
        for event in events
        if event.get("event") == "log"
        and event.get("logger") == "django.request"
        and event.get("error")
    )
    cause = "; ".join(f"{n}x {text}" for text, n in causes.most_common(3))
    checks.append(
        Check(
            "no 500 lost a charge's response without releasing or completing the key",
            lost,
            f"{len(fivehundreds)} answers were 500 (the view's own database call failed"
            f"{': ' + cause if cause else ''}); {len(unknown)} of them lost their database "
            "connection mid-write and kept the key claimed, as a crash would"
            f"{' (' + ', '.join(unknown[:3]) + ')' if unknown else ''}",
        )
    )

    # 4. Every request without an answer was cut by a worker kill.
    unexplained: list[str] = []
    dropped = 0
    kill_times = [t for t, _ in faults.kills]
    for key in keys.values():
        for attempt in key.attempts:
            if attempt.status is not None:
                continue
            dropped += 1
            if not any(attempt.sent - 0.5 <= t <= attempt.received + 0.5 for t in kill_times):
                unexplained.append(f"{key.key} ({attempt.purpose}): {attempt.error}")
    checks.append(
        Check(
            "every request without an answer was cut by a worker kill",
            unexplained,
            f"{dropped} requests got no answer",
        )
    )

    # 5. Answers consistent per key.
    inconsistent: list[str] = []
    for key in keys.values():
        inconsistent.extend(
            f"{key.key}: {text}"
            for text, excusable in key.expectations
            if not (excusable and takeovers[key.serial])
        )
        ids: set[str] = set()
        for attempt in key.attempts:
            data = attempt.json() if attempt.status == 201 else None
            if isinstance(data, dict):
                ids.add(str(data.get("id")))
        if len(ids) > 1 + takeovers[key.serial]:
            inconsistent.append(f"{key.key}: told {len(ids)} different charges: {sorted(ids)}")
    checks.append(
        Check(
            "answers consistent per key (replays, 422 mismatches, 402 replayed, 504 not stored)",
            inconsistent,
            f"{len(keys)} keys",
        )
    )

    # 6. Nothing left in progress beyond its lease once traffic stopped.
    stuck = [f"{account} {key}: lease until {until}" for account, key, until in live_leases]
    checks.append(
        Check(
            "no record left in progress beyond its lease once traffic stopped",
            stuck,
            f"{len(lapsed)} in progress with a lapsed lease (free for a retry to take over)",
        )
    )

    # 7. The soak itself: every key resolved, no client crashed.
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
        action="store_true",
        help="switch idempotency off in the server (IDEMPOTENCY ENABLED=False) to check "
        "that the invariants catch it: the soak must FAIL",
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
    db: common.Database
    seed: int
    drain: float
    work_dir: Path
    gunicorn: common.Gunicorn | None = None
    cleaned: threading.Event = field(default_factory=threading.Event)

    def cleanup(self) -> None:
        """Stop gunicorn, drop the database (unless --keep); once, from wherever."""
        if self.cleaned.is_set():
            return
        self.cleaned.set()
        if self.gunicorn is not None:
            self.gunicorn.stop()
        if self.args.keep:
            print(f"kept database {self.db.name} and {self.work_dir}", file=sys.stderr)
            return
        with contextlib.suppress(Exception):
            common.drop_database(self.db)
        shutil.rmtree(self.work_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    db = common.database(args.database_url or DEFAULT_URLS[args.database])
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


def soak(run: Run) -> int:
    args, db = run.args, run.db
    rng = random.Random(run.seed)
    events_dir = run.work_dir / "events"
    events_dir.mkdir()
    env = common.project_env(
        SETTINGS,
        db,
        EXAMPLE_PROVIDER_DELAY_MS=str(args.provider_delay_ms),
        EXAMPLE_LEASE_SECONDS=str(args.lease),
        EXAMPLE_MAX_RUN_SECONDS=str(max(30.0, 10 * args.lease)),
        SOAK_EVENTS_DIR=str(events_dir),
        SOAK_SABOTAGE="1" if args.sabotage else "0",
    )
    log(f"database {db.name} ({db.vendor}), seed {run.seed}")
    common.create_database(db)
    common.manage(env, "migrate", "--noinput", "-v", "0")
    users = {name: str(pk) for pk, name in common.query(db, "SELECT id, username FROM auth_user")}
    run.gunicorn = gunicorn = common.start_gunicorn(
        env, workers=args.workers, log_path=run.work_dir / "gunicorn.log"
    )
    credentials = base64.b64encode(b"alice:alice").decode()
    gunicorn.wait_ready("/charges/", {"Authorization": f"Basic {credentials}"})
    version = common.server_version(db).split(" on ")[0].split(",")[0]
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
        f"traffic stopped: {len(faults.kills)} workers killed, "
        f"{sum(n for _, n in faults.terminations)} database connections terminated; "
        "draining (clients finish their keys)"
    )
    for thread in threads:
        thread.join(max(0.0, traffic_end + run.drain + HTTP_TIMEOUT + 5 - time.monotonic()))
    still_running = sum(thread.is_alive() for thread in threads)
    # Every request has ended: after one lease, no record may still hold a live lease.
    time.sleep(args.lease + 1.0)
    now_sql = "now()" if db.vendor == "postgresql" else "UTC_TIMESTAMP(6)"
    live = common.query(
        db,
        f"SELECT account, {'key' if db.vendor == 'postgresql' else '`key`'}, lease_expires_at "
        f"FROM {RECORDS} WHERE state = 'in_progress' AND lease_expires_at > {now_sql}",
    )
    lapsed = common.query(
        db,
        f"SELECT account, {'key' if db.vendor == 'postgresql' else '`key`'} FROM {RECORDS} "
        f"WHERE state = 'in_progress' AND (lease_expires_at IS NULL "
        f"OR lease_expires_at <= {now_sql})",
    )
    charges = common.query(
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
    event_counts = Counter(str(e.get("event")) for e in events if e.get("event") != "log")
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
    print(
        f"traffic: {len(clients.keys)} keys ("
        + ", ".join(f"{name} {n}" for name, n in scenarios.most_common())
        + f"), {len(attempts)} requests"
    )
    print("answers: " + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items())))
    print(
        f"faults: {len(faults.kills)} workers SIGKILLed, {len(faults.terminations)} rounds of "
        f"connection terminations ({sum(n for _, n in faults.terminations)} connections)"
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
