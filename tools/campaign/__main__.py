"""``python -m tools.campaign --store STORE --faults F1,F2 --seconds N --seed S``

Runs one campaign (``runner``), prints the checker's table, the excused executions and
every violation, and exits 1 on any violation. ``--results FILE`` appends the table's row
(JSON) to FILE. docs/reliability.md lists the stores, faults and rules.
"""

from __future__ import annotations

import argparse
import json
import sys

from tools.campaign import checker, runner, stores, topology


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.campaign", description=__doc__)
    p.add_argument(
        "--store",
        required=True,
        choices=["database", "postgres", "mariadb", "redis", "cluster", "sentinel", "patroni"],
        help="database = --database (postgres or mariadb); postgres/mariadb for short",
    )
    p.add_argument("--database", choices=["postgres", "mariadb"], default="postgres")
    p.add_argument("--database-url", default=None, help="the server and database to create")
    p.add_argument(
        "--own-server",
        action="store_true",
        help="a PostgreSQL/MariaDB of the campaign's own (ports 8450/8451), for 'restart'",
    )
    p.add_argument("--faults", default=None, help="comma-separated; default: the store's set")
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--lease", type=float, default=3.0, help="EXAMPLE_LEASE_SECONDS")
    p.add_argument("--max-run", type=float, default=10.0, help="EXAMPLE_MAX_RUN_SECONDS")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--workers", type=int, default=2, help="sync workers per app server (2 run)")
    p.add_argument("--provider-delay-ms", type=int, default=200, help="before the charge")
    p.add_argument(
        "--provider-reply-ms", type=int, default=200, help="after the charge, before its answer"
    )
    p.add_argument(
        "--client-timeout", type=float, default=None, help="seconds (default: lease + 1)"
    )
    p.add_argument("--deduplicate", action="store_true", help="the provider dedupes by key")
    p.add_argument("--wait-replicas", type=int, default=0, help="cluster: WAIT_REPLICAS")
    p.add_argument("--sync", action="store_true", help="patroni: synchronous replication")
    p.add_argument(
        "--network",
        action="store_true",
        help="the app servers in a network namespace (partition, partition-long, delay)",
    )
    p.add_argument("--defect", choices=["no-claim", "lost-completion"], default=None)
    p.add_argument("--out", default=None, help="the run's directory (default: a new temp one)")
    p.add_argument("--results", default=None, help="append the table's row (JSON) here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    stores.cluster_env()
    if args.store in ("postgres", "mariadb"):
        args.database, args.store = args.store, "database"
    try:
        result = runner.run(args)
    except topology.TopologyMissing as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    checker.report(result)
    print(f"  run directory: {result.run['directory']}", file=sys.stderr)
    if args.results:
        with open(args.results, "a", encoding="utf-8") as file:
            file.write(
                json.dumps(
                    {
                        **result.row(),
                        "seed": result.run["seed"],
                        "violation_lines": result.violations,
                        "excused_lines": result.excused,
                    }
                )
                + "\n"
            )
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
