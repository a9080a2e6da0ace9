"""Where a MariaDB purge's time goes, on a table ``admin_scale.py`` seeded.

    python -m benchmarks.purge_diagnose --database-url mysql://root@127.0.0.1:3306/admin_my

Deletes expired records of that table the way the purge does (a keyset page of the
``expires_at`` index, then ``DELETE … FORCE INDEX (PRIMARY) WHERE id IN (…) AND <expired>``
in autocommit), flat out, and prints:

1. ``ANALYZE FORMAT=JSON`` of ``--batches`` such ``DELETE`` statements: the pages each read
   from disk per deleted row, and its handler counters; then, ``--settle`` seconds later, the
   pages the whole server read and wrote per deleted row (InnoDB's purge threads included);
2. the rate with one connection, and with the same batches split over ``--connections``
   connections deleting at once (the disk's parallelism);
3. the rate when ``--superbatch`` expired records are read first and deleted in the unique
   index's order, 999 at a time (each of its pages read once).

It deletes records (about ``--rows`` per measurement): reseed with ``admin_scale.py
--reseed`` afterwards if you need them back. MariaDB/MySQL only.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

TABLE = "idempotency_django_idempotencyrecord"
EXPIRED = (
    "((state = 'completed' AND expires_at <= UTC_TIMESTAMP(6)) OR (state = 'in_progress' "
    "AND expires_at <= UTC_TIMESTAMP(6) AND lease_expires_at <= UTC_TIMESTAMP(6)))"
)
BATCH = 999
COUNTERS = ("Innodb_buffer_pool_reads", "Innodb_buffer_pool_pages_flushed")


def connect(url: str) -> Any:
    import MySQLdb  # type: ignore[import-untyped]

    parts = urlsplit(url)
    connection = MySQLdb.connect(
        host=parts.hostname or "127.0.0.1",
        port=parts.port or 3306,
        user=parts.username or "root",
        passwd=parts.password or "",
        db=parts.path.strip("/"),
    )
    connection.autocommit(True)
    return connection


def counters(cursor: Any) -> dict[str, int]:
    names = ", ".join(f"'{name}'" for name in COUNTERS)
    cursor.execute(f"SHOW GLOBAL STATUS WHERE Variable_name IN ({names})")
    return {name: int(value) for name, value in cursor.fetchall()}


def per_row(before: dict[str, int], after: dict[str, int], rows: int) -> str:
    return ", ".join(
        f"{name} {(after[name] - before[name]) / max(rows, 1):.2f}/row" for name in COUNTERS
    )


def page(cursor: Any, size: int, columns: str = "id") -> list[tuple[Any, ...]]:
    cursor.execute(
        f"SELECT {columns} FROM {TABLE} WHERE {EXPIRED} ORDER BY expires_at, id LIMIT {size}"
    )
    return list(cursor.fetchall())


def delete(cursor: Any, pks: Sequence[int], prefix: str = "") -> Any:
    keys = ",".join(str(int(pk)) for pk in pks)
    cursor.execute(
        f"{prefix}DELETE {TABLE} FROM {TABLE} FORCE INDEX (PRIMARY) "
        f"WHERE id IN ({keys}) AND {EXPIRED}"
    )
    return cursor.fetchone() if prefix else None


def find(tree: Any, key: str) -> Any:
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, list):
        for item in tree:
            found = find(item, key)
            if found is not None:
                return found
    return None


def analyse(url: str, batches: int, settle: float) -> None:
    cursor = connect(url).cursor()
    before, rows, read, seconds, reading = counters(cursor), 0, 0, 0.0, 0.0
    handlers: list[tuple[str, str]] = []
    for _ in range(batches):
        pks = [row[0] for row in page(cursor, BATCH)]
        if not pks:
            break
        cursor.execute("FLUSH STATUS")
        plan = json.loads(delete(cursor, pks, prefix="ANALYZE FORMAT=JSON ")[0])
        stats = find(plan, "r_engine_stats") or {}
        read += int(stats.get("pages_read_count", 0))
        seconds += float(plan["query_block"].get("r_total_time_ms", 0)) / 1000
        reading += float(stats.get("pages_read_time_ms", 0)) / 1000
        rows += len(pks)
        cursor.execute("SHOW SESSION STATUS LIKE 'Handler%'")
        handlers = [(name, value) for name, value in cursor.fetchall() if int(value)]
    time.sleep(settle)  # InnoDB's purge threads remove the entries the DELETEs marked
    inside, share = rows / max(seconds, 1e-9), reading / max(seconds, 1e-9)
    print(f"ANALYZE of {batches} DELETEs of {BATCH} rows: {inside:,.0f} rows/s inside them, "
          f"{share:.0%} of it reading pages; pages read by the DELETE {read / max(rows, 1):.2f}"
          f"/row; the last one's handlers {dict(handlers)}")  # fmt: skip
    after = counters(cursor)
    print(f"  the server over them and {settle:.0f} s after: {per_row(before, after, rows)}")


def rate(url: str, rows: int, connections: int) -> None:
    cursor = connect(url).cursor()
    local = threading.local()

    def run(pks: Sequence[int]) -> None:
        if not hasattr(local, "cursor"):
            local.cursor = connect(url).cursor()
        delete(local.cursor, pks)

    with ThreadPoolExecutor(connections) as pool:
        before, started, done = counters(cursor), time.perf_counter(), 0
        while done < rows:
            pks = sorted(row[0] for row in page(cursor, BATCH))
            if not pks:
                break
            share = -(-len(pks) // connections)
            list(pool.map(run, [pks[i : i + share] for i in range(0, len(pks), share)]))
            done += len(pks)
        took = time.perf_counter() - started
    print(f"flat out, {connections} connection(s): {done:,} rows in {took:.1f} s, "
          f"{done / took:,.0f} rows/s; {per_row(before, counters(cursor), done)}")  # fmt: skip


def sorted_by_unique(url: str, rows: int, superbatch: int) -> None:
    cursor = connect(url).cursor()
    before, started, done = counters(cursor), time.perf_counter(), 0
    while done < rows:
        found = page(cursor, min(superbatch, rows - done), "id, account, endpoint, `key`")
        if not found:
            break
        found.sort(key=lambda row: row[1:])
        for start in range(0, len(found), BATCH):
            delete(cursor, [row[0] for row in found[start : start + BATCH]])
        done += len(found)
    took = time.perf_counter() - started
    print(f"flat out, {superbatch:,} records at a time in the unique index's order: {done:,} "
          f"rows in {took:.1f} s, {done / took:,.0f} rows/s; "
          f"{per_row(before, counters(cursor), done)}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True, help="mysql://… of a seeded table")
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--settle", type=float, default=5.0)
    parser.add_argument("--rows", type=int, default=20_000, help="per rate measurement")
    parser.add_argument("--connections", type=int, nargs="*", default=[1, 4, 8])
    parser.add_argument("--superbatch", type=int, default=200_000)
    args = parser.parse_args(argv)
    url = args.database_url
    analyse(url, args.batches, args.settle)
    for connections in args.connections:
        rate(url, args.rows, connections)
    sorted_by_unique(url, args.superbatch, args.superbatch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
