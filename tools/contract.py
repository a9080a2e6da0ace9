#!/usr/bin/env python
"""Check the example's two published OpenAPI schemas against the wire with Schemathesis.

    python -m tools.contract --database-url postgres://root@127.0.0.1:5432/contract_pg

What CI runs. The database is (re)created, migrated and dropped at the end; the example is
served under gunicorn (``server.py``'s harness, a 5 ms fake card provider) and
``st run`` is pointed at ``/api/schema/`` (drf-spectacular) and ``/ninja/openapi.json``
(django-ninja) in turn: every check, every phase that applies (examples, coverage, fuzzing;
stateful needs links, which neither schema has), as alice, with a fresh Idempotency-Key per
request. ``tools/schemathesis.toml`` holds the configuration and every exclusion, each
with its reason. Exit code 0 only if both runs end with zero failures.

Then the check is checked: each schema, saved with one documented answer changed
(``WRONG_SCHEMAS``: DRF's 402 as ``application/json``, ninja's 402 removed), must make
Schemathesis fail.
A run that passed against a wrong schema proves nothing, so that fails this script too.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import requests

from tools import server

CONFIG = server.REPO_ROOT / "tools" / "schemathesis.toml"
SCHEMAS = {"DRF": "/api/schema/?format=json", "django-ninja": "/ninja/openapi.json"}
POST = {"DRF": "/api/charges/", "django-ninja": "/ninja/charges/"}


def _drop_402(schema: dict[str, Any], path: str) -> None:
    """The declined card's 402 is no longer documented: ST103 (undocumented status)."""
    del schema["paths"][path]["post"]["responses"]["402"]


def _problem_as_json(schema: dict[str, Any], path: str) -> None:
    """The 402 documented as application/json, not as the application/problem+json sent."""
    content = schema["paths"][path]["post"]["responses"]["402"]["content"]
    content["application/json"] = content.pop("application/problem+json")


# One wrong copy of each schema, each wrong in its own way (a run costs 10-20 s).
WRONG_SCHEMAS: dict[str, tuple[str, Callable[[dict[str, Any], str], None]]] = {
    "DRF": ("402 as application/json", _problem_as_json),
    "django-ninja": ("402 removed", _drop_402),
}


def st_run(
    location: str,
    base_url: str,
    *extra: str,
    phases: str = "examples,coverage,fuzzing,stateful",
    max_examples: int,
    seed: int,
) -> int:
    """``st run`` against ``location`` (a URL or a file), its output on ours; its exit code."""
    command = [
        sys.executable,  # this interpreter's Schemathesis, whatever PATH says
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(CONFIG),
        "--no-color",
        "run",
        location,
        "--url",
        base_url,
        "--checks",
        "all",
        "--phases",
        phases,
        "--auth",
        ":".join(server.ALICE),
        "--max-examples",
        str(max_examples),
        "--seed",
        str(seed),
        "--generation-database",
        "none",
        "--request-timeout",
        str(server.HTTP_TIMEOUT_SECONDS),
        *extra,
    ]
    print("$", " ".join(command), flush=True)
    return subprocess.run(command, cwd=server.REPO_ROOT, check=False).returncode


def check(base_url: str, *, max_examples: int, seed: int) -> list[str]:
    """Both schemas against the wire, then each wrong schema: what failed."""
    failed = []
    for name, path in SCHEMAS.items():
        started = time.monotonic()
        code = st_run(f"{base_url}{path}", base_url, max_examples=max_examples, seed=seed)
        print(f"--> {name} schema: exit code {code} in {time.monotonic() - started:.0f}s")
        if code != 0:
            failed.append(f"{name} schema")
    with tempfile.TemporaryDirectory(prefix="contract-") as directory:
        for name, path in SCHEMAS.items():
            schema = requests.get(f"{base_url}{path}", timeout=30).json()
            wrong, change = WRONG_SCHEMAS[name]
            change(schema, POST[name])
            file = Path(directory) / f"{name}-{re.sub(r'[^a-z0-9]+', '-', wrong)}.json"
            file.write_text(json.dumps(schema))
            # Only the POST, in the coverage phase (it sends each card of the enum,
            # tok_declined included): quick, and deterministic.
            code = st_run(
                str(file),
                base_url,
                "--include-method",
                "POST",
                "--max-failures",
                "1",
                phases="coverage",
                max_examples=max_examples,
                seed=seed,
            )
            caught = code == 1
            print(f"--> {name} schema with {wrong}: exit code {code}, caught: {caught}")
            if not caught:
                failed.append(f"{name} schema with {wrong} passed")
    return failed


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True, help="PostgreSQL or MariaDB database")
    parser.add_argument("--max-examples", type=int, default=50, help="per operation and phase")
    parser.add_argument("--seed", type=int, default=19)
    parser.add_argument("--keep", action="store_true", help="keep the database")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    database = server.database(args.database_url)
    server.create_database(database)
    try:
        server.migrate(database)
        with tempfile.TemporaryDirectory(prefix="contract-") as logs:
            env = server.example_env(database.url, EXAMPLE_PROVIDER_DELAY_MS="5")
            served = server.spawn_gunicorn(env, Path(logs) / "gunicorn.log")
            try:
                served.wait_ready()
                failed = check(served.base_url, max_examples=args.max_examples, seed=args.seed)
            finally:
                served.stop()
            if failed:
                print(f"--- the server's log, last lines:\n{served.log()[-5000:]}")
    finally:
        if not args.keep:
            server.drop_database(database)
    elapsed = time.monotonic() - started
    if failed:
        print(f"CONTRACT FAILED in {elapsed:.0f}s: {', '.join(failed)}")
        return 1
    print(f"CONTRACT PASSED in {elapsed:.0f}s: both schemas match the wire; the wrong copies fail")
    return 0


if __name__ == "__main__":
    sys.exit(main())
