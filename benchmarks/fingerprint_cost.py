#!/usr/bin/env python
"""What fingerprinting one hostile body costs before the view runs: CPU, wall time and the
growth of the process's peak memory, for bodies as large as Django reads by default.

    python -m benchmarks.fingerprint_cost [--package-root DIR] [--runs 3]

Each body is 2.5 MiB (``DATA_UPLOAD_MAX_MEMORY_SIZE``'s default, the largest that
``request.body`` accepts), built to make the canonical form as costly as it can be: a form
of tiny fields, and JSON arrays of numbers, objects or short strings; and, for the cost every
request pays, a 55-byte JSON body (per call, over 5,000 warm calls). Each case runs in a
fresh process of its own (the peak memory is per process), ``--runs`` times, and the best
run is shown. ``--package-root`` measures the ``idempotency_django`` package found in
another directory (an export of an earlier commit: ``git archive <commit>
idempotency_django | tar -x -C DIR``), with this checkout's test settings: the numbers in
docs/security.md compare the release before the limits with this one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SIZE = 2_621_440  # DATA_UPLOAD_MAX_MEMORY_SIZE's default

CASES = ("form", "json-ints", "json-floats", "json-objects", "json-strings", "json-small")

_CHILD = r"""
import json, os, resource, sys, time
os.environ["DJANGO_SETTINGS_MODULE"] = "tests.project.settings"
import django
django.setup()
from django.test import RequestFactory
from idempotency_django.core import keys

kind, size = sys.argv[1], int(sys.argv[2])

def repeat(unit, head=b"[", tail=b"1]"):
    return head + unit * ((size - len(head) - len(tail)) // len(unit)) + tail

if kind == "form":
    body, media = repeat(b"a=1&", head=b"", tail=b"a=1"), "x-www-form-urlencoded"
elif kind == "json-ints":
    body, media = repeat(b"1,"), "json"
elif kind == "json-floats":
    body, media = repeat(b"1.5,"), "json"
elif kind == "json-objects":
    body, media = repeat(b'{"a":1},', tail=b"{}]"), "json"
elif kind == "json-strings":
    body, media = repeat(b'"ab",', tail=b'"a"]'), "json"
else:
    body, media = b'{"amount": 1000, "currency": "EUR", "card": "tok_visa"}', "json"
request = RequestFactory().generic("POST", "/o/", data=body, content_type="application/" + media)
request.body
calls = 1
if kind == "json-small":  # per call, once warm: a loop of them
    keys.default_fingerprint(request, "POST /o/")
    calls = 5000
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
wall, cpu = time.perf_counter(), time.process_time()
for _ in range(calls):
    keys.default_fingerprint(request, "POST /o/")
cpu, wall = (time.process_time() - cpu) / calls, (time.perf_counter() - wall) / calls
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"bytes": len(body), "cpu": cpu, "wall": wall, "peak_kib": grown}))
"""


def measure(case: str, package_root: Path, runs: int) -> dict[str, float]:
    """The best of ``runs`` fresh processes (least CPU), with the largest peak growth."""
    results = []
    for _ in range(runs):
        path = os.pathsep.join([str(package_root), str(REPO_ROOT)])
        completed = subprocess.run(
            [sys.executable, "-c", _CHILD, case, str(SIZE)],
            cwd=package_root,  # -c puts the working directory first on sys.path
            env={**os.environ, "PYTHONPATH": path},
            capture_output=True,
            text=True,
        )
        if completed.returncode:
            raise SystemExit(f"{case}: the measuring process failed:\n{completed.stderr}")
        results.append(json.loads(completed.stdout.strip().splitlines()[-1]))
    best = min(results, key=lambda result: result["cpu"])
    best["peak_kib"] = max(result["peak_kib"] for result in results)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package-root", type=Path, default=REPO_ROOT)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print(f"package: {args.package_root / 'idempotency_django'}")
    print(f"{'body':14} {'size':>9} {'CPU':>9} {'wall':>9} {'peak memory':>12}")
    for case in CASES:
        result = measure(case, args.package_root, args.runs)
        print(
            f"{case:14} {result['bytes'] / 1048576:7.2f}Mi {result['cpu'] * 1000:7.3f}ms "
            f"{result['wall'] * 1000:7.3f}ms {result['peak_kib'] / 1024:9.1f} MB"
        )


if __name__ == "__main__":
    main()
