"""The campaign's CI slice: ``python -m tools.campaign.ci`` (about two minutes).

First the checker is proved able to fail: two planted defects (``defects``) must each be
reported as violations — a store that skips the claim, and the lost completion (sent once)
under a Redis stall — and the same stall without the defect must pass. Then a few faults
per store, each run checked: PostgreSQL, MariaDB, a Redis of the campaign's own, a Redis
Cluster. Prints every run's table; exits 1 if a defect went unnoticed or a real run has
a violation. The full campaign (longer, every fault) is in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import sys
import time

from tools.campaign import checker, runner, stores
from tools.campaign.__main__ import parser

# (what, arguments, whether the checker must report violations)
RUNS: list[tuple[str, list[str], bool]] = [
    ("planted: a store that skips the claim", ["--store", "redis", "--faults", "none",
     "--defect", "no-claim", "--seconds", "4"], True),
    ("planted: the completion sent once, under a stall", ["--store", "redis", "--faults",
     "stall", "--defect", "lost-completion", "--seconds", "6"], True),
    ("redis: the same stall on main, kills, a restart", ["--store", "redis", "--faults",
     "stall,kill,restart", "--seconds", "6"], False),
    ("postgres", ["--store", "postgres", "--faults", "kill,pause,terminate,stall",
     "--seconds", "8"], False),
    ("mariadb", ["--store", "mariadb", "--faults", "stall,terminate,kill", "--seconds", "5"],
     False),
    # A lease above 1.5 x the failover (about 2.5 s here), as docs/settings.md asks.
    ("cluster, WAIT_REPLICAS 1", ["--store", "cluster", "--wait-replicas", "1", "--faults",
     "failover", "--lease", "6", "--seconds", "5"], False),
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    options = argparse.ArgumentParser(prog="python -m tools.campaign.ci")
    options.add_argument("--database-url", default=None, help="the PostgreSQL run's database")
    options.add_argument("--mariadb-url", default=None, help="the MariaDB run's database")
    given = options.parse_args(argv)
    stores.cluster_env()
    rows = []
    failed = []
    for name, argv, must_fail in RUNS:
        started = time.monotonic()
        args = parser().parse_args([*argv, "--seed", "7"])
        if args.store in ("postgres", "mariadb"):
            args.database, args.store = args.store, "database"
            args.database_url = given.database_url if args.database == "postgres" else None
            args.database_url = (
                given.mariadb_url if args.database == "mariadb" else args.database_url
            )
        result = runner.run(args)
        checker.report(result)
        rows.append(result.row())
        flagged = not result.ok
        if flagged != must_fail:
            failed.append(name)
        print(
            f"{'ok' if flagged == must_fail else 'FAILED'}: {name} "
            f"({'violations' if flagged else 'no violation'}, "
            f"{time.monotonic() - started:.0f} s)",
            flush=True,
        )
    print(checker.table(rows))
    if failed:
        print(f"campaign slice FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
