#!/usr/bin/env python
"""Benchmark idempotency_django against a bare view and its peers: one table of ratios.

    python -m benchmarks.run                        # PostgreSQL, full run (about 10 minutes)
    python -m benchmarks.run --database mariadb     # the same on MariaDB
    python -m benchmarks.run --quick                # a short smoke (small tables, 2 s rounds)
    python -m benchmarks.run --write-results        # also record the table in RESULTS.md

Every server is the example project under gunicorn (sync workers, persistent database
connections) on the same database, serving the same view: a charge, one ``INSERT``. Ours
wraps it in ``@idempotent``, on the database store, on the Redis store (a Redis at
``--redis-url``, database 11 by default, keys under a prefix of this run's own) and on a
Redis Cluster of the run's own (``tools/redis_cluster.py`` on ports 7200-7205, started and
stopped by the run); the peers (``requirements-peers.txt``, installed into a directory of
the benchmark's own) protect it with their middleware, each wired as its README says
(``benchproject/settings_dik.py``, ``settings_drf.py``). A second view has the shape most
projects run: a DRF ``APIView`` with ``TokenAuthentication`` (a ``SELECT`` per request),
bare, behind ``IdempotentMixin`` on each store, and behind the peers; its rows are ratios
to that view bare. ``wrk`` (or ``loadgen.py``) drives one scenario at a time, in
interleaved rounds; every comparison is a ratio of two numbers of this run. Then
``purge_idempotency_keys`` deletes the large table's expired records while an open-loop
probe measures claim latency.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import common
from benchmarks.loadgen import percentile
from tools.server import (
    Database,
    Server,
    create_database,
    database,
    drop_database,
    manage,
    project_env,
    query,
    server_version,
    spawn_gunicorn,
)

REPO_ROOT = Path(__file__).resolve().parents[1]

HERE = Path(__file__).resolve().parent
USER = "alice"
BODY = json.dumps({"amount": 1000, "currency": "EUR", "card": "tok_visa"})
REPLAY_KEY = "bench-replay-key"  # + the scenario's name: drf-idempotency's keys have no scope
TABLE = "idempotency_django_idempotencyrecord"
RESULTS = HERE / "RESULTS.md"
RESULTS_START = "<!-- benchmark-results:start -->"
RESULTS_END = "<!-- benchmark-results:end -->"
PEER_REQUIREMENTS = HERE / "requirements-peers.txt"
DEFAULT_URLS = {
    "postgres": os.environ.get("BENCH_DATABASE_URL", "postgres://root@127.0.0.1:5432/bench"),
    "mariadb": os.environ.get("BENCH_MARIADB_URL", "mysql://root@127.0.0.1:3306/bench"),
}

# The first performance targets (benchmarks/README.md, "Targets"), printed as PASS/FAIL
# lines (never a timed test).
TARGET_REPLAY = 1.5  # x bare
TARGET_REPLAY_PEER = 0.8  # x the faster peer's replays
TARGET_COMMIT = 0.60  # x bare, and above every peer's first-time keys
TARGET_ATOMIC = 0.70
TARGET_GROWTH = 0.9  # the large table's claims over the small one's
TARGET_PURGE_ROWS = 20_000  # rows/s, on PostgreSQL
TARGET_PURGE_P99 = 2.0  # claim p99 during the purge over p99 without it
# The second round's targets: the Redis store, and the DRF view with token auth.
TARGET_REDIS_COMMIT = 0.80  # x bare, first-time keys on the Redis store
TARGET_API_REDIS_REPLAY = 1.3  # x the DRF view bare, replays on the Redis store
TARGET_API_REPLAY = 1.2  # x the DRF view bare, replays on the database store
REDIS_URL = os.environ.get("BENCH_STORE_REDIS_URL", "redis://127.0.0.1:6379/11")
CLUSTER_PORT = 7200  # the run's own cluster: 7200-7205, never the shared one on 7100


# --- what runs: servers and scenarios -------------------------------------------------------


@dataclass(frozen=True)
class ServerSpec:
    """One gunicorn: its settings, its table (``small`` or ``large``), and whether it needs
    the peers' directory on its path."""

    settings: str
    table: str = "small"
    peer: bool = False
    postgres_only: bool = False
    env: tuple[tuple[str, str], ...] = ()
    redis: str = ""  # "single" or "cluster": ours on the Redis store (EXAMPLE_REDIS_URL)


SERVERS = {
    "ours": ServerSpec("benchmarks.benchproject.settings"),
    "large": ServerSpec("benchmarks.benchproject.settings", table="large"),
    # Ours with Django's default of no prepared statements (docs/store.md "PostgreSQL: prepared
    # statements"): what a project that cannot turn them on gets.
    "unprepared": ServerSpec(
        "benchmarks.benchproject.settings",
        postgres_only=True,
        env=(("EXAMPLE_PG_PREPARE_THRESHOLD", "off"),),
    ),
    # Ours on the Redis store: a single Redis, and the run's own Redis Cluster.
    "redis": ServerSpec("benchmarks.benchproject.settings", redis="single"),
    "cluster": ServerSpec("benchmarks.benchproject.settings", redis="cluster"),
    "dik": ServerSpec("benchmarks.benchproject.settings_dik", peer=True),
    "drf": ServerSpec("benchmarks.benchproject.settings_drf", peer=True),
}

# What each peer does not do that we do: printed next to its numbers, so that the
# comparison stays honest (from their source; see benchmarks/README.md).
SKIPS = {
    "dik": "runs the view before it stores anything (no claim: concurrent duplicates both "
    "run); no account scope; no fingerprint (another body is another key); a cache "
    "(Redis) entry, no database record; replays from middleware before view auth",
    "drf": "no account scope (one key for every caller); replays from middleware before "
    "view auth (DRF's authentication, permissions); a fixed 30 s lock, never renewed, "
    "completion not fenced; raw-body fingerprint",
}


@dataclass(frozen=True)
class Scenario:
    name: str
    label: str
    server: str
    path: str
    replay: bool = False  # one fixed key, every request after the first a replay
    base: str = "bare"  # the scenario its ratio is to
    peer: str = ""  # the SKIPS entry its row points to
    token: bool = False  # sends DRF's "Authorization: Token …" (the DRF view)

    @property
    def key(self) -> str | None:
        """The replays' one key (a key of its own per scenario), else ``None`` (new keys)."""
        return f"{REPLAY_KEY}-{self.name}" if self.replay else None


SCENARIOS = (
    Scenario("null", "no-op view, no database (reference)", "ours", "/bench/null/"),
    Scenario("bare", "bare view, one INSERT (the baseline)", "ours", "/bench/bare/"),
    Scenario("commit", "idempotency_django, new keys, commit mode", "ours", "/bench/commit/"),
    Scenario("atomic", "idempotency_django, new keys, atomic mode", "ours", "/bench/atomic/"),
    Scenario("replay", "idempotency_django, replays", "ours", "/bench/commit/", replay=True),
    Scenario("redis", "idempotency_django, new keys, Redis store", "redis", "/bench/commit/"),
    Scenario(
        "redis-replay", "idempotency_django, replays, Redis store", "redis", "/bench/commit/",
        True,
    ),
    Scenario(
        "cluster", "idempotency_django, new keys, Redis Cluster", "cluster", "/bench/commit/",
    ),
    Scenario(
        "cluster-replay", "idempotency_django, replays, Redis Cluster", "cluster",
        "/bench/commit/", True,
    ),
    Scenario(
        "commit-unprepared", "idempotency_django, new keys, commit, unprepared (c)",
        "unprepared", "/bench/commit/",
    ),
    Scenario(
        "replay-unprepared", "idempotency_django, replays, unprepared (c)", "unprepared",
        "/bench/commit/", True,
    ),
    Scenario("dik", "django-idempotency-key 1.3.0, new keys", "dik", "/bench/bare/", peer="dik"),
    Scenario(
        "dik-replay", "django-idempotency-key 1.3.0, replays", "dik", "/bench/bare/", True,
        peer="dik",
    ),
    Scenario("drf", "drf-idempotency 1.0.0, new keys", "drf", "/bench/bare/", peer="drf"),
    Scenario(
        "drf-replay", "drf-idempotency 1.0.0, replays", "drf", "/bench/bare/", True,
        peer="drf",
    ),
    Scenario(
        "large", "idempotency_django, new keys, large table", "large", "/bench/commit/",
        base="commit",
    ),
    # The DRF view with TokenAuthentication (benchproject/drf_views.py): its own baseline.
    Scenario(
        "api-bare", "DRF APIView, token auth (the DRF baseline)", "ours", "/bench/drf/bare/",
        base="api-bare", token=True,
    ),
    Scenario(
        "api-commit", "DRF + IdempotentMixin, new keys, database", "ours",
        "/bench/drf/protected/", base="api-bare", token=True,
    ),
    Scenario(
        "api-replay", "DRF + IdempotentMixin, replays, database", "ours",
        "/bench/drf/protected/", True, base="api-bare", token=True,
    ),
    Scenario(
        "api-redis", "DRF + IdempotentMixin, new keys, Redis store", "redis",
        "/bench/drf/protected/", base="api-bare", token=True,
    ),
    Scenario(
        "api-redis-replay", "DRF + IdempotentMixin, replays, Redis store", "redis",
        "/bench/drf/protected/", True, base="api-bare", token=True,
    ),
    Scenario(
        "api-dik", "DRF, django-idempotency-key 1.3.0, new keys", "dik", "/bench/drf/bare/",
        base="api-bare", peer="dik", token=True,
    ),
    Scenario(
        "api-dik-replay", "DRF, django-idempotency-key 1.3.0, replays", "dik",
        "/bench/drf/bare/", True, base="api-bare", peer="dik", token=True,
    ),
    Scenario(
        "api-drf", "DRF, drf-idempotency 1.0.0, new keys", "drf", "/bench/drf/bare/",
        base="api-bare", peer="drf", token=True,
    ),
    Scenario(
        "api-drf-replay", "DRF, drf-idempotency 1.0.0, replays", "drf", "/bench/drf/bare/",
        True, base="api-bare", peer="drf", token=True,
    ),
)  # fmt: skip
PEER_SCENARIOS = {
    "dik", "dik-replay", "drf", "drf-replay", "api-dik", "api-dik-replay", "api-drf",
    "api-drf-replay",
}  # fmt: skip
MARKS = {"dik": "a", "drf": "b"}  # a peer's rows point to its SKIPS line


# --- the peers' own environment -------------------------------------------------------------


def peers_directory(cache: Path) -> Path:
    """``requirements-peers.txt`` installed with ``pip --no-deps --target`` into a directory
    named by its hash (so a changed pin installs afresh); the peers' servers import from it,
    nothing else does."""
    pins = PEER_REQUIREMENTS.read_bytes()
    target = cache / f"peers-{hashlib.sha256(pins).hexdigest()[:12]}"
    if (target / ".installed").exists():
        return target
    shutil.rmtree(target, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    command += ["--no-deps", "--target", str(target), "-r", str(PEER_REQUIREMENTS)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"installing the peers failed:\n{result.stdout}\n{result.stderr}")
    (target / ".installed").write_bytes(pins)
    return target


# --- load -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    requests: int
    seconds: float
    errors: int
    p50: float
    p99: float


def run_load(
    generator: str, url: str, key: str | None, seconds: int, connections: int, token: str = ""
) -> Load:
    """Closed-loop load for ``seconds`` from a process of its own: new keys, or ``key``;
    with ``token``, DRF's ``Authorization: Token`` header."""
    if generator == "wrk":
        mode = f"fixed:{key}" if key else "new"
        command = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", "10s"]
        command += ["-s", str(HERE / "wrk" / "post.lua"), url, "--", USER, mode, BODY]
        command += [token] if token else []
        output = _run(command, timeout=seconds + 60)
        line = next((ln for ln in output.splitlines() if ln.startswith("BENCH-JSON ")), None)
        if line is None:
            raise RuntimeError(f"wrk printed no result:\n{output}")
        data = json.loads(line.split(" ", 1)[1])
        kinds = ("connect_errors", "read_errors", "write_errors", "status_errors", "timeouts")
        return Load(
            requests=int(data["requests"]),
            seconds=data["duration_us"] / 1e6,
            errors=sum(int(data[kind]) for kind in kinds),
            p50=data["p50_us"] / 1e6,
            p99=data["p99_us"] / 1e6,
        )
    command = [sys.executable, str(HERE / "loadgen.py"), "--url", url, "--user", USER]
    command += ["--body", BODY, "--duration", str(seconds), "--concurrency", str(connections)]
    command += ["--key", key] if key else []
    command += ["--token", token] if token else []
    data = json.loads(_run(command, timeout=seconds + 60))
    ok = sum(n for status, n in data["statuses"].items() if status.startswith("2"))
    return Load(
        requests=int(data["requests"]),
        seconds=float(data["duration"]),
        errors=int(data["requests"]) - ok,
        p50=float(data["p50"]),
        p99=float(data["p99"]),
    )


def _run(command: Sequence[str], timeout: float) -> str:
    result = subprocess.run(
        list(command), capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"{command[0]} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result.stdout


@dataclass
class Measure:
    """One scenario's requests and seconds, summed over its rounds."""

    requests: int = 0
    seconds: float = 0.0
    errors: int = 0
    p50: list[float] = field(default_factory=list)  # per round, seconds
    p99: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else float("nan")

    def add(self, load: Load) -> None:
        self.requests += load.requests
        self.seconds += load.seconds
        self.errors += load.errors
        self.p50.append(load.p50)
        self.p99.append(load.p99)


# --- the tables -----------------------------------------------------------------------------

_HEADERS = '[["Content-Type", "application/json"], ["Location", "/charges/ch_1"]]'
_SEED_COLUMNS = (
    "account, endpoint, {key}, fingerprint, state, token, lease_expires_at, response_status, "
    "response_headers, response_body, created_at, completed_at, expires_at"
)
SEED_POSTGRES = f"""
INSERT INTO {TABLE} ({_SEED_COLUMNS.format(key="key")})
SELECT (1000 + g %% 5000)::text, 'POST /bench/commit/',
       substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-' || substr(h, 13, 4) || '-'
         || substr(h, 17, 4) || '-' || substr(h, 21, 12),
       h || reverse(h), 'completed', reverse(h), NULL, 201, '{_HEADERS}'::jsonb,
       convert_to('{{"id": "ch_' || g || '", "amount": 1000, "currency": "EUR", '
                  || '"status": "succeeded"}}', 'UTF8'),
       ts, ts, ts + interval '1 day'
FROM (SELECT g, md5('seed-' || g) AS h,
             now() - interval '3 days' + g * (interval '1 day' / %(records)s) AS ts
      FROM generate_series(1, %(records)s) AS g) AS seed
"""
SEED_MARIADB = f"""
INSERT INTO {TABLE} ({_SEED_COLUMNS.format(key="`key`")})
SELECT CAST(1000 + g %% 5000 AS CHAR), 'POST /bench/commit/',
       CONCAT_WS('-', SUBSTR(h, 1, 8), SUBSTR(h, 9, 4), SUBSTR(h, 13, 4), SUBSTR(h, 17, 4),
                 SUBSTR(h, 21, 12)),
       CONCAT(h, REVERSE(h)), 'completed', REVERSE(h), NULL, 201, '{_HEADERS}',
       CONCAT('{{"id": "ch_', g, '", "amount": 1000, "currency": "EUR", "status": "succeeded"}}'),
       ts, ts, ts + INTERVAL 1 DAY
FROM (SELECT seq AS g, MD5(CONCAT('seed-', seq)) AS h,
             UTC_TIMESTAMP(6) - INTERVAL 3 DAY
               + INTERVAL FLOOR(seq * 86400000000 / %(records)s) MICROSECOND AS ts
      FROM seq_1_to_{{records}}) AS seed
"""


def seed(db: Database, records: int) -> None:
    """``records`` completed, *expired* records of the shape of real ones, by server-side
    SQL: random UUID-like keys over 5,000 accounts, a stored ``201`` body, created one after
    the other over a day (the heap in ``expires_at`` order, as in a real table), all expired
    a day ago or more. On PostgreSQL the secondary indexes are dropped first and rebuilt
    after (much faster than as many random inserts into them), then ``VACUUM ANALYZE``."""
    if db.vendor == "mysql":
        query(db, SEED_MARIADB.replace("{records}", str(int(records))), {"records": records})
        query(db, f"ANALYZE TABLE {TABLE}")
        return
    constraints = query(
        db,
        "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE conrelid = %s::regclass AND contype = 'u'",
        (TABLE,),
    )
    indexes = query(
        db,
        "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s AND indexname "
        "NOT IN (SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass)",
        (TABLE, TABLE),
    )
    statements = [f'ALTER TABLE {TABLE} DROP CONSTRAINT "{name}"' for name, _ in constraints]
    statements += [f'DROP INDEX "{name}"' for name, _ in indexes]
    for statement in statements:
        query(db, statement)
    query(db, SEED_POSTGRES, {"records": records})
    for name, definition in constraints:
        query(db, f'ALTER TABLE {TABLE} ADD CONSTRAINT "{name}" {definition}')
    for _, definition in indexes:
        query(db, definition)
    query(db, f"VACUUM ANALYZE {TABLE}")


def count_records(db: Database) -> int:
    return int(query(db, f"SELECT count(*) FROM {TABLE}")[0][0])


# --- the purge ------------------------------------------------------------------------------

PURGED = re.compile(
    r"Deleted (\d+) expired records? and (\d+) stale .*?, ([\d.]+)s, ([\d,]+) rows/s \((.*)\)\."
)


@dataclass
class Purge:
    deleted: int
    seconds: float  # the command's own time, pauses included
    pacing: str  # how the command says it paced itself
    wall: tuple[float, float]  # time.time() at its start and end, to line the probe up
    probe_rate: float
    without: list[float] = field(default_factory=list)  # claim latencies, seconds
    during: list[float] = field(default_factory=list)
    failed: int = 0  # probe requests without a 2xx


def purge(env: dict[str, str], extra: Sequence[str], timeout: float) -> Purge:
    """``manage.py purge_idempotency_keys`` (with its default pacing, unless ``extra``)."""
    started = time.time()
    output = manage(env, "purge_idempotency_keys", "-v", "1", *extra, timeout=timeout)
    match = PURGED.search(output)
    if match is None:
        raise RuntimeError(f"purge_idempotency_keys said something unexpected:\n{output}")
    expired, stale, seconds, _, pacing = match.groups()
    return Purge(int(expired) + int(stale), float(seconds), pacing, (started, time.time()), 0)


def purge_scenario(
    server: Server, env: dict[str, str], window: float, rate: float, args: argparse.Namespace
) -> Purge:
    """An open-loop claim probe at ``rate`` for ``window`` s, during the purge, then
    ``window`` s more; each claim's latency is counted from its scheduled time."""
    command = [sys.executable, str(HERE / "loadgen.py"), "--url"]
    command += [server.base_url + "/bench/commit/", "--user", USER, "--body", BODY]
    command += ["--duration", str(window * 2 + args.purge_timeout + 60)]
    command += ["--rate", f"{rate:.3f}", "--samples"]
    probe = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(window)  # the probe runs for the window: this is the measurement
        result = purge(env, shlex.split(args.purge_args), args.purge_timeout)
        time.sleep(window)
    finally:
        probe.send_signal(signal.SIGINT)
    stdout, stderr = probe.communicate(timeout=60)
    if probe.returncode != 0:
        raise RuntimeError(f"the latency probe failed:\n{stderr}")
    samples = json.loads(stdout)["samples"]
    first = min((sent for sent, _, _ in samples), default=0.0)
    result.probe_rate = rate
    for sent, latency, status in samples:
        if not 200 <= status < 300:
            result.failed += 1
        elif sent >= first + 1.0:  # not the probe's own first second (connections, caches)
            during = result.wall[0] <= sent <= result.wall[1]
            (result.during if during else result.without).append(latency)
    return result


# --- the report -----------------------------------------------------------------------------


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else float("nan")


def fmt(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}x"


def ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1000:.1f}"


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)

    def add(self, line: str = "") -> None:
        self.lines.append(line)

    def target(self, ok: bool, text: str) -> None:
        self.verdicts.append(f"{'PASS' if ok else 'FAIL'}  {text}")

    def text(self) -> str:
        return "\n".join([*self.lines, "", *self.verdicts])


def build_report(
    measures: dict[str, Measure],
    rounds: list[dict[str, float]],
    purged: Purge | None,
    records: dict[str, int],
    info: dict[str, str],
    vendor: str,
) -> Report:
    report = Report()
    for name, value in info.items():
        report.add(f"{name}: {value}")
    report.add()
    rel: dict[str, float] = {}
    header = f"| {'scenario':<52} | {'req/s':>7} | {'p50 ms':>6} | {'p99 ms':>6} | {'ratio':<36} |"
    report.add(header)
    report.add("|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|")
    for scenario in SCENARIOS:
        if scenario.name not in measures:
            continue
        m = measures[scenario.name]
        rel[scenario.name] = ratio(m.rate, measures[scenario.base].rate)
        per_round = [
            ratio(r[scenario.name], r[scenario.base])
            for r in rounds
            if scenario.name in r and scenario.base in r
        ]
        spread = f" ({min(per_round):.2f}-{max(per_round):.2f})" if len(per_round) > 1 else ""
        base = {"commit": f"the {records['small']:,}-record table", "api-bare": "DRF bare"}
        cell = f"{fmt(rel[scenario.name])} {base.get(scenario.base, 'bare')}{spread}"
        if scenario.name == "bare":
            cell = "1.00x (the baseline)"
        if scenario.name == "api-bare":
            cell = f"{fmt(ratio(m.rate, measures['bare'].rate))} bare (the DRF baseline)"
        label = scenario.label
        if scenario.peer:
            label += f" ({MARKS[scenario.peer]})"
        if scenario.server == "large":
            label += f" ({records['large']:,})"
        errors = f" ({m.errors} errors)" if m.errors else ""
        p50 = percentile(m.p50, 50) if m.p50 else float("nan")
        p99 = max(m.p99) if m.p99 else float("nan")
        report.add(
            f"| {label:<52} | {m.rate:>7.1f} | {ms(p50):>6} | {ms(p99):>6} | {cell + errors:<36} |"
        )
    report.add()
    report.add("req/s: every request of every round over their total time; ratio: to the")
    report.add("baseline of the same run, (min-max) of the rounds; p50: the median round's;")
    report.add("p99: the worst round's (a closed loop: they include queueing).")
    peers = [name for name in ("dik", "drf") if name in measures]
    if peers:
        report.add()
        report.add("What each peer skips that idempotency_django does:")
        for name in peers:
            label = next(s.label for s in SCENARIOS if s.name == name).split(",")[0]
            report.add(f"({MARKS[name]}) {label}: {SKIPS[name]}.")
    if "replay-unprepared" in measures:
        report.add()
        report.add("(c) the same view and settings with Django's default of no prepared statements")
        report.add("(OPTIONS prepare_threshold unset): every other row of ours runs with")
        report.add("prepare_threshold 5, as docs/store.md recommends on PostgreSQL.")
    if any(name in measures for name in ("redis", "cluster")):
        report.add()
        report.add("Redis store rows: the same view and settings with STORE = RedisStore, on one")
        report.add("Redis (its own database and key prefix) and on a local Redis Cluster of 3")
        report.add("masters + 3 replicas (AOF everysec) on the same machine.")
    if "api-bare" in measures:
        report.add()
        report.add("DRF rows: an APIView with TokenAuthentication (a SELECT of the token and its")
        report.add("user per request) and IsAuthenticated; ratios to that view bare, whose own")
        report.add("ratio is to the plain bare view.")

    report.target(
        rel["replay"] >= TARGET_REPLAY,
        f"replays ≥ {TARGET_REPLAY:.1f}x bare: {fmt(rel['replay'])}",
    )
    if peers:
        fastest = max(rel[f"{name}-replay"] for name in peers)
        report.target(
            rel["replay"] >= TARGET_REPLAY_PEER * fastest,
            f"replays ≥ {TARGET_REPLAY_PEER:.1f}x the faster peer's replays: "
            f"{fmt(ratio(rel['replay'], fastest))} ({fmt(rel['replay'])} vs {fmt(fastest)} bare)",
        )
    for name, least in (("commit", TARGET_COMMIT), ("atomic", TARGET_ATOMIC)):
        report.target(
            rel[name] >= least,
            f"first-time keys, {name} mode ≥ {least:.2f}x bare: {fmt(rel[name])}",
        )
        if peers:
            best = max(rel[peer] for peer in peers)
            report.target(
                rel[name] > best,
                f"first-time keys, {name} mode above every peer: {fmt(rel[name])} vs "
                f"{fmt(best)} (the best peer)",
            )
    report.target(
        rel["large"] >= TARGET_GROWTH,
        f"claims with {records['large']:,} records ≥ {TARGET_GROWTH:.1f}x claims with "
        f"{records['small']:,}: {fmt(rel['large'])}",
    )
    add_issue_18_targets(report, rel, peers)
    for name, m in measures.items():
        if m.errors:
            report.target(False, f"scenario {name}: {m.errors} requests failed or were not 2xx")
    if purged is not None:
        add_purge(report, purged, vendor)
    return report


def add_issue_18_targets(report: Report, rel: dict[str, float], peers: Sequence[str]) -> None:
    """The Redis store's and the DRF view's targets, with the peers' numbers beside them."""

    def beside(suffix: str) -> str:
        cells = [f"{name} {fmt(rel[name + suffix])}" for name in peers if name + suffix in rel]
        return f" (peers: {', '.join(cells)})" if cells else ""

    for name, where in (("redis", "Redis store"), ("cluster", "Redis Cluster")):
        if name in rel:
            report.target(
                rel[name] >= TARGET_REDIS_COMMIT,
                f"first-time keys, {where} ≥ {TARGET_REDIS_COMMIT:.2f}x bare: "
                f"{fmt(rel[name])}{beside('')}",
            )
    api_peers = [f"api-{name}" for name in peers]
    for name, least, where in (
        ("api-redis-replay", TARGET_API_REDIS_REPLAY, "Redis store"),
        ("api-replay", TARGET_API_REPLAY, "database store"),
    ):
        if name in rel:
            cells = [
                f"{p[4:]} {fmt(rel[p + '-replay'])}" for p in api_peers if p + "-replay" in rel
            ]
            side = f" (peers: {', '.join(cells)})" if cells else ""
            report.target(
                rel[name] >= least,
                f"DRF view, replays, {where} ≥ {least:.1f}x the DRF view bare: "
                f"{fmt(rel[name])}{side}",
            )


def add_purge(report: Report, purged: Purge, vendor: str) -> None:
    rows = ratio(purged.deleted, purged.seconds)
    without = (percentile(purged.without, 50), percentile(purged.without, 99))
    during = (percentile(purged.during, 50), percentile(purged.during, 99))
    p99 = ratio(during[1], without[1])
    report.add()
    report.add(f"Purge (manage.py purge_idempotency_keys, {purged.pacing}), claims probed at")
    report.add(f"{purged.probe_rate:.1f} req/s (open loop) before, during and after it:")
    report.add()
    report.add(f"| {'':<32} | {'':>30} |")
    report.add(f"|{'-' * 34}|{'-' * 32}|")
    report.add(f"| {'expired records deleted':<32} | {purged.deleted:>30,} |")
    report.add(f"| {'purge time, s':<32} | {purged.seconds:>30.1f} |")
    report.add(f"| {'rows per second':<32} | {rows:>30,.0f} |")
    for label, (p50, p99_), n in (
        ("claim latency without purge, ms", without, len(purged.without)),
        ("claim latency during purge, ms", during, len(purged.during)),
    ):
        cell = f"p50 {ms(p50)}, p99 {ms(p99_)} (n={n})"
        report.add(f"| {label:<32} | {cell:>30} |")
    report.add(f"| {'p99 during / p99 without':<32} | {fmt(p99):>30} |")
    if vendor == "postgresql":
        report.target(
            rows >= TARGET_PURGE_ROWS, f"purge ≥ {TARGET_PURGE_ROWS:,} rows/s: {rows:,.0f} rows/s"
        )
    else:
        report.add(f"(the {TARGET_PURGE_ROWS:,} rows/s target is PostgreSQL's)")
    report.target(
        p99 <= TARGET_PURGE_P99,
        f"claim p99 during the purge ≤ {TARGET_PURGE_P99:.0f}x without it: {fmt(p99)} "
        f"({ms(during[1])} ms vs {ms(without[1])} ms)",
    )
    if purged.failed:
        report.target(False, f"purge probe: {purged.failed} claims failed")


def write_results(path: Path, text: str, vendor: str) -> None:
    """Replace the marked block of ``vendor`` in ``path`` (PostgreSQL's, MariaDB's)."""
    marker = "" if vendor == "postgresql" else ":mariadb"
    start = RESULTS_START.replace(":start", f"{marker}:start")
    end = RESULTS_END.replace(":end", f"{marker}:end")
    block = f"{start}\n```text\n{text}\n```\n{end}"
    current = path.read_text() if path.exists() else "# Benchmark results\n"
    if start in current and end in current:
        current = current.split(start, 1)[0] + block + current.split(end, 1)[1]
    else:
        current = f"{current.rstrip()}\n\n{block}\n"
    path.write_text(current)


# --- main -----------------------------------------------------------------------------------


def machine_info(db: Database, generator: str, args: argparse.Namespace) -> dict[str, str]:
    packages = ("idempotency-django", "Django", "psycopg", "mysqlclient", "gunicorn", "redis")
    packages += ("hiredis",)  # the Redis store's rows: redis-py's C parser, or not
    versions = ", ".join(f"{name} {common.package_version(name)}" for name in packages)
    if generator == "wrk":
        wrk = subprocess.run(["wrk", "-v"], capture_output=True, text=True, check=False)
        load = (wrk.stdout or wrk.stderr).splitlines()[0].split(" [")[0]
    else:
        load = "benchmarks/loadgen.py (wrk not found)"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} cores ({common.cpu_model()}), "
        f"{common.memory_gib():.1f} GiB memory, load average at start {common.load_average()}",
        "versions": f"Python {sys.version.split()[0]}, {versions}",
        "peers": ", ".join(
            line for line in PEER_REQUIREMENTS.read_text().splitlines() if "==" in line
        )
        if not args.no_peers
        else "not measured (--no-peers)",
        "database": server_version(db).split(" on ")[0].split(",")[0],
        "code": f"git {common.git_revision()}",
        "load generator": f"{load}, {args.connections} connections, closed loop",
        "servers": f"gunicorn, {args.workers} sync workers each, persistent DB connections, "
        "provider delay 0",
        "rounds": f"{args.rounds} x {args.round_seconds} s per scenario, interleaved",
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark idempotency_django against a bare view and its peers."
    )
    add = parser.add_argument
    add("--database", choices=tuple(DEFAULT_URLS), default="postgres")
    add("--database-url", help="instead of --database's default; the large table goes to a "
        "second database, its name + _large")  # fmt: skip
    add("--seconds", type=int, default=15, help="per scenario, over all rounds (15)")
    add("--rounds", type=int, default=5, help="interleaved rounds (5)")
    add("--quick", action="store_true", help="a smoke run: 100,000 records, one 2 s round")
    add("--records", type=int, default=1_000_000, help="the large table (1,000,000)")
    add("--small-records", type=int, default=10_000, help="the small table (10,000)")
    add("--workers", type=int, default=os.cpu_count() or 1, help="per server (one per core)")
    add("--connections", type=int, default=0, help="default: 2 x workers")
    add("--load", choices=("auto", "wrk", "python"), default="auto")
    add("--no-peers", action="store_true", help="measure idempotency_django only")
    add("--no-redis", action="store_true", help="no Redis store scenarios (nor the cluster)")
    add("--redis-url", default=REDIS_URL, help="the Redis store's Redis (%(default)s); only "
        "this run's keys are deleted from it")  # fmt: skip
    add("--no-cluster", action="store_true", help="no Redis Cluster scenarios")
    add("--cluster-port", type=int, default=CLUSTER_PORT, help="the run's own cluster: this "
        "port and the five after it (%(default)s)")  # fmt: skip
    add("--peers-cache", type=Path, default=Path.home() / ".cache" / "idempotency-django-bench")
    add("--no-purge", action="store_true")
    add("--purge-args", default="", help="extra options of the command, after '=': "
        "--purge-args=--no-pacing, '--purge-args=--rate 50000'")  # fmt: skip
    add("--probe-rate", type=float, default=0.0, help="claims/s during the purge (default: 30%% "
        "of the large table's throughput)")  # fmt: skip
    add("--purge-timeout", type=float, default=900.0)
    add("--write-results", nargs="?", const=str(RESULTS), default=None, metavar="PATH")
    add("--keep", action="store_true", help="keep the databases and logs")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.rounds = min(args.seconds, 2), 1
        args.records = min(args.records, 100_000)
    args.connections = args.connections or 2 * args.workers
    args.round_seconds = max(1, round(args.seconds / args.rounds))
    return args


@contextlib.contextmanager
def databases(args: argparse.Namespace) -> Iterator[dict[str, Database]]:
    small = database(args.database_url or DEFAULT_URLS[args.database])
    dbs = {"small": small, "large": small.renamed(f"{small.name}_large")}
    try:
        for db in dbs.values():
            create_database(db)
        yield dbs
    finally:
        if not args.keep:
            for db in dbs.values():
                with contextlib.suppress(Exception):
                    drop_database(db)


@contextlib.contextmanager
def redis_stores(
    args: argparse.Namespace, prefix: str, step: Callable[[str], None]
) -> Iterator[dict[str, str]]:
    """The Redis store's URLs this run can use: ``single`` (``--redis-url``, if it answers)
    and ``cluster`` (a cluster of the run's own on ``--cluster-port`` and the five ports
    after it, started with ``tools/redis_cluster.py``, if ``redis-server`` is installed).
    Afterwards the keys under ``prefix`` are deleted, and the cluster is stopped if this
    run started it. Nothing else is flushed or deleted: other processes share the Redis."""
    import redis
    from redis.cluster import RedisCluster

    urls: dict[str, str] = {}
    if not args.no_redis:
        try:
            with redis.Redis.from_url(args.redis_url, socket_connect_timeout=2) as client:
                client.ping()
            urls["single"] = args.redis_url
        except (redis.RedisError, OSError) as error:
            step(
                f"skipping the Redis store's scenarios: {args.redis_url} does not answer ({error})"
            )
    cluster_env = {
        **os.environ,
        "REDIS_CLUSTER_PORT": str(args.cluster_port),
        "REDIS_CLUSTER_DIR": str(
            Path(tempfile.gettempdir()) / f"idempotency-bench-cluster-{args.cluster_port}"
        ),
    }

    def cluster(command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tools.redis_cluster", command],
            env=cluster_env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
            check=False,
        )  # fmt: skip

    started_cluster = False
    if not (args.no_redis or args.no_cluster):
        if shutil.which("redis-server") is None:
            step("skipping the Redis Cluster's scenarios: redis-server is not installed")
        else:
            running = cluster("status").returncode == 0
            step(f"{'reusing' if running else 'starting'} a Redis Cluster on {args.cluster_port}")
            result = cluster("start")
            if result.returncode == 0:
                urls["cluster"] = f"redis+cluster://127.0.0.1:{args.cluster_port}/0"
                started_cluster = not running
            else:
                step(f"skipping the Redis Cluster's scenarios: it did not start\n{result.stderr}")
    try:
        yield urls
    finally:
        for name, url in urls.items():
            if name == "cluster" and started_cluster:
                continue
            with contextlib.suppress(redis.RedisError, OSError):
                client = (
                    RedisCluster.from_url(url.replace("+cluster", ""))
                    if name == "cluster"
                    else redis.Redis.from_url(url)
                )
                with client:
                    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
                        client.delete(key)
        if started_cluster:
            cluster("stop")


def post(server: Server, path: str, key: str, token: str = "") -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", "X-Bench-User": USER, "Idempotency-Key": key}
    if token:
        headers["Authorization"] = f"Token {token}"
    request = urllib.request.Request(server.base_url + path, data=BODY.encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:  # the check that follows says what it was
        return error.code, error.read()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    generator = args.load if args.load != "auto" else ("wrk" if shutil.which("wrk") else "python")
    if generator == "python":
        print("wrk not found (apt-get install wrk): using loadgen.py, which takes more CPU "
              "from the servers on a small machine.", file=sys.stderr)  # fmt: skip
    log_dir = Path(tempfile.mkdtemp(prefix="idempotency-bench-"))
    servers: dict[str, Server] = {}
    started = time.monotonic()

    def step(text: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {text}", file=sys.stderr, flush=True)

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    postgres = (args.database_url or DEFAULT_URLS[args.database]).startswith("postgres")
    prefix = f"idempotency-bench-{os.getpid()}"
    try:
        peers = None if args.no_peers else peers_directory(args.peers_cache)
        with databases(args) as dbs, redis_stores(args, prefix, step) as redis_urls:
            specs = {
                n: s
                for n, s in SERVERS.items()
                if not (args.no_peers and s.peer)
                and (postgres or not s.postgres_only)
                and (not s.redis or s.redis in redis_urls)
            }
            scenarios = [
                s
                for s in SCENARIOS
                if not (args.no_peers and s.name in PEER_SCENARIOS) and s.server in specs
            ]
            info = machine_info(dbs["small"], generator, args)
            envs = {}
            for name, spec in specs.items():
                envs[name] = project_env(
                    spec.settings,
                    dbs[spec.table].url,
                    pythonpath=[REPO_ROOT, *([peers] if spec.peer and peers else [])],
                    EXAMPLE_PROVIDER_DELAY_MS="0",
                    **dict(spec.env),
                    **(
                        {
                            "EXAMPLE_REDIS_URL": redis_urls[spec.redis],
                            "EXAMPLE_REDIS_KEY_PREFIX": prefix,
                        }
                        if spec.redis
                        else {}
                    ),
                    BENCH_REDIS_PREFIX=prefix,
                )
            for name in ("ours", "large", "drf"):
                if name in envs:
                    step(f"migrating ({specs[name].settings.rsplit('.', 1)[1]}) {name}")
                    manage(envs[name], "migrate", "--noinput", "-v", "0")
            # The DRF view's TokenAuthentication: the user's token, in the small database.
            created = manage(envs["ours"], "drf_create_token", USER)
            token = created.split("Generated token ", 1)[1].split()[0]
            records = {"small": args.small_records, "large": args.records}
            for table, db in dbs.items():
                step(f"seeding {records[table]:,} expired records into {db.name}")
                seed(db, records[table])
            for name in specs:
                step(f"starting gunicorn ({args.workers} workers): {name}")
                servers[name] = spawn_gunicorn(
                    envs[name],
                    log_dir / f"gunicorn-{name}.log",
                    workers=args.workers,
                    extra_args=("--backlog", "2048"),
                )
            for server in servers.values():
                server.wait_ready("/bench/ping/", {"X-Bench-User": USER}, within=90)
            for scenario in scenarios:
                if scenario.replay:  # the first answer stored, the second its replay
                    auth = token if scenario.token else ""
                    first = post(servers[scenario.server], scenario.path, str(scenario.key), auth)
                    again = post(servers[scenario.server], scenario.path, str(scenario.key), auth)
                    if first[0] != 201 or again != first:
                        raise RuntimeError(f"{scenario.name}: no replay: {first} then {again}")
            step("warming up every scenario")
            for scenario in scenarios:
                url = servers[scenario.server].base_url + scenario.path
                run_load(generator, url, scenario.key, 1, 2, token if scenario.token else "")

            measures = {scenario.name: Measure() for scenario in scenarios}
            rounds: list[dict[str, float]] = []
            for index in range(args.rounds):
                shift = index % len(scenarios)
                rates: dict[str, float] = {}
                for scenario in scenarios[shift:] + scenarios[:shift]:
                    url = servers[scenario.server].base_url + scenario.path
                    auth = token if scenario.token else ""
                    load = run_load(
                        generator, url, scenario.key, args.round_seconds, args.connections, auth
                    )
                    measures[scenario.name].add(load)
                    rates[scenario.name] = load.requests / load.seconds
                    step(
                        f"round {index + 1}/{args.rounds} {scenario.name:<16} "
                        f"{rates[scenario.name]:8.1f} req/s  p50 {ms(load.p50)} ms  "
                        f"p99 {ms(load.p99)} ms  errors {load.errors}"
                    )
                rounds.append(rates)
            records = {table: count_records(db) for table, db in dbs.items()}

            purged = None
            if not args.no_purge:
                rate = args.probe_rate or max(5.0, round(0.3 * measures["large"].rate, 1))
                window = max(5.0, float(args.seconds))
                step(f"purge: probing claims at {rate} req/s, {window:.0f}s each side")
                purged = purge_scenario(servers["large"], envs["large"], window, rate, args)
                step(f"  purged {purged.deleted:,} rows in {purged.seconds:.1f}s")
            info["load average at end"] = common.load_average()
            vendor = dbs["small"].vendor
            report = build_report(measures, rounds, purged, records, info, vendor)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        for server in servers.values():
            server.stop()
        if args.keep:
            print(f"logs kept in {log_dir}", file=sys.stderr)
        else:
            shutil.rmtree(log_dir, ignore_errors=True)

    text = report.text()
    print(text)
    if args.write_results:
        write_results(Path(args.write_results), text, vendor)
        print(f"\nwritten to {args.write_results}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
