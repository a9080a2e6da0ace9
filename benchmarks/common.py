"""What the benchmark and the soak share besides the e2e helpers: the machine's description.

Databases of their own, the project's environment, ``manage.py`` and gunicorn come from
``tools/server.py``, the one home of those helpers (the e2e tests and the HTTP fuzz
use them too): the driver (psycopg or MySQLdb) creates, queries and drops the databases,
the project is migrated and served in subprocesses, and the clients speak HTTP.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


# --- the machine ----------------------------------------------------------------------------


def memory_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    return float("nan")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> str:
    try:
        return " ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "n/a"


def package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def git_revision() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}{' (+ uncommitted changes)' if dirty else ''}"
