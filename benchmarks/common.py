"""What the benchmark and the soak share: databases of their own, gunicorn, the machine.

Like ``tests/e2e/server.py`` (whose approach this follows), nothing here uses Django's
database connections: databases are created, queried and dropped with the driver (psycopg
or MySQLdb), the project is migrated and served in subprocesses, and the clients speak HTTP.
Kept apart from the e2e helpers so that the benchmarks don't depend on the test suite's
internals.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import dj_database_url

REPO_ROOT = Path(__file__).resolve().parents[1]
READY_WITHIN_SECONDS = 60.0
STOP_WITHIN_SECONDS = 10.0


# --- databases ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Database:
    vendor: str  # "postgresql" or "mysql"
    name: str
    url: str  # DATABASE_URL for the project
    config: Mapping[str, Any] = field(repr=False)

    def renamed(self, name: str) -> Database:
        """The same server, another database."""
        return database(urlunsplit(urlsplit(self.url)._replace(path=f"/{name}")))


def database(url: str) -> Database:
    config = dj_database_url.parse(url)
    vendor = {
        "django.db.backends.postgresql": "postgresql",
        "django.db.backends.mysql": "mysql",
    }.get(config["ENGINE"])
    if vendor is None:
        raise ValueError(f"need a PostgreSQL or MariaDB/MySQL URL, not {url!r}")
    name = str(config["NAME"])
    if not re.fullmatch(r"[A-Za-z0-9_]+", name):
        raise ValueError(f"unexpected database name {name!r}")
    return Database(vendor=vendor, name=name, url=url, config=config)


def connect(db: Database, *, server_only: bool = False, timeout: float = 10.0) -> Any:
    """A DB-API connection in autocommit, to ``db`` or (``server_only``) to no database."""
    config = db.config
    if db.vendor == "postgresql":
        import psycopg

        params = {
            "host": config.get("HOST") or None,
            "port": config.get("PORT") or None,
            "user": config.get("USER") or None,
            "password": config.get("PASSWORD") or None,
        }
        return psycopg.connect(
            dbname="postgres" if server_only else db.name,
            autocommit=True,
            connect_timeout=max(1, int(timeout)),
            **{k: v for k, v in params.items() if v is not None},
        )
    import MySQLdb  # type: ignore[import-untyped]

    params = {
        "host": config.get("HOST") or None,
        "port": int(config["PORT"]) if config.get("PORT") else None,
        "user": config.get("USER") or None,
        "passwd": config.get("PASSWORD") or None,
        "db": None if server_only else db.name,
    }
    connection = MySQLdb.connect(
        connect_timeout=max(1, int(timeout)),
        charset="utf8mb4",
        **{k: v for k, v in params.items() if v is not None},
    )
    connection.autocommit(True)
    return connection


@contextlib.contextmanager
def cursor(db: Database, *, server_only: bool = False) -> Iterator[Any]:
    connection = connect(db, server_only=server_only)
    try:
        yield connection.cursor()
    finally:
        connection.close()


def query(db: Database, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with cursor(db) as cur:
        cur.execute(sql, params)
        return list(cur.fetchall()) if cur.description else []


def create_database(db: Database) -> None:
    drop_database(db)
    with cursor(db, server_only=True) as cur:
        if db.vendor == "postgresql":
            cur.execute(f'CREATE DATABASE "{db.name}"')
        else:
            cur.execute(f"CREATE DATABASE `{db.name}` CHARACTER SET utf8mb4")


def drop_database(db: Database) -> None:
    with cursor(db, server_only=True) as cur:
        if db.vendor == "postgresql":
            # FORCE: a killed worker may leave a backend behind for a moment.
            cur.execute(f'DROP DATABASE IF EXISTS "{db.name}" WITH (FORCE)')
        else:
            cur.execute(f"DROP DATABASE IF EXISTS `{db.name}`")


def server_version(db: Database) -> str:
    return str(query(db, "SELECT version()")[0][0])


# --- the project ----------------------------------------------------------------------------


def project_env(settings_module: str, db: Database, **overrides: str) -> dict[str, str]:
    """The environment of a project subprocess: its settings module, its database, and
    ``EXAMPLE_*`` overrides (anything ``EXAMPLE_`` in our own environment is dropped)."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name != "DJANGO_SETTINGS_MODULE" and not name.startswith("EXAMPLE_")
    }
    env.update(
        DJANGO_SETTINGS_MODULE=settings_module,
        DATABASE_URL=db.url,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
        **overrides,
    )
    return env


def manage(env: Mapping[str, str], *args: str, timeout: float = 300) -> str:
    """Run ``manage.py`` with ``args``; its output, or an error with it."""
    result = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO_ROOT,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"manage.py {' '.join(args)} failed ({result.returncode}):\n"
            f"{result.stdout}\n{result.stderr}"
        )
    return result.stdout


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_pids(parent: int) -> list[int]:
    """Processes whose parent is ``parent``, read from ``/proc/<pid>/stat``."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process exited while we looked
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[1]) == parent:
            children.append(int(stat.parent.name))
    return children


@dataclass
class Gunicorn:
    """One gunicorn master (sync workers) in a session of its own, logging to a file."""

    process: subprocess.Popen[bytes]
    port: int
    workers: int
    log_path: Path
    _log_file: Any = field(repr=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def worker_pids(self) -> list[int]:
        return child_pids(self.process.pid)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_ready(
        self, path: str, headers: Mapping[str, str], within: float = READY_WITHIN_SECONDS
    ) -> None:
        """Until ``GET path`` answers 200 (``within`` seconds at most)."""
        deadline = time.monotonic() + within
        last: object = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gunicorn exited with {self.process.returncode}:\n{self.log()}")
            request = urllib.request.Request(self.base_url + path, headers=dict(headers))
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    if response.status == 200:
                        return
                    last = response.status
            except (OSError, urllib.error.URLError) as exc:
                last = exc
            time.sleep(0.2)  # polling the server is the readiness check
        raise RuntimeError(f"gunicorn not ready within {within}s ({last}):\n{self.log()}")

    def stop(self) -> None:
        """SIGINT (quick shutdown); past the grace period, SIGKILL the whole session."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(STOP_WITHIN_SECONDS)
            except subprocess.TimeoutExpired:
                self.kill()
        # Workers that outlived their master (it was killed) are in its session too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        if not self._log_file.closed:
            self._log_file.close()

    def kill(self) -> None:
        """SIGKILL the master and its workers at once (they run in one session)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(STOP_WITHIN_SECONDS)


def start_gunicorn(
    env: Mapping[str, str], *, workers: int, log_path: Path, extra_args: tuple[str, ...] = ()
) -> Gunicorn:
    port = free_port()
    log_file = log_path.open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "example_project.wsgi:application",
            "-w",
            str(workers),
            "-k",
            "sync",
            "-b",
            f"127.0.0.1:{port}",
            "--no-control-socket",
            *extra_args,
        ],
        cwd=REPO_ROOT,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return Gunicorn(
        process=process, port=port, workers=workers, log_path=log_path, _log_file=log_file
    )


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
