"""The full campaign, run before a release: ``python -m tools.campaign.full`` (about 15
minutes; ``--only postgres,redis`` for some rows). Every store, every fault it takes,
then the two planted defects (which must be flagged). Prints the Markdown table that
docs/reliability.md shows, and each run's excused executions and violations; exits 1 if a
real run has a violation or a planted defect is not flagged.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from tools.campaign import checker, runner, stores, topology
from tools.campaign.__main__ import parser

APP = "kill,pause,pause-short,skew"
# (row name, arguments, whether the checker must report violations)
MATRIX: list[tuple[str, list[str], bool]] = [
    ("postgres", ["--store", "postgres", "--faults", f"{APP},stall,terminate",
     "--seconds", "40"], False),
    ("postgres-restart", ["--store", "postgres", "--own-server", "--faults", "restart,kill",
     "--seconds", "25"], False),
    ("postgres-network", ["--store", "postgres", "--network", "--faults",
     "partition,partition-long,delay", "--seconds", "30"], False),
    ("mariadb", ["--store", "mariadb", "--faults", f"{APP},stall,terminate",
     "--seconds", "40"], False),
    ("mariadb-restart", ["--store", "mariadb", "--own-server", "--faults", "restart,kill",
     "--seconds", "25"], False),
    ("redis", ["--store", "redis", "--faults", f"{APP},stall,sleep,terminate,restart",
     "--seconds", "45"], False),
    ("redis-network", ["--store", "redis", "--network", "--faults",
     "partition,partition-long,delay", "--seconds", "30"], False),
    ("cluster", ["--store", "cluster", "--lease", "6", "--faults", "failover,kill,pause",
     "--seconds", "30"], False),
    ("cluster-wait", ["--store", "cluster", "--lease", "6", "--wait-replicas", "1",
     "--faults", "failover,kill,pause", "--seconds", "30"], False),
    ("postgres-dedup", ["--store", "postgres", "--deduplicate", "--faults", "pause,kill",
     "--seconds", "25"], False),
    ("redis-dedup", ["--store", "redis", "--deduplicate", "--faults", "pause,kill",
     "--seconds", "25"], False),
    ("sentinel", ["--store", "sentinel", "--lease", "6", "--faults", "failover,kill,pause",
     "--seconds", "30"], False),
    ("patroni", ["--store", "patroni", "--lease", "6", "--faults", "kill-primary,kill,pause",
     "--seconds", "30"], False),
    ("patroni-sync", ["--store", "patroni", "--sync", "--lease", "6", "--faults",
     "kill-primary,kill,pause", "--seconds", "30"], False),
    ("defect-no-claim", ["--store", "redis", "--faults", "none", "--defect", "no-claim",
     "--seconds", "10"], True),
    ("defect-lost-completion", ["--store", "redis", "--faults", "stall", "--defect",
     "lost-completion", "--seconds", "12"], True),
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    options = argparse.ArgumentParser(prog="python -m tools.campaign.full")
    options.add_argument("--only", default="", help="comma-separated row names")
    options.add_argument("--seed", type=int, default=27)
    options.add_argument("--results", default=None, help="append each row (JSON) here")
    given = options.parse_args(argv)
    stores.cluster_env()
    only = {name for name in given.only.split(",") if name}
    rows, failed = [], []
    for name, arguments, must_fail in MATRIX:
        if only and name not in only:
            continue
        args = parser().parse_args([*arguments, "--seed", str(given.seed)])
        if args.store in ("postgres", "mariadb"):
            args.database, args.store = args.store, "database"
        started = time.monotonic()
        try:
            result = runner.run(args)
        except topology.TopologyMissing as error:
            print(f"skipped {name}: {error}", flush=True)
            continue
        checker.report(result)
        rows.append(result.row())
        if given.results:
            with open(given.results, "a", encoding="utf-8") as file:
                line = {**result.row(), "name": name, "seed": given.seed,
                        "violation_lines": result.violations,
                        "excused_lines": [line for _, line in result.excused]}  # fmt: skip
                file.write(json.dumps(line) + "\n")
        if result.ok == must_fail:
            failed.append(name)
        print(f"{name}: {time.monotonic() - started:.0f} s", flush=True)
    print(checker.table(rows))
    if failed:
        print(f"full campaign: unexpected results in {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
