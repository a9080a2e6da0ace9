"""The admin at 10 million records: every page, timed through Django's test client.

Seeds ``--records`` records (10,000,000 by default) into a database of its own
(``admin_pg`` / ``admin_my``, kept between runs: a second run with the same count reuses
them) by server-side SQL: 100,000 accounts, 20 endpoints of very unequal traffic,
UUID-like keys, 0.1% in progress (half of them with a lapsed lease), statuses 201/200 and a
few 4xx, created over two days with a one-day TTL (half expired, as before a purge). Then
it times each admin page as a logged-in superuser (the median of ``--rounds`` requests),
prints a table of pages with PASS/FAIL against 150 ms, and the SQL of the slowest page.
``--claim-cost`` also times claims (claim + completion through the engine) with and
without the admin's indexes, to show what they cost each request.

    python -m benchmarks.admin_scale --database postgres --records 1000000
    python -m benchmarks.admin_scale --database mariadb
    python -m benchmarks.admin_scale --no-pages --claim-cost 1000 --purge 1000000

``--purge N`` runs ``benchmarks/run.py``'s purge scenario on this table (last: it deletes
records, so the next run seeds again unless ``--records`` names the count left).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks import common
from tools.server import Database, create_database, database, query

TARGET_MS = 150.0
TABLE = "idempotency_django_idempotencyrecord"
DEFAULT_URLS = {
    "postgres": "postgres://root@127.0.0.1:5432/admin_pg",
    "mariadb": "mysql://root@127.0.0.1:3306/admin_my",
}
ENDPOINTS = [f"POST /api/v1/{name}/" for name in (
    "charges", "refunds", "payouts", "transfers", "customers", "invoices", "subscriptions",
    "orders", "shipments", "returns", "disputes", "coupons", "products", "prices",
    "webhooks", "files", "reports", "tokens", "sessions", "archive",
)]  # fmt: skip
ADMIN_INDEXES = (
    "idempotency_record_key",
    "idempotency_record_endpoint",
    "idempotency_record_status",
)
CHUNK = 1_000_000
HEADERS = '[["Content-Type", "application/json"]]'
COLUMNS = (
    "account, endpoint, {key}, fingerprint, state, token, lease_expires_at, response_status, "
    "response_headers, response_body, created_at, completed_at, expires_at"
)

# Per row ``g`` of ``total``: e = an endpoint index skewed to the first ones (the last of
# the 20 gets ~0.03% of the traffic), s = 0..999 for the state/status mix.
SEED_POSTGRES = f"""
INSERT INTO {TABLE} ({COLUMNS.format(key="key")})
SELECT (1 + (g * 7919) %% 100000)::text,
       (%(endpoints)s::text[])[
         1 + floor(20 * power((g * 2654435761 %% 1000003) / 1000003.0, 3))::int],
       substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-' || substr(h, 13, 4) || '-'
         || substr(h, 17, 4) || '-' || substr(h, 21, 12),
       'v1:' || h || h, CASE WHEN s = 0 THEN 'in_progress' ELSE 'completed' END, substr(h, 1, 32),
       CASE WHEN s = 0 THEN now() + CASE WHEN g %% 2 = 0 THEN interval '30 seconds'
                                           ELSE interval '-1 hour' END END,
       CASE WHEN s = 0 THEN NULL WHEN s < 850 THEN 201 WHEN s < 950 THEN 200
            WHEN s < 990 THEN 422 WHEN s < 998 THEN 402 ELSE 404 END,
       CASE WHEN s = 0 THEN '[]' ELSE '{HEADERS}' END::jsonb,
       CASE WHEN s = 0 THEN NULL ELSE convert_to('{{"id": "ch_' || g || '"}}', 'UTF8') END,
       ts, CASE WHEN s = 0 THEN NULL ELSE ts END, ts + interval '1 day'
FROM (SELECT g, md5('seed-' || g) AS h, (g * 7727) %% 1000 AS s,
             now() - interval '2 days' + g * (interval '2 days' / %(total)s) AS ts
      FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g) AS seed
"""
SEED_MARIADB = f"""
INSERT INTO {TABLE} ({COLUMNS.format(key="`key`")})
SELECT CAST(1 + (g * 7919) %% 100000 AS CHAR),
       ELT(1 + FLOOR(20 * POW(((g * 2654435761) %% 1000003) / 1000003.0, 3)), {{endpoints}}),
       CONCAT_WS('-', SUBSTR(h, 1, 8), SUBSTR(h, 9, 4), SUBSTR(h, 13, 4), SUBSTR(h, 17, 4),
                 SUBSTR(h, 21, 12)),
       CONCAT('v1:', h, h), IF(s = 0, 'in_progress', 'completed'), SUBSTR(h, 1, 32),
       IF(s = 0, UTC_TIMESTAMP(6) + INTERVAL IF(g %% 2 = 0, 30, -3600) SECOND, NULL),
       CASE WHEN s = 0 THEN NULL WHEN s < 850 THEN 201 WHEN s < 950 THEN 200
            WHEN s < 990 THEN 422 WHEN s < 998 THEN 402 ELSE 404 END,
       IF(s = 0, '[]', '{HEADERS}'),
       IF(s = 0, NULL, CONCAT('{{"id": "ch_', g, '"}}')),
       ts, IF(s = 0, NULL, ts), ts + INTERVAL 1 DAY
FROM (SELECT seq AS g, MD5(CONCAT('seed-', seq)) AS h, (seq * 7727) %% 1000 AS s,
             UTC_TIMESTAMP(6) - INTERVAL 2 DAY
               + INTERVAL FLOOR(seq * 172800000000 / %(total)s) MICROSECOND AS ts
      FROM seq_{{first}}_to_{{last}}) AS seed
"""


def django_setup(db: Database) -> None:
    os.environ["DATABASE_URL"] = db.url
    os.environ["DJANGO_SETTINGS_MODULE"] = "example_project.settings"
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", "--noinput", verbosity=0)


def secondary_indexes() -> tuple[list[Any], list[Any]]:
    from idempotency_django.models import IdempotencyRecord

    return list(IdempotencyRecord._meta.indexes), list(IdempotencyRecord._meta.constraints)


def seed(db: Database, records: int, step: Callable[[str], None]) -> None:
    """Empty the table, drop its secondary indexes, insert ``records`` rows in chunks of a
    million, rebuild the indexes (a sorted build is far faster than as many random inserts
    into them), and refresh the planner's statistics."""
    from django.db import connection

    from idempotency_django.models import IdempotencyRecord

    indexes, constraints = secondary_indexes()
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE TABLE {TABLE}")
    with connection.cursor() as cursor:
        present = connection.introspection.get_constraints(cursor, TABLE)
    with connection.schema_editor(atomic=False) as editor:
        for index in indexes:
            if index.name in present:  # (a run stopped half-way left some out)
                editor.remove_index(IdempotencyRecord, index)
        for constraint in constraints:
            if constraint.name in present:
                editor.remove_constraint(IdempotencyRecord, constraint)
    for first in range(1, records + 1, CHUNK):
        last = min(first + CHUNK - 1, records)
        params = {"first": first, "last": last, "total": records}
        with connection.cursor() as cursor:
            if db.vendor == "postgresql":
                cursor.execute(SEED_POSTGRES, {**params, "endpoints": ENDPOINTS})
            else:
                endpoints = ", ".join(f"'{name}'" for name in ENDPOINTS)
                sql = SEED_MARIADB.replace("{endpoints}", endpoints)
                sql = sql.replace("{first}", str(first)).replace("{last}", str(last))
                cursor.execute(sql, params)
        step(f"  {last:,} rows")
    with connection.schema_editor(atomic=False) as editor:
        for constraint in constraints:
            step(f"  building {constraint.name}")
            editor.add_constraint(IdempotencyRecord, constraint)
        for index in indexes:
            step(f"  building {index.name}")
            editor.add_index(IdempotencyRecord, index)
    step("  analyze")
    with connection.cursor() as cursor:
        cursor.execute(f"VACUUM ANALYZE {TABLE}" if db.vendor == "postgresql" else
                       f"ANALYZE TABLE {TABLE}")  # fmt: skip
        if db.vendor == "mysql":
            cursor.fetchall()


def pages(client: Any) -> list[tuple[str, Callable[[], Any]]]:
    """The pages an operator opens, each as a function that requests it."""
    from django.urls import reverse

    from idempotency_django.models import IdempotencyRecord

    changelist = reverse("admin:idempotency_django_idempotencyrecord_changelist")
    records = IdempotencyRecord.objects.order_by("-pk").only("pk", "key", "account")
    newest = records.filter(state="completed")[5000]
    old = records.filter(state="completed", pk__lt=newest.pk // 2)[0]
    running = list(records.filter(state="in_progress")[:3])
    rarest = ENDPOINTS[-1]

    def get(**params: str) -> Callable[[], Any]:
        return lambda: client.get(changelist, params)

    def confirmation() -> Any:
        data = {"action": "force_release", "_selected_action": [str(r.pk) for r in running]}
        return client.post(changelist, data)

    change = reverse("admin:idempotency_django_idempotencyrecord_change", args=[old.pk])
    overview_url = reverse("admin:idempotency_django_idempotencyrecord_overview")
    return [
        ("changelist", get()),
        ("changelist, page 50", get(p="50")),
        ("state = in progress", get(state__exact="in_progress")),
        ("state = completed", get(state__exact="completed")),
        ("lease lapsed", get(lease="lapsed")),
        ("lease live", get(lease="live")),
        (f"endpoint = {ENDPOINTS[0]} (most)", get(endpoint=ENDPOINTS[0])),
        (f"endpoint = {rarest} (rarest)", get(endpoint=rarest)),
        ("endpoint = nothing there", get(endpoint="POST /nothing/")),
        ("status = 201", get(response_status="201")),
        ("status = 404 (rare)", get(response_status="404")),
        ("status empty (in progress)", get(response_status__isnull="True")),
        ("expired = yes", get(expired="yes")),
        ("expired = no", get(expired="no")),
        ("search: exact key (old record)", get(q=old.key)),
        ("search: unknown key", get(q=str(uuid.uuid4()))),
        ("search: key prefix*", get(q=old.key[:8] + "*")),
        ("search: account", get(q=old.account)),
        ("search + state filter", get(q=old.account, state__exact="completed")),
        ("change page (old record)", lambda: client.get(change)),
        ("force-release confirmation", confirmation),
        ("overview", lambda: client.get(overview_url)),
    ]


class Timing(NamedTuple):
    page: str
    wall: float  # ms, median
    cpu: float  # ms of this process's CPU, median
    sql: float  # ms in SQL statements, median
    cost: float  # ms, median of CPU + SQL per request: the verdict's measure
    rows: int
    statements: list[dict[str, Any]]  # the last request's


def time_pages(rounds: int) -> list[Timing]:
    """Each page, requested ``rounds`` times after a warm-up. On a shared machine a wall
    time measures the other processes: the verdict is on the page's own cost, the CPU
    time of this process (Django) plus the time of its SQL statements."""
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    user_model = get_user_model()
    user = user_model.objects.filter(username="admin-scale").first()
    if user is None:
        user = user_model.objects.create_superuser("admin-scale", "a@example.com", "x")
    client = Client()
    client.force_login(user)
    results = []
    for name, request in pages(client):
        request()  # warm: the plan and the pages the query reads
        walls, cpus, sqls = [], [], []
        for _ in range(rounds):
            with CaptureQueriesContext(connection) as captured:
                started, cpu = time.perf_counter(), time.process_time()
                response = request()
                walls.append((time.perf_counter() - started) * 1000)
                cpus.append((time.process_time() - cpu) * 1000)
            if response.status_code != 200:
                raise RuntimeError(f"{name}: {response.status_code}")
            statements = list(captured.captured_queries)
            sqls.append(sum(float(statement["time"]) for statement in statements) * 1000)
        rows = response.content.count(b'name="_selected_action"')
        cost = statistics.median(cpu + sql for cpu, sql in zip(cpus, sqls, strict=True))
        results.append(
            Timing(name, statistics.median(walls), statistics.median(cpus),
                   statistics.median(sqls), cost, rows, statements)
        )  # fmt: skip
    return results


def report_overview(rounds: int) -> int:
    """Each panel of the admin overview and each check of the health check, timed on their
    own (the median and the worst of ``rounds`` runs after a warm-up), then every statement
    they send, EXPLAINed: a full scan (PostgreSQL's ``Seq Scan``, MariaDB's ``ALL``) fails.
    Returns the number of panels over target or plans that scan."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from idempotency_django.models import IdempotencyRecord
    from idempotency_django.operations import health, overview
    from idempotency_django.store.base import get_store

    store = get_store()
    records = IdempotencyRecord.objects.using("default")
    times: dict[str, list[float]] = {}
    for round_ in range(rounds + 1):
        panels = overview.database_overview(records, store, "default")
        report = health.run_checks()
        if round_ == 0:
            continue  # the warm-up
        for panel in panels:
            times.setdefault(f"overview: {panel.title}", []).append(panel.milliseconds)
        for check in report.checks:
            times.setdefault(f"health: {check.name}", []).append(check.duration * 1000)
    load = common.load_average()
    print(f"\nOverview panels and health checks, median / worst of {rounds} (load {load}):")
    print("| panel or check | median ms | worst ms | ≤ 150 ms |")
    print("|---|---|---|---|")
    failed = 0
    for name, values in times.items():
        median = statistics.median(values)
        failed += median > TARGET_MS
        verdict = "PASS" if median <= TARGET_MS else "FAIL"
        print(f"| {name} | {median:.1f} | {max(values):.1f} | {verdict} |")
    with CaptureQueriesContext(connection) as captured:
        overview.database_overview(records, store, "default")
        bound = store.bind("default")
        with bound.bounded_reads(5):  # type: ignore[attr-defined]
            bound.oldest_expired()
    print("\nTheir plans:")
    for statement in captured.captured_queries:
        sql = statement["sql"]
        if not sql.lstrip().upper().startswith("SELECT") or TABLE not in sql:
            continue
        with connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN {sql}")
            plan = [" ".join(str(cell) for cell in row) for row in cursor.fetchall()]
        # A full read of the records table (not of a derived table of at most 10,001 rows).
        scans = [
            line
            for line in plan
            if f"Seq Scan on {TABLE}" in line or f" {TABLE} ALL " in f" {line} "
        ]
        failed += bool(scans)
        print(f"  {'SCAN ' if scans else ''}{sql[:160]}")
        for line in plan:
            print(f"      {line[:200]}")
    return failed


def claim_cost(count: int, step: Callable[[str], None]) -> dict[str, float]:
    """µs per claim + completion through the engine, with the admin's indexes, without
    them (dropped), and with them again (rebuilt: minutes at 10M rows)."""
    from django.db import connection

    from idempotency_django.core import claims, shell
    from idempotency_django.models import IdempotencyRecord
    from idempotency_django.responses import StoredResponse

    options = claims.ClaimPolicy("default", lease=30, ttl=86400, in_flight="conflict",
                             wait_seconds=0, retry_after=1)  # fmt: skip
    outcome = StoredResponse(201, b'{"id": "ch_1"}', [("Content-Type", "application/json")])
    indexes = [i for i in IdempotencyRecord._meta.indexes if i.name in ADMIN_INDEXES]

    def run() -> float:
        started = time.perf_counter()
        for n in range(count):
            scope = claims.Scope(str(1 + n % 100000), ENDPOINTS[n % 20], str(uuid.uuid4()))
            claim = shell.claim_or_replay(scope, "v1:" + "0" * 64, options)
            assert isinstance(claim, claims.Claim)
            shell.complete(claim, outcome)
        return (time.perf_counter() - started) / count * 1e6

    samples: dict[str, list[float]] = {"with": [run()]}
    with connection.schema_editor(atomic=False) as editor:
        for index in indexes:
            editor.remove_index(IdempotencyRecord, index)
    samples["without"] = [run(), run()]
    step("  rebuilding the admin's indexes")
    with connection.schema_editor(atomic=False) as editor:
        for index in indexes:
            editor.add_index(IdempotencyRecord, index)
    samples["with"].append(run())
    return {kind: statistics.mean(values) for kind, values in samples.items()}


def purge(
    db: Database, limit: int, window: float, rate: float, timeout: float, extra: str = ""
) -> None:
    """``benchmarks/run.py``'s purge scenario on this table: the benchmark's server on
    this database, an open-loop claim probe before, during and after
    ``purge_idempotency_keys --limit``, paced as by default. Its report, as run.py prints
    it."""
    import tempfile

    from benchmarks import run
    from tools.server import REPO_ROOT, project_env, spawn_gunicorn

    env = project_env("benchmarks.benchproject.settings", db.url, pythonpath=[REPO_ROOT],
                      EXAMPLE_PROVIDER_DELAY_MS="0")  # fmt: skip
    log = Path(tempfile.mkdtemp(prefix="admin-scale-")) / "gunicorn.log"
    server = spawn_gunicorn(env, log, workers=os.cpu_count() or 1)
    try:
        server.wait_ready("/bench/ping/", {"X-Bench-User": run.USER}, within=90)
        options = argparse.Namespace(purge_args=f"--limit {limit} {extra}", purge_timeout=timeout)
        purged = run.purge_scenario(server, env, window, rate, options)
    finally:
        server.stop()
    report = run.Report()
    run.add_purge(report, purged, db.vendor)
    before = int(query(db, f"SELECT count(*) FROM {TABLE}")[0][0]) + purged.deleted
    print(f"\nPurge of {purged.deleted:,} expired records from a table of {before:,}:")
    print(report.text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database", choices=tuple(DEFAULT_URLS), default="postgres")
    parser.add_argument("--database-url", help="instead of --database's default")
    parser.add_argument("--records", type=int, default=10_000_000)
    parser.add_argument("--rounds", type=int, default=5, help="requests per page (median)")
    parser.add_argument("--reseed", action="store_true", help="even if the count matches")
    parser.add_argument("--claim-cost", type=int, default=0, metavar="N",
                        help="also time N claims with and without the admin's indexes")  # fmt: skip
    parser.add_argument("--purge", type=int, default=0, metavar="N",
                        help="then purge N expired records (of the half that are) while "
                        "claims are probed, as benchmarks/run.py does")  # fmt: skip
    parser.add_argument("--probe-rate", type=float, default=10.0, help="claims/s (10)")
    parser.add_argument("--purge-options", default="", metavar="OPTIONS",
                        help="more purge command options ('--batch-size 999')")  # fmt: skip
    parser.add_argument("--reuse", action="store_true",
                        help="reuse the records present, however many (after a purge)")  # fmt: skip
    parser.add_argument("--window", type=float, default=15.0, help="s of probe each side")
    parser.add_argument("--no-pages", action="store_true", help="skip the admin pages")
    parser.add_argument("--overview", action="store_true",
                        help="time each overview panel and health check; EXPLAIN them")  # fmt: skip
    args = parser.parse_args(argv)
    db = database(args.database_url or DEFAULT_URLS[args.database])
    started = time.monotonic()

    def step(text: str) -> None:
        print(f"[{time.monotonic() - started:7.1f}s] {text}", file=sys.stderr, flush=True)

    try:
        present = int(query(db, f"SELECT count(*) FROM {TABLE}")[0][0])
    except Exception:  # no database or no table yet
        create_database(db)
        present = -1
    django_setup(db)
    if (present != args.records and not (args.reuse and present > 0)) or args.reseed:
        step(f"seeding {args.records:,} records into {db.name}")
        seed(db, args.records, step)
        step("seeded")
    else:
        step(f"reusing the {present:,} records of {db.name}")
    failed = 0
    if not args.no_pages:
        failed = report_pages(db, args, step)
    if args.overview:
        failed += report_overview(args.rounds)
    if args.claim_cost:
        step(f"claim cost: {args.claim_cost} claims x 2, with and without the admin's indexes")
        cost = claim_cost(args.claim_cost, step)
        print(f"\nClaim + completion, 2 x {args.claim_cost}, mean (µs): with the "
              f"admin's indexes {cost['with']:.0f}, without {cost['without']:.0f}: "
              f"{cost['with'] / cost['without']:.2f}x")  # fmt: skip
    if args.purge:
        step(f"purging {args.purge:,} expired records, claims probed at {args.probe_rate}/s")
        purge(db, args.purge, args.window, args.probe_rate, 3600, args.purge_options)
    return 0 if not failed else 1


def report_pages(db: Database, args: argparse.Namespace, step: Callable[[str], None]) -> int:
    """Time the pages and print them; the number of pages over target."""
    load = common.load_average()
    results = time_pages(args.rounds)
    width = max(len(result.page) for result in results)
    version = query(db, "SELECT version()")[0][0].split(" on ")[0].split("-")[0]
    print(f"\nAdmin pages, {args.records:,} records, {version}, median of {args.rounds} "
          f"requests (load average {load} before, {common.load_average()} after):")  # fmt: skip
    print(f"| {'page':<{width}} | wall ms | CPU ms | SQL ms | CPU+SQL ms | rows | ≤ 150 ms |")
    print(f"|{'-' * (width + 2)}|---------|--------|--------|------------|------|----------|")
    for r in results:
        verdict = "PASS" if r.cost <= TARGET_MS else "FAIL"
        print(f"| {r.page:<{width}} | {r.wall:7.1f} | {r.cpu:6.1f} | {r.sql:6.1f} "
              f"| {r.cost:10.1f} | {r.rows:>4} | {verdict:<8} |")  # fmt: skip
    slowest = max(results, key=lambda result: result.sql)
    print(f"\nThe page with the slowest SQL, {slowest.page}: its statements")
    for statement in slowest.statements:
        print(f"  {float(statement['time']) * 1000:7.1f} ms  {statement['sql'][:240]}")
    failed = sum(result.cost > TARGET_MS for result in results)
    print(f"\n{'PASS' if not failed else 'FAIL'}: {len(results) - failed}/{len(results)} pages "
          f"≤ {TARGET_MS:.0f} ms")  # fmt: skip
    return failed


if __name__ == "__main__":
    sys.exit(main())
