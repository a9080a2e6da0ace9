#!/usr/bin/env python
"""Benchmark idempotency_django against a bare view: one table of ratios from one run.

    python benchmarks/run.py                    # full run (about 5 minutes, most of it seeding)
    python benchmarks/run.py --quick            # a short smoke (smaller tables, 2 s scenarios)
    python benchmarks/run.py --write-results    # also record the table in benchmarks/RESULTS.md

The example project runs under gunicorn (sync workers, one per core) on PostgreSQL on
loopback, with the benchmark URLs of ``benchmarks/benchproject``; ``wrk`` (or, without it,
``benchmarks/loadgen.py``) drives it from a separate process. Scenarios are measured in
rounds, interleaved, and every comparison is a ratio of two numbers from this run: the
machine may be shared, so absolute numbers are printed but mean little across runs.

1. ``bare``: a view doing the same single ``INSERT`` (a ``Charge``) without the app;
2. ``commit`` / ``atomic``: the same view behind ``@idempotent``, every request a new key;
3. ``replay``: one completed key, replayed;
4. new keys against a table of 1,000,000 records vs one of 10,000;
5. ``purge_idempotency_keys`` deleting 1,000,000 expired records: rows per second, and the
   latency of claims (an open-loop probe) while it runs vs while it doesn't.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.loadgen import percentile  # noqa: E402

SETTINGS = "benchmarks.benchproject.settings"
USER = "alice"
BODY = json.dumps({"amount": 1000, "currency": "EUR", "card": "tok_visa"})
REPLAY_KEY = "bench-replay-key"
WRK_SCRIPT = Path(__file__).resolve().parent / "wrk" / "post.lua"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
RESULTS_START = "<!-- benchmark-results:start -->"
RESULTS_END = "<!-- benchmark-results:end -->"
TABLE = "idempotency_django_idempotencyrecord"

# The targets of issue #5, printed as PASS/FAIL lines.
TARGET_COMMIT = 0.70
TARGET_ATOMIC = 0.80
TARGET_REPLAY = 2.0
TARGET_GROWTH = 0.9
TARGET_PURGE_ROWS = 20_000
TARGET_PURGE_P99 = 2.0


@dataclass(frozen=True)
class Scenario:
    name: str
    label: str
    server: str  # "small" or "large": which table it runs against
    path: str
    fixed_key: str | None = None


SCENARIOS = (
    Scenario("null", "no-op view, no database (for reference)", "small", "/bench/null/"),
    Scenario("bare", "bare view, one INSERT (baseline)", "small", "/bench/bare/"),
    Scenario("commit", "@idempotent, new keys, commit mode", "small", "/bench/commit/"),
    Scenario("atomic", "@idempotent, new keys, atomic mode", "small", "/bench/atomic/"),
    Scenario("replay", "replay of one completed key", "small", "/bench/commit/", REPLAY_KEY),
    Scenario("large", "@idempotent, new keys, commit, large table", "large", "/bench/commit/"),
)


@dataclass
class Measure:
    """Requests and seconds of one scenario, summed over its rounds."""

    requests: int = 0
    seconds: float = 0.0
    errors: int = 0
    p50: list[float] = field(default_factory=list)  # per round, seconds
    p99: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)  # per round, requests per second

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else float("nan")

    def add(self, requests: int, seconds: float, errors: int, p50: float, p99: float) -> None:
        self.requests += requests
        self.seconds += seconds
        self.errors += errors
        self.p50.append(p50)
        self.p99.append(p99)
        self.rates.append(requests / seconds if seconds else float("nan"))


# --- load -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadResult:
    requests: int
    seconds: float
    errors: int
    p50: float
    p99: float


def run_load(
    generator: str, url: str, fixed_key: str | None, seconds: int, connections: int
) -> LoadResult:
    """Closed-loop load for ``seconds`` from a separate process."""
    if generator == "wrk":
        mode = f"fixed:{fixed_key}" if fixed_key else "new"
        command = [
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{seconds}s",
            "--timeout",
            "10s",
            "-s",
            str(WRK_SCRIPT),
            url,
            "--",
            USER,
            mode,
            BODY,
        ]
        output = _run(command, timeout=seconds + 60)
        line = next((ln for ln in output.splitlines() if ln.startswith("BENCH-JSON ")), None)
        if line is None:
            raise RuntimeError(f"wrk printed no result:\n{output}")
        data = json.loads(line.split(" ", 1)[1])
        errors = sum(
            data[name]
            for name in (
                "connect_errors",
                "read_errors",
                "write_errors",
                "status_errors",
                "timeouts",
            )
        )
        return LoadResult(
            requests=int(data["requests"]),
            seconds=data["duration_us"] / 1e6,
            errors=int(errors),
            p50=data["p50_us"] / 1e6,
            p99=data["p99_us"] / 1e6,
        )
    command = [
        sys.executable,
        str(Path(__file__).resolve().parent / "loadgen.py"),
        "--url",
        url,
        "--user",
        USER,
        "--body",
        BODY,
        "--duration",
        str(seconds),
        "--concurrency",
        str(connections),
    ]
    if fixed_key:
        command += ["--key", fixed_key]
    data = json.loads(_run(command, timeout=seconds + 60))
    ok = sum(n for status, n in data["statuses"].items() if status.startswith("2"))
    return LoadResult(
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


# --- databases ------------------------------------------------------------------------------

SEED_SQL = f"""
INSERT INTO {TABLE}
  (account, endpoint, key, fingerprint, state, token, lease_expires_at, response_status,
   response_headers, response_body, created_at, completed_at, expires_at)
SELECT (1000 + g %% 5000)::text,
       'POST /bench/commit/',
       substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-' || substr(h, 13, 4) || '-'
         || substr(h, 17, 4) || '-' || substr(h, 21, 12),
       h || reverse(h),
       'completed',
       reverse(h),
       NULL,
       201,
       '[["Content-Type", "application/json"], ["Location", "/charges/ch_1"]]'::jsonb,
       convert_to('{{"id": "ch_' || g || '", "amount": 1000, "currency": "EUR", '
                  || '"status": "succeeded"}}', 'UTF8'),
       ts,
       ts,
       ts + interval '1 day'
FROM (SELECT g, md5('seed-' || g) AS h,
             now() - interval '3 days' + g * (interval '1 day' / %(records)s) AS ts
      FROM generate_series(1, %(records)s) AS g) AS seed
"""


def seed(db: common.Database, records: int) -> float:
    """Insert ``records`` completed, *expired* records with server-side SQL; seconds taken.

    The shape of real ones: random UUID-like keys spread over 5,000 accounts, a stored
    ``201`` body, created one after the other over a day (so, as in a real table, the heap
    is in ``created_at`` and so ``expires_at`` order), all expired a day ago or more.
    Secondary indexes are dropped first and rebuilt after (much faster than 1,000,000
    random inserts into them), then ``VACUUM ANALYZE`` (autovacuum may be off).
    """
    started = time.monotonic()
    with common.cursor(db) as cur:
        cur.execute(
            "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conrelid = %s::regclass AND contype = 'u'",
            (TABLE,),
        )
        constraints = cur.fetchall()
        cur.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s AND indexname "
            "NOT IN (SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass)",
            (TABLE, TABLE),
        )
        indexes = cur.fetchall()
        for name, _ in constraints:
            cur.execute(f'ALTER TABLE {TABLE} DROP CONSTRAINT "{name}"')
        for name, _ in indexes:
            cur.execute(f'DROP INDEX "{name}"')
        cur.execute(SEED_SQL, {"records": records})
        for name, definition in constraints:
            cur.execute(f'ALTER TABLE {TABLE} ADD CONSTRAINT "{name}" {definition}')
        for _, definition in indexes:
            cur.execute(definition)
        cur.execute(f"VACUUM ANALYZE {TABLE}")
    return time.monotonic() - started


def count_records(db: common.Database) -> int:
    return int(common.query(db, f"SELECT count(*) FROM {TABLE}")[0][0])


# --- servers --------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    db: common.Database
    gunicorn: common.Gunicorn

    def url(self, path: str) -> str:
        return self.gunicorn.base_url + path


def start_server(name: str, db: common.Database, workers: int, log_dir: Path) -> Server:
    env = common.project_env(SETTINGS, db, EXAMPLE_PROVIDER_DELAY_MS="0")
    gunicorn = common.start_gunicorn(
        env,
        workers=workers,
        log_path=log_dir / f"gunicorn-{name}.log",
        extra_args=("--backlog", "2048"),
    )
    try:
        gunicorn.wait_ready("/bench/ping/", {"X-Bench-User": USER})
    except BaseException:
        gunicorn.stop()
        raise
    return Server(name, db, gunicorn)


def post(server: Server, path: str, key: str) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(
        server.url(path),
        data=BODY.encode(),
        headers={"Content-Type": "application/json", "X-Bench-User": USER, "Idempotency-Key": key},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, dict(response.headers.items()), response.read()


# --- the purge ------------------------------------------------------------------------------


@dataclass
class PurgeOutcome:
    deleted: int
    seconds: float  # the purge's own time (the command's, or ours for the fallback)
    wall: tuple[float, float]  # time.time() when it started and ended, for the probe
    how: str
    output: str


def purge(db: common.Database, timeout: float) -> PurgeOutcome:
    """``manage.py purge_idempotency_keys`` on ``db``; if the command is missing or fails,
    a batched ``DELETE`` of the same shape finishes the job (and the report says so)."""
    env = common.project_env(SETTINGS, db, EXAMPLE_PROVIDER_DELAY_MS="0")
    started_wall, started = time.time(), time.monotonic()
    result = subprocess.run(
        [sys.executable, "manage.py", "purge_idempotency_keys", "-v", "1"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    output = result.stdout
    match = re.search(r"Deleted (\d+) expired records? and (\d+) stale", output)
    if result.returncode == 0 and match is not None:
        timed = re.search(r"batches, ([\d.]+)s\.", output)
        seconds = float(timed.group(1)) if timed else time.monotonic() - started
        return PurgeOutcome(
            deleted=int(match.group(1)) + int(match.group(2)),
            seconds=seconds,
            wall=(started_wall, time.time()),
            how="manage.py purge_idempotency_keys",
            output=output,
        )
    lines = (result.stderr or output).strip().splitlines()
    why = f"exit code {result.returncode}: {lines[-1] if lines else 'no output'}"
    print(f"purge_idempotency_keys failed ({why}); using the fallback", file=sys.stderr)
    fallback = _fallback_purge(db, timeout, why)
    return dataclasses.replace(fallback, wall=(started_wall, fallback.wall[1]))


def fallback_batch_size() -> int:
    """The command's default batch size (``DEFAULT_BATCH_SIZE`` in ``purge.py``), else 1,000."""
    try:
        source = (REPO_ROOT / "idempotency_django" / "purge.py").read_text()
    except OSError:
        return 1000
    match = re.search(r"^DEFAULT_BATCH_SIZE = (\d+)", source, re.MULTILINE)
    return int(match.group(1)) if match else 1000


def _fallback_purge(
    db: common.Database, timeout: float, why: str, batch: int | None = None
) -> PurgeOutcome:
    """What the command does, without it: keyset-paginated batches of ids by
    ``expires_at``, each deleted by primary key with the conditions re-checked, each batch
    committed on its own."""
    batch = batch or fallback_batch_size()
    condition = (
        "expires_at < now() AND NOT (state = 'in_progress' "
        "AND lease_expires_at IS NOT NULL AND lease_expires_at > now())"
    )
    deleted = 0
    started_wall, started = time.time(), time.monotonic()
    with common.cursor(db) as cur:
        after: tuple[Any, int] | None = None
        while time.monotonic() - started < timeout:
            if after is None:
                cur.execute(
                    f"SELECT id, expires_at FROM {TABLE} WHERE {condition} "
                    "ORDER BY expires_at, id LIMIT %s",
                    (batch,),
                )
            else:
                cur.execute(
                    f"SELECT id, expires_at FROM {TABLE} WHERE {condition} "
                    "AND (expires_at, id) > (%s, %s) ORDER BY expires_at, id LIMIT %s",
                    (after[0], after[1], batch),
                )
            rows = cur.fetchall()
            if not rows:
                break
            after = (rows[-1][1], rows[-1][0])
            cur.execute(
                f"DELETE FROM {TABLE} WHERE id = ANY(%s) AND {condition}",
                ([row[0] for row in rows],),
            )
            deleted += cur.rowcount
    seconds = time.monotonic() - started
    how = f"a batched DELETE of the command's shape ({batch} rows a batch)"
    if why:
        how += f"; purge_idempotency_keys failed ({why})"
    return PurgeOutcome(deleted, seconds, (started_wall, time.time()), how, "")


@dataclass
class PurgeScenario:
    outcome: PurgeOutcome
    rate: float  # the probe's requests per second
    without: list[float]  # claim latencies (seconds) while no purge ran
    during: list[float]
    failed: int  # probe requests without a 2xx answer


def purge_scenario(server: Server, window: float, timeout: float, rate: float) -> PurgeScenario:
    """An open-loop claim probe before, during and after the purge of ``server``'s table."""
    command = [
        sys.executable,
        str(Path(__file__).resolve().parent / "loadgen.py"),
        "--url",
        server.url("/bench/commit/"),
        "--user",
        USER,
        "--body",
        BODY,
        "--duration",
        str(window * 2 + timeout + 60),
        "--rate",
        f"{rate:.3f}",
        "--samples",
    ]
    probe = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(window)
        outcome = purge(server.db, timeout)
        time.sleep(window)
    finally:
        probe.send_signal(signal.SIGINT)
    stdout, stderr = probe.communicate(timeout=60)
    if probe.returncode != 0:
        raise RuntimeError(f"the latency probe failed:\n{stderr}")
    data = json.loads(stdout)
    started, ended = outcome.wall
    first = min((sent for sent, _, _ in data["samples"]), default=0.0)
    without: list[float] = []
    during: list[float] = []
    failed = 0
    for sent, latency, status in data["samples"]:
        if not 200 <= status < 300:
            failed += 1
            continue
        if sent < first + 1.0:  # the probe's own first second: connections, caches
            continue
        (during if started <= sent <= ended else without).append(latency)
    return PurgeScenario(outcome, rate, without, during, failed)


# --- the report -----------------------------------------------------------------------------


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else float("nan")


def fmt_ratio(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}x"


def spread(values: list[float]) -> str:
    finite = [v for v in values if not math.isnan(v)]
    if len(finite) < 2:
        return ""
    return f" ({min(finite):.2f}-{max(finite):.2f})"


def ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1000:.1f}"


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    verdicts: list[tuple[bool, str]] = field(default_factory=list)

    def add(self, line: str = "") -> None:
        self.lines.append(line)

    def target(self, ok: bool, text: str) -> None:
        self.verdicts.append((ok, text))

    def text(self) -> str:
        verdicts = [f"{'PASS' if ok else 'FAIL'}  {text}" for ok, text in self.verdicts]
        return "\n".join([*self.lines, "", *verdicts])


def build_report(
    measures: dict[str, Measure],
    per_round: list[dict[str, float]],
    purge_result: PurgeScenario | None,
    records: dict[str, int],
    info: dict[str, str],
) -> Report:
    report = Report()
    for name, value in info.items():
        report.add(f"{name}: {value}")
    report.add()
    bare = measures["bare"].rate
    small = measures["commit"].rate

    def round_ratios(name: str, base: str) -> list[float]:
        return [ratio(r[name], r[base]) for r in per_round if name in r and base in r]

    header = (
        f"| {'scenario':<56} | {'requests':>8} | {'req/s':>7} | {'p50 ms':>7} | {'p99 ms':>7} "
        f"| {'ratio (min-max over rounds)':<34} |"
    )
    report.add(header)
    report.add("|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|")
    for scenario in SCENARIOS:
        m = measures[scenario.name]
        if scenario.name == "bare":
            rel = "1.00x bare (the baseline)"
        elif scenario.name == "null":
            rel = f"{fmt_ratio(ratio(m.rate, bare))} bare (not a target)"
        elif scenario.name == "large":
            rel = (
                f"{fmt_ratio(ratio(m.rate, small))} of the {records['small']:,}-record table"
                f"{spread(round_ratios('large', 'commit'))}"
            )
        else:
            rel = fmt_ratio(ratio(m.rate, bare))
            rel = f"{rel} bare{spread(round_ratios(scenario.name, 'bare'))}"
        label = scenario.label
        if scenario.server == "large":
            label = f"{label} ({records['large']:,})"
        elif scenario.name == "commit":
            label = f"{label} ({records['small']:,})"
        p50 = percentile(m.p50, 50) if m.p50 else float("nan")
        p99 = max(m.p99) if m.p99 else float("nan")
        errors = f" ({m.errors} errors)" if m.errors else ""
        report.add(
            f"| {label:<56} | {m.requests:>8} | {m.rate:>7.1f} | {ms(p50):>7} | {ms(p99):>7} "
            f"| {rel + errors:<34} |"
        )
    report.add()
    report.add("req/s: all requests of all rounds over their total time. p50: the median of")
    report.add("the rounds' p50; p99: the worst round's p99 (closed loop: they include queueing).")

    commit_ratio = ratio(measures["commit"].rate, bare)
    atomic_ratio = ratio(measures["atomic"].rate, bare)
    replay_ratio = ratio(measures["replay"].rate, bare)
    growth_ratio = ratio(measures["large"].rate, small)
    report.target(
        commit_ratio >= TARGET_COMMIT,
        f"first requests, commit mode ≥ {TARGET_COMMIT:.2f}x bare: {fmt_ratio(commit_ratio)}",
    )
    report.target(
        atomic_ratio >= TARGET_ATOMIC,
        f"first requests, atomic mode ≥ {TARGET_ATOMIC:.2f}x bare: {fmt_ratio(atomic_ratio)}",
    )
    report.target(
        replay_ratio >= TARGET_REPLAY,
        f"replays ≥ {TARGET_REPLAY:.1f}x bare: {fmt_ratio(replay_ratio)}",
    )
    report.target(
        growth_ratio >= TARGET_GROWTH,
        f"claims with {records['large']:,} records ≥ {TARGET_GROWTH:.1f}x claims with "
        f"{records['small']:,}: {fmt_ratio(growth_ratio)}",
    )
    for name, m in measures.items():
        if m.errors:
            report.target(False, f"scenario {name}: {m.errors} requests failed or were not 2xx")

    if purge_result is not None:
        outcome = purge_result.outcome
        rows = ratio(outcome.deleted, outcome.seconds)
        p50_without = percentile(purge_result.without, 50)
        p99_without = percentile(purge_result.without, 99)
        p50_during = percentile(purge_result.during, 50)
        p99_during = percentile(purge_result.during, 99)
        p99_ratio = ratio(p99_during, p99_without)
        report.add()
        report.add(f"Purge ({outcome.how}), claims probed at {purge_result.rate:.1f} req/s:")
        report.add()
        report.add(f"| {'':<36} | {'value':>26} |")
        report.add(f"|{'-' * 38}|{'-' * 28}|")
        report.add(f"| {'expired records deleted':<36} | {outcome.deleted:>26,} |")
        report.add(f"| {'purge time, s':<36} | {outcome.seconds:>26.1f} |")
        report.add(f"| {'rows per second':<36} | {rows:>26,.0f} |")
        without = f"p50 {ms(p50_without)}, p99 {ms(p99_without)} (n={len(purge_result.without)})"
        during = f"p50 {ms(p50_during)}, p99 {ms(p99_during)} (n={len(purge_result.during)})"
        report.add(f"| {'claim latency without purge, ms':<36} | {without:>26} |")
        report.add(f"| {'claim latency during purge, ms':<36} | {during:>26} |")
        report.add(f"| {'p99 during / p99 without':<36} | {fmt_ratio(p99_ratio):>26} |")
        if purge_result.failed:
            report.add(f"({purge_result.failed} probe requests got no 2xx answer)")
        report.target(
            rows >= TARGET_PURGE_ROWS,
            f"purge ≥ {TARGET_PURGE_ROWS:,} rows/s: {rows:,.0f} rows/s",
        )
        report.target(
            p99_ratio <= TARGET_PURGE_P99,
            f"claim p99 during the purge ≤ {TARGET_PURGE_P99:.0f}x without it: "
            f"{fmt_ratio(p99_ratio)} ({ms(p99_during)} ms vs {ms(p99_without)} ms)",
        )
        if purge_result.failed:
            report.target(False, f"purge probe: {purge_result.failed} claims failed")
    return report


def write_results(path: Path, text: str) -> None:
    block = f"{RESULTS_START}\n```text\n{text}\n```\n{RESULTS_END}"
    if path.exists():
        current = path.read_text()
        if RESULTS_START in current and RESULTS_END in current:
            before = current.split(RESULTS_START, 1)[0]
            after = current.split(RESULTS_END, 1)[1]
            path.write_text(f"{before}{block}{after}")
            return
        path.write_text(f"{current.rstrip()}\n\n{block}\n")
        return
    path.write_text(f"# Benchmark results\n\n{block}\n")


# --- main -----------------------------------------------------------------------------------


def machine_info(db: common.Database, generator: str, args: argparse.Namespace) -> dict[str, str]:
    versions = ", ".join(
        f"{name} {common.package_version(name)}"
        for name in ("idempotency-django", "Django", "psycopg", "gunicorn")
    )
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
        "database": common.server_version(db).split(" on ")[0],
        "code": f"git {common.git_revision()}",
        "load generator": f"{load}, {args.connections} connections, closed loop",
        "server": f"gunicorn, {args.workers} sync workers, persistent DB connections, "
        "provider delay 0",
        "rounds": f"{args.rounds} x {args.round_seconds} s per scenario, interleaved",
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark idempotency_django against a bare view (ratios from one run)."
    )
    parser.add_argument("--seconds", type=int, default=15, help="per scenario (default 15)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument(
        "--records", type=int, default=1_000_000, help="the large table (1,000,000)"
    )
    parser.add_argument(
        "--small-records", type=int, default=10_000, help="the small table (10,000)"
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--connections", type=int, default=0, help="default: 2 x workers")
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BENCH_DATABASE_URL", "postgres://root@127.0.0.1:5432/bench"),
        help="PostgreSQL; the large table goes to a second database, its name + _large",
    )
    parser.add_argument("--load", choices=("auto", "wrk", "python"), default="auto")
    parser.add_argument("--no-purge", action="store_true", help="skip scenario 5")
    parser.add_argument(
        "--probe-rate", type=float, default=0.0, help="claims/s during the purge scenario"
    )
    parser.add_argument("--purge-timeout", type=float, default=900.0)
    parser.add_argument(
        "--write-results",
        nargs="?",
        const=str(RESULTS),
        default=None,
        metavar="PATH",
        help=f"record the table in PATH (default {RESULTS.relative_to(REPO_ROOT)})",
    )
    parser.add_argument("--keep", action="store_true", help="keep the databases and logs")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds = min(args.seconds, 2)
        args.rounds = 1
        args.records = min(args.records, 100_000)
    args.connections = args.connections or 2 * args.workers
    args.round_seconds = max(1, round(args.seconds / args.rounds))
    return args


@contextlib.contextmanager
def benchmark_databases(args: argparse.Namespace) -> Iterator[dict[str, common.Database]]:
    small = common.database(args.database_url)
    if small.vendor != "postgresql":
        raise SystemExit("the benchmark runs on PostgreSQL (--database-url postgres://…)")
    dbs = {"small": small, "large": small.renamed(f"{small.name}_large")}
    try:
        for db in dbs.values():
            common.create_database(db)
        yield dbs
    finally:
        if not args.keep:
            for db in dbs.values():
                with contextlib.suppress(Exception):
                    common.drop_database(db)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    generator = args.load
    if generator == "auto":
        generator = "wrk" if shutil.which("wrk") else "python"
    if generator == "python":
        print(
            "wrk not found (apt-get install wrk): using benchmarks/loadgen.py, which takes "
            "more CPU from the server on a small machine.",
            file=sys.stderr,
        )
    log_dir = Path(tempfile.mkdtemp(prefix="idempotency-bench-"))
    servers: list[Server] = []
    stop_requested = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop_requested.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    started = time.monotonic()

    def step(text: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {text}", file=sys.stderr, flush=True)

    try:
        with benchmark_databases(args) as dbs:
            info = machine_info(dbs["small"], generator, args)
            for db in dbs.values():
                step(f"migrating {db.name}")
                env = common.project_env(SETTINGS, db, EXAMPLE_PROVIDER_DELAY_MS="0")
                common.manage(env, "migrate", "--noinput", "-v", "0")
            records = {"small": args.small_records, "large": args.records}
            for name, db in dbs.items():
                step(f"seeding {records[name]:,} expired records into {db.name}")
                took = seed(db, records[name])
                step(f"  seeded in {took:.1f}s")
            for name, db in dbs.items():
                step(f"starting gunicorn ({args.workers} workers) on {db.name}")
                servers.append(start_server(name, db, args.workers, log_dir))
            by_name = {server.name: server for server in servers}

            status, _, _ = post(by_name["small"], "/bench/commit/", REPLAY_KEY)
            status2, headers2, _ = post(by_name["small"], "/bench/commit/", REPLAY_KEY)
            if status != 201 or status2 != 201 or headers2.get("Idempotent-Replayed") != "true":
                raise RuntimeError(f"the replay key did not replay: {status} {status2} {headers2}")

            step("warming up every scenario")
            for scenario in SCENARIOS:
                server = by_name[scenario.server]
                run_load(generator, server.url(scenario.path), scenario.fixed_key, 1, 2)

            measures = {scenario.name: Measure() for scenario in SCENARIOS}
            per_round: list[dict[str, float]] = []
            for index in range(args.rounds):
                order = list(
                    SCENARIOS[index % len(SCENARIOS) :] + SCENARIOS[: index % len(SCENARIOS)]
                )
                rates: dict[str, float] = {}
                for scenario in order:
                    server = by_name[scenario.server]
                    result = run_load(
                        generator,
                        server.url(scenario.path),
                        scenario.fixed_key,
                        args.round_seconds,
                        args.connections,
                    )
                    measures[scenario.name].add(
                        result.requests, result.seconds, result.errors, result.p50, result.p99
                    )
                    rates[scenario.name] = result.requests / result.seconds
                    step(
                        f"round {index + 1}/{args.rounds} {scenario.name:<7} "
                        f"{rates[scenario.name]:8.1f} req/s  p50 {ms(result.p50)} ms  "
                        f"p99 {ms(result.p99)} ms  errors {result.errors}"
                    )
                per_round.append(rates)
            records = {name: count_records(db) for name, db in dbs.items()}

            purge_result = None
            if not args.no_purge:
                rate = args.probe_rate or max(5.0, round(0.3 * measures["large"].rate, 1))
                window = max(5.0, float(args.seconds))
                step(f"purge scenario: probing claims at {rate} req/s, {window:.0f}s each side")
                purge_result = purge_scenario(by_name["large"], window, args.purge_timeout, rate)
                step(
                    f"  purged {purge_result.outcome.deleted:,} rows in "
                    f"{purge_result.outcome.seconds:.1f}s"
                )
            info["load average at end"] = common.load_average()
            report = build_report(measures, per_round, purge_result, records, info)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        for server in servers:
            server.gunicorn.stop()
        if not args.keep:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            print(f"logs kept in {log_dir}", file=sys.stderr)

    text = report.text()
    print(text)
    if args.write_results:
        write_results(Path(args.write_results), text)
        print(f"\nwritten to {args.write_results}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
