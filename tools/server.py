"""Run the example project under gunicorn or uvicorn against a database of its own, and
talk to it.

Nothing here uses Django's database connections: the e2e database is created and dropped
with the driver (psycopg or MySQLdb) against the server named by ``DATABASE_URL``, the
example is migrated and served in subprocesses, and the tests speak HTTP. A few tests also
look at the e2e database directly, with the driver (``record_states``, ``record_lease``,
``lock_waits``), or hold locks in it to make the servers' statements wait
(``charges_locked``, ``records_locked``).

The one home of these helpers: ``tools/fuzz.py``, ``benchmarks/run.py`` and
``benchmarks/soak.py`` use them too (``database``, ``create_database``, ``project_env``,
``manage``, ``spawn_gunicorn``, ``Server``), so a database URL is parsed, a database
created and a gunicorn started one way everywhere.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import dj_database_url
import requests
from requests.structures import CaseInsensitiveDict

from tools.threads import concurrently

REPO_ROOT = Path(__file__).resolve().parents[1]
SUPPORTED_VENDORS = ("postgresql", "mysql")
READY_WITHIN_SECONDS = 30.0
STOP_WITHIN_SECONDS = 15.0
HTTP_TIMEOUT_SECONDS = 30.0
WORKERS = 4

ALICE = ("alice", "alice")
BOB = ("bob", "bob")

T = TypeVar("T")


def database_vendor() -> str:
    """The vendor of the test settings' database (``DATABASE_URL``), without connecting."""
    from django.db import connections

    return str(connections["default"].vendor)


def new_key() -> str:
    return f"e2e-{uuid.uuid4()}"


def new_amount() -> int:
    """A random amount, so that a test can find its own charges among the others."""
    return 100_000 + uuid.uuid4().int % 900_000


# --- the e2e database -----------------------------------------------------------------------


@dataclass(frozen=True)
class Database:
    vendor: str  # "postgresql" or "mysql"
    name: str
    url: str  # what the example's DATABASE_URL is set to
    config: Mapping[str, Any] = field(repr=False)  # dj_database_url's parse of a server URL

    def renamed(self, name: str) -> Database:
        """Another database on the same server."""
        return database(urlunsplit(urlsplit(self.url)._replace(path=f"/{name}")))


def database(url: str) -> Database:
    """The database named by ``url`` (PostgreSQL or MariaDB/MySQL), checked: its name is
    used in SQL, so it must be a plain identifier."""
    config = dj_database_url.parse(url)
    vendor = {
        "django.db.backends.postgresql": "postgresql",
        "django.db.backends.mysql": "mysql",
    }.get(config["ENGINE"])
    if vendor is None:
        raise ValueError(f"need PostgreSQL or MariaDB/MySQL, not {config['ENGINE']} ({url!r})")
    name = str(config["NAME"])
    if not re.fullmatch(r"[A-Za-z0-9_]+", name):
        raise ValueError(f"Unexpected database name {name!r}")
    return Database(vendor=vendor, name=name, url=url, config=config)


def e2e_database(base_url: str) -> Database:
    """The dedicated e2e database on the server of ``base_url``: its name plus ``_e2e``."""
    base = database(base_url)
    return base.renamed(f"{base.name}_e2e")


def open_connection(database: Database, name: str | None, *, autocommit: bool = True) -> Any:
    """A DB-API connection to the server of ``database``: to the database ``name``, or to
    none of the test run's (``None``). The caller closes it."""
    config = database.config
    if database.vendor == "postgresql":
        import psycopg

        params = {
            "host": config.get("HOST") or None,
            "port": config.get("PORT") or None,
            "user": config.get("USER") or None,
            "password": config.get("PASSWORD") or None,
        }
        conninfo = {k: v for k, v in params.items() if v is not None}
        return psycopg.connect(
            dbname=name or "postgres", autocommit=autocommit, connect_timeout=10, **conninfo
        )
    import MySQLdb  # type: ignore[import-untyped]

    params = {
        "host": config.get("HOST") or None,
        "port": int(config["PORT"]) if config.get("PORT") else None,
        "user": config.get("USER") or None,
        "passwd": config.get("PASSWORD") or None,
        "db": name,
    }
    connection = MySQLdb.connect(
        connect_timeout=10, charset="utf8mb4", **{k: v for k, v in params.items() if v is not None}
    )
    # Autocommit: each query sees what committed before it (no REPEATABLE READ snapshot).
    connection.autocommit(autocommit)
    return connection


@contextlib.contextmanager
def connect(database: Database, name: str | None, *, autocommit: bool = True) -> Iterator[Any]:
    """``open_connection`` for the length of a ``with`` block."""
    connection = open_connection(database, name, autocommit=autocommit)
    try:
        yield connection
    finally:
        connection.close()


_connect = connect  # its name before the benchmarks shared it


def query(
    database: Database, sql: str, params: Sequence[Any] | Mapping[str, Any] = ()
) -> list[tuple[Any, ...]]:
    """The rows of one statement on ``database`` (none for a statement without rows).
    Without ``params``, a ``%`` in ``sql`` is just a ``%``."""
    with connect(database, database.name) as connection:
        cursor = connection.cursor()
        cursor.execute(sql, params or None)
        return list(cursor.fetchall()) if cursor.description else []


def server_version(database: Database) -> str:
    return str(query(database, "SELECT version()")[0][0])


def _server_execute(database: Database, statements: list[str]) -> None:
    """Run statements on the database server, outside any database of the test run."""
    with _connect(database, None) as connection:
        cursor = connection.cursor()
        for statement in statements:
            cursor.execute(statement)


def create_database(database: Database) -> None:
    quoted = f'"{database.name}"' if database.vendor == "postgresql" else f"`{database.name}`"
    create = f"CREATE DATABASE {quoted}"
    if database.vendor == "mysql":
        create += " CHARACTER SET utf8mb4"
    drop_database(database)
    _server_execute(database, [create])


def drop_database(database: Database) -> None:
    if database.vendor == "postgresql":
        # FORCE: a worker killed by a test may leave a backend behind for a moment.
        _server_execute(database, [f'DROP DATABASE IF EXISTS "{database.name}" WITH (FORCE)'])
    else:
        _server_execute(database, [f"DROP DATABASE IF EXISTS `{database.name}`"])


def project_env(
    settings_module: str,
    database_url: str,
    *,
    pythonpath: Sequence[str | Path] = (),
    **overrides: str,
) -> dict[str, str]:
    """The environment of a project subprocess: its settings module, its database,
    directories to import from first (``pythonpath``), and ``overrides`` (``EXAMPLE_*``
    settings; any ``EXAMPLE_`` variable of our own environment is dropped)."""
    env = {
        name: value
        for name, value in os.environ.items()
        # pytest-django exported the test suite's settings module; the project has its own.
        if name != "DJANGO_SETTINGS_MODULE" and not name.startswith("EXAMPLE_")
    }
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(
            [*map(str, pythonpath), *filter(None, [env.get("PYTHONPATH")])]
        )
    env.update(
        DJANGO_SETTINGS_MODULE=settings_module,
        DATABASE_URL=database_url,
        PYTHONUNBUFFERED="1",
        **overrides,
    )
    return env


def example_env(database_url: str, **overrides: str) -> dict[str, str]:
    """The environment of the example project: its settings, its database, ``overrides``."""
    return project_env("example_project.settings", database_url, **overrides)


def run_python(
    env: Mapping[str, str], *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python args`` at the repository's root in the environment ``env``, its output
    captured; the caller checks its exit status."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO_ROOT,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def manage(env: Mapping[str, str], *args: str, timeout: float = 300) -> str:
    """``manage.py args`` in the environment ``env``: its output, or an error with it."""
    result = run_python(env, "manage.py", *args, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(
            f"manage.py {' '.join(args)} failed ({result.returncode}):\n"
            f"{result.stdout}\n{result.stderr}"
        )
    return result.stdout


def migrate(database: Database) -> None:
    manage(example_env(database.url), "migrate", "--noinput", "-v", "0", timeout=180)


# --- looking into the e2e database ----------------------------------------------------------

RECORDS_TABLE = "idempotency_django_idempotencyrecord"
CHARGES_TABLE = "payments_charge"
IN_PROGRESS = "in_progress"
COMPLETED = "completed"


def _quote(database: Database, identifier: str) -> str:
    return f'"{identifier}"' if database.vendor == "postgresql" else f"`{identifier}`"


def record_states(database: Database, keys: Collection[str]) -> dict[str, str]:
    """``{key: state}`` of the idempotency records with these keys (any account or endpoint:
    the tests' keys are random), read from the e2e database; a key without a record is
    absent."""
    if not keys:
        return {}
    column = _quote(database, "key")  # a reserved word in MariaDB/MySQL
    placeholders = ", ".join(["%s"] * len(keys))
    with _connect(database, database.name) as connection:
        cursor = connection.cursor()
        cursor.execute(
            f"SELECT {column}, state FROM {RECORDS_TABLE} WHERE {column} IN ({placeholders})",
            list(keys),
        )
        return {str(key): str(state) for key, state in cursor.fetchall()}


def record_lease(database: Database, key: str) -> datetime | None:
    """The ``lease_expires_at`` of the idempotency record with this key, as an aware UTC
    datetime (``None`` once it completed), read from the e2e database. The servers run on
    this machine: compare it with ``datetime.now(timezone.utc)``."""
    column = _quote(database, "key")
    with _connect(database, database.name) as connection:
        cursor = connection.cursor()
        cursor.execute(f"SELECT lease_expires_at FROM {RECORDS_TABLE} WHERE {column} = %s", [key])
        rows = cursor.fetchall()
    assert len(rows) == 1, f"{len(rows)} records for key {key!r}"
    (lease,) = rows[0]
    if lease is None:
        return None
    assert isinstance(lease, datetime), lease
    if lease.tzinfo is None:  # MariaDB/MySQL: Django stores UTC in a naive DATETIME
        return lease.replace(tzinfo=timezone.utc)
    return lease.astimezone(timezone.utc)


class HeldLock:
    """Locks held by a connection of their own until ``release()`` (or the end of the
    ``with`` block): what the test process does to make the servers' statements wait."""

    def __init__(self, database: Database, statements: list[tuple[str, list[str]]]) -> None:
        self._vendor = database.vendor
        self._connection_manager = _connect(database, database.name, autocommit=False)
        self._connection = self._connection_manager.__enter__()
        self._released = False
        try:
            cursor = self._connection.cursor()
            for statement, params in statements:
                cursor.execute(statement, params or None)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            if self._vendor == "mysql":
                self._connection.cursor().execute("UNLOCK TABLES")
            self._connection.rollback()
        finally:
            self._connection_manager.__exit__(None, None, None)

    def __enter__(self) -> HeldLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def charges_locked(database: Database) -> HeldLock:
    """Make every ``INSERT`` into the example's charges table wait (reads go on) until the
    lock is released: a view creating its ``Charge`` waits in the database meanwhile."""
    if database.vendor == "postgresql":
        # SHARE conflicts with the ROW EXCLUSIVE lock an INSERT takes, not with reads.
        return HeldLock(database, [(f"LOCK TABLE {CHARGES_TABLE} IN SHARE MODE", [])])
    # A READ lock: other sessions may read the table, their writes wait.
    return HeldLock(database, [(f"LOCK TABLES {CHARGES_TABLE} READ", [])])


RENDER_GATE_TABLE = "e2e_render_gate"  # tests/project/asgi_live_urls.py reads it as it renders


def render_gate_locked(database: Database) -> HeldLock:
    """Make every read of ``RENDER_GATE_TABLE`` wait until the lock is released: a receipt
    of ``tests/project/asgi_live_urls.py`` waits in the database meanwhile, while it renders."""
    with _connect(database, database.name) as connection:
        connection.cursor().execute(f"CREATE TABLE IF NOT EXISTS {RENDER_GATE_TABLE} (id integer)")
    if database.vendor == "postgresql":
        # The one mode that conflicts with a plain SELECT.
        return HeldLock(
            database, [(f"LOCK TABLE {RENDER_GATE_TABLE} IN ACCESS EXCLUSIVE MODE", [])]
        )
    # A WRITE lock: other sessions can neither read nor write the table.
    return HeldLock(database, [(f"LOCK TABLES {RENDER_GATE_TABLE} WRITE", [])])


def records_locked(database: Database, keys: Collection[str]) -> HeldLock:
    """Lock the idempotency records of ``keys`` (``SELECT … FOR UPDATE``) until released:
    a completion (``UPDATE``) of one of them waits in the database meanwhile."""
    column = _quote(database, "key")
    placeholders = ", ".join(["%s"] * len(keys))
    select = f"SELECT id FROM {RECORDS_TABLE} WHERE {column} IN ({placeholders}) FOR UPDATE"
    statements = [(select, list(keys))]
    if database.vendor == "mysql":
        # No gap locks, and only the matching rows stay locked.
        statements.insert(0, ("SET TRANSACTION ISOLATION LEVEL READ COMMITTED", []))
    return HeldLock(database, statements)


def lock_waits(database: Database, statement_like: str) -> int:
    """How many statements on the e2e database (``LIKE statement_like``) wait for a lock
    (on MariaDB/MySQL: are running, see below)."""
    if database.vendor == "postgresql":
        query = (
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = %s AND wait_event_type = 'Lock' AND query LIKE %s"
        )
    else:
        # Not INNODB_TRX's 'LOCK WAIT': InnoDB refreshes that table only once nobody has
        # read it for 0.1 s, so polling it (or anyone else's) can keep it stale for good.
        # A statement as quick as these still running is one that waits.
        query = (
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST"
            " WHERE DB = %s AND COMMAND = 'Query' AND INFO LIKE %s"
        )
    with _connect(database, database.name) as connection:
        cursor = connection.cursor()
        cursor.execute(query, [database.name, statement_like])
        (count,) = cursor.fetchone()
        return int(count)


# --- gunicorn and uvicorn -------------------------------------------------------------------


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
        # "pid (comm) state ppid …": comm may hold spaces and parentheses.
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[1]) == parent:
            children.append(int(stat.parent.name))
    return children


@dataclass
class Server:
    """One gunicorn master (or uvicorn process) serving the example project, and an HTTP
    client for it."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    _log_file: Any = field(repr=False)
    name: str = "gunicorn"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- HTTP, the way a client of the payments API sees it

    # ``path`` is one of the example's front doors to the same charges: "/charges/" (plain
    # view), "/async/charges/" (async view), "/api/charges/" (DRF viewset).

    def post_charge(
        self,
        body: Mapping[str, Any] | None,
        *,
        key: str | None,
        auth: tuple[str, str] | None = ALICE,
        path: str = "/charges/",
    ) -> requests.Response:
        headers = {} if key is None else {"Idempotency-Key": key}
        return requests.post(
            f"{self.base_url}{path}",
            json=body,
            headers=headers,
            auth=auth,
            timeout=HTTP_TIMEOUT_SECONDS,
        )

    def charges(self, auth: tuple[str, str] = ALICE, path: str = "/charges/") -> dict[str, Any]:
        response = requests.get(f"{self.base_url}{path}", auth=auth, timeout=HTTP_TIMEOUT_SECONDS)
        assert response.status_code == 200, response.text
        return response.json()  # type: ignore[no-any-return]

    def charge_count(self, auth: tuple[str, str] = ALICE, path: str = "/charges/") -> int:
        return int(self.charges(auth, path)["count"])

    def charge_ids(self, auth: tuple[str, str] = ALICE, path: str = "/charges/") -> list[str]:
        return [charge["id"] for charge in self.charges(auth, path)["results"]]

    # -- the processes

    def worker_pids(self) -> list[int]:
        return child_pids(self.process.pid)

    def kill_workers(self) -> list[int]:
        """SIGKILL every worker of this master (the master respawns them)."""
        pids = self.worker_pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_ready(
        self,
        path: str = "/charges/",
        headers: Mapping[str, str] | None = None,
        within: float = READY_WITHIN_SECONDS,
    ) -> None:
        """Until ``GET path`` answers 200 (as alice, unless ``headers`` say who asks)."""
        deadline = time.monotonic() + within
        last: object = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited with {self.process.returncode}:\n{self.log()}"
                )
            try:
                response = requests.get(
                    f"{self.base_url}{path}",
                    auth=ALICE if headers is None else None,
                    headers=headers,
                    timeout=5,
                )
            except (requests.ConnectionError, requests.Timeout) as exc:
                # A timeout too: the listening socket may accept before a worker that is
                # still importing Django (on a loaded machine, for more than 5 s) answers.
                last = exc
            else:
                if response.status_code == 200:
                    return
                last = f"{response.status_code} {response.text[:500]}"
            time.sleep(0.1)  # polling the server is the readiness check
        raise AssertionError(f"{self.name} not ready within {within}s ({last}):\n{self.log()}")

    def wait_log(self, text: str, count: int, within: float = READY_WITHIN_SECONDS) -> None:
        """Wait until the server has logged ``text`` ``count`` times (bounded)."""
        deadline = time.monotonic() + within
        while self.log().count(text) < count:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{self.name} never logged {text!r} {count}x:\n{self.log()}")
            time.sleep(0.1)  # polling the server's log is the readiness check

    def warm_up(self, provider_delay: float, within: float = READY_WITHIN_SECONDS) -> None:
        """Wait until every worker has booted and served a request.

        gunicorn answers as soon as one worker is up, while the others may still be
        importing Django; a test of concurrent requests would then see them queued behind
        one worker. ``WORKERS`` concurrent requests that each hold a worker for the
        provider's delay (``tok_timeout``: 504, the key released, nothing stored) finish
        within one delay of each other only if as many workers served them.
        """
        deadline = time.monotonic() + within
        while self._concurrent_timeouts(within) >= 2 * provider_delay:
            if time.monotonic() > deadline:
                raise AssertionError(f"the {WORKERS} workers never answered together")

    def _concurrent_timeouts(self, within: float) -> float:
        """Send ``WORKERS`` ``tok_timeout`` charges at once; how long they took in all."""
        body = {"amount": 1, "currency": "EUR", "card": "tok_timeout"}
        started = time.monotonic()
        statuses = concurrently(
            WORKERS, lambda: self.post_charge(body, key=new_key()).status_code, within=within
        )
        elapsed = time.monotonic() - started
        assert statuses == [504] * WORKERS, statuses
        return elapsed

    def stop(self) -> None:
        """Stop the master and its workers; if the master outlives the grace period, kill
        its whole session (it ran in one of its own)."""
        if self.process.poll() is None:
            # gunicorn: quick shutdown, no graceful wait. uvicorn: a graceful shutdown,
            # bounded by --timeout-graceful-shutdown.
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(STOP_WITHIN_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(STOP_WITHIN_SECONDS)
        # Workers that outlived a killed master are still in its session.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self._log_file.close()


def spawn_gunicorn(
    env: Mapping[str, str],
    log_path: Path,
    *,
    workers: int = WORKERS,
    extra_args: Sequence[str] = (),
    application: str = "example_project.wsgi:application",
) -> Server:
    """Start gunicorn (``workers`` sync workers, a free port, a session of its own, its
    output in ``log_path``) in the environment ``env``; it may not answer yet (see
    ``Server.wait_ready``)."""
    port = free_port()
    log_file = log_path.open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gunicorn",
            application,
            "-w",
            str(workers),
            "-k",
            "sync",
            "-b",
            f"127.0.0.1:{port}",
            # The default control socket is one path in $HOME for every master: keep
            # concurrent test servers (and anyone else's gunicorn) apart.
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
    return Server(process=process, port=port, log_path=log_path, _log_file=log_file)


def start_server(
    database: Database,
    log_path: Path,
    example_settings: Mapping[str, str] | None = None,
    *,
    warm_up: bool = False,
) -> Server:
    """Start gunicorn with ``WORKERS`` sync workers on a free port and wait until it answers
    (with ``warm_up``, until every worker does; that costs a provider delay or more).
    ``example_settings`` are ``EXAMPLE_*`` environment variables (``EXAMPLE_LEASE_SECONDS``…)."""
    server = spawn_gunicorn(example_env(database.url, **(example_settings or {})), log_path)
    try:
        server.wait_ready()
        if warm_up:
            delay_ms = (example_settings or {}).get("EXAMPLE_PROVIDER_DELAY_MS", "300")
            server.warm_up(provider_delay=int(delay_ms) / 1000)
    except BaseException:
        server.stop()
        raise
    return server


UVICORN_GRACE_SECONDS = 2


def start_uvicorn(
    database: Database,
    log_path: Path,
    example_settings: Mapping[str, str] | None = None,
    *,
    workers: int = 1,
    settings_module: str = "example_project.settings",
) -> Server:
    """Serve the example's ASGI application (``example_project.asgi``) with uvicorn on a free
    port, ``workers`` processes, and wait until every worker has started and one answers.
    ``settings_module``: the example's settings, or a test project's built on them.

    On stop, requests still running get ``UVICORN_GRACE_SECONDS`` before they are cancelled.
    """
    port = free_port()
    log_file = log_path.open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "example_project.asgi:application",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            str(workers),
            "--lifespan",
            "off",  # Django's ASGI handler speaks HTTP only
            "--timeout-graceful-shutdown",
            str(UVICORN_GRACE_SECONDS),
        ],
        cwd=REPO_ROOT,
        env=project_env(settings_module, database.url, **(example_settings or {})),
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    server = Server(
        process=process, port=port, log_path=log_path, _log_file=log_file, name="uvicorn"
    )
    try:
        # Each worker logs this once it has imported the application; with several, the
        # parent's socket accepts as soon as one of them is up.
        server.wait_log("Started server process", workers)
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


# --- a request that stays in flight ---------------------------------------------------------


@dataclass
class Outcome:
    """A response read with ``http.client``, looking enough like a ``requests.Response``."""

    status_code: int
    headers: CaseInsensitiveDict[str]
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


def post_with_header_lines(
    server: Server,
    body: Mapping[str, Any],
    header_lines: Sequence[tuple[str, str]],
    *,
    auth: tuple[str, str] = ALICE,
    path: str = "/charges/",
) -> Outcome:
    """``POST`` with ``header_lines`` sent as they are, one line each, repeated names
    included (``requests`` takes headers as a mapping, which cannot repeat a name)."""
    credentials = base64.b64encode(":".join(auth).encode()).decode()
    payload = json.dumps(body).encode()
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=HTTP_TIMEOUT_SECONDS)
    try:
        connection.putrequest("POST", path)
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(len(payload)))
        connection.putheader("Authorization", f"Basic {credentials}")
        for name, value in header_lines:
            connection.putheader(name, value)
        connection.endheaders(payload)
        response = connection.getresponse()
        return Outcome(response.status, CaseInsensitiveDict(response.getheaders()), response.read())
    finally:
        connection.close()


class InFlightRequest:
    """``POST /charges/`` (or ``path``) in a thread of its own, so that it can stay in flight
    while the test goes on. ``sent`` is set once the request is on the wire, ``done`` once it
    was answered or failed (``finished``, if given, too: one event for several requests)."""

    def __init__(
        self,
        server: Server,
        body: Mapping[str, Any],
        *,
        key: str,
        auth: tuple[str, str] = ALICE,
        finished: threading.Event | None = None,
        path: str = "/charges/",
    ) -> None:
        self.sent = threading.Event()
        self.done = threading.Event()
        self.outcome: Outcome | None = None
        self.error: BaseException | None = None
        self._finished = finished
        credentials = base64.b64encode(":".join(auth).encode()).decode()
        self._request = (
            json.dumps(body).encode(),
            {
                "Content-Type": "application/json",
                "Idempotency-Key": key,
                "Authorization": f"Basic {credentials}",
            },
        )
        self._port = server.port
        self._path = path
        self._thread = threading.Thread(target=self._run, name="in-flight-request", daemon=True)

    def start(self) -> InFlightRequest:
        self._thread.start()
        return self

    def _run(self) -> None:
        connection = http.client.HTTPConnection(
            "127.0.0.1", self._port, timeout=HTTP_TIMEOUT_SECONDS
        )
        try:
            body, headers = self._request
            connection.request("POST", self._path, body=body, headers=headers)
            self.sent.set()
            response = connection.getresponse()
            self.outcome = Outcome(
                response.status, CaseInsensitiveDict(response.getheaders()), response.read()
            )
        except BaseException as exc:  # the worker may be killed under it
            self.error = exc
        finally:
            connection.close()
            self.sent.set()
            self.done.set()
            if self._finished is not None:
                self._finished.set()

    def wait_sent(self, timeout: float = 10.0) -> None:
        assert self.sent.wait(timeout), "the request was not sent"

    def wait_done(self, timeout: float = HTTP_TIMEOUT_SECONDS) -> None:
        assert self.done.wait(timeout), "the request did not finish"
        self._thread.join(timeout)


def race_duplicates(
    server: Server,
    body: Mapping[str, Any],
    *,
    key: str,
    auth: tuple[str, str] = ALICE,
    within: float = 10.0,
) -> tuple[InFlightRequest, InFlightRequest]:
    """Send the same request twice and return ``(running, refused)`` as soon as one of the
    two has been answered: for a slow view, the loser of the claim is answered at once.

    Which one wins is not for the client to know: the second may overtake the first on
    the way to the claim (a worker's first request pays for its database connection and
    lazy imports), so a test that assumed the first one won would be flaky.
    """
    finished = threading.Event()
    first = InFlightRequest(server, body, key=key, auth=auth, finished=finished).start()
    first.wait_sent()
    second = InFlightRequest(server, body, key=key, auth=auth, finished=finished).start()
    assert finished.wait(within), f"neither duplicate was answered within {within}s"
    if first.done.is_set():
        return second, first
    return first, second


def retry_until(
    attempt: Callable[[], T],
    until: Callable[[T], bool],
    *,
    within: float,
    every: float,
) -> tuple[T, list[T]]:
    """Call ``attempt`` every ``every`` seconds until ``until`` holds for its result, at most
    ``within`` seconds; returns that result and all the earlier ones. Retrying *is* what the
    scenarios using this are about, so the pause between attempts is the client's back-off,
    not a synchronisation."""
    deadline = time.monotonic() + within
    earlier: list[T] = []
    while True:
        result = attempt()
        if until(result):
            return result, earlier
        earlier.append(result)
        if time.monotonic() + every > deadline:
            raise AssertionError(f"gave up after {within}s; last result: {result!r}")
        time.sleep(every)


# --- what a client of the payments API checks ------------------------------------------------

REPLAYED = "Idempotent-Replayed"
PROBLEM_JSON = "application/problem+json"


def charge_body(card: str = "tok_visa", amount: int | None = None) -> dict[str, Any]:
    return {"amount": amount or new_amount(), "currency": "EUR", "card": card}


def assert_problem(
    response: requests.Response | Outcome, status: int, slug: str | None = None
) -> dict[str, Any]:
    """``response`` is an RFC 9457 problem of ``status`` (and of the package's ``slug``)."""
    assert response.status_code == status, (response.status_code, response.headers, response.text)
    assert response.headers["Content-Type"] == PROBLEM_JSON, response.headers
    problem: dict[str, Any] = response.json()
    assert problem["status"] == status, problem
    if slug is not None:
        assert problem["type"] == f"urn:idempotency-django:problem:{slug}", problem
    return problem


def assert_in_flight(response: requests.Response | Outcome) -> None:
    """A 409 telling the client that the key's first request is still running."""
    assert_problem(response, 409, "in-flight")
    assert response.headers["Retry-After"].isdigit(), response.headers
    assert REPLAYED not in response.headers


def assert_replay(response: requests.Response, first: requests.Response | Outcome) -> None:
    """``response`` is ``first`` replayed: same status, same bytes, marked as a replay."""
    assert response.status_code == first.status_code, (response.status_code, response.text)
    assert response.headers.get(REPLAYED) == "true", response.headers
    assert REPLAYED not in first.headers, first.headers
    assert response.content == first.content
    for name in ("Content-Type", "Location"):
        assert response.headers.get(name) == first.headers.get(name), name


def assert_one_ran(responses: list[requests.Response]) -> requests.Response:
    """Concurrent duplicates: exactly one of ``responses`` ran the view (a 201); every other
    one is a 409 in-flight or a replay of that 201. Returns the one that ran."""
    statuses = sorted(response.status_code for response in responses)
    assert set(statuses) <= {201, 409}, statuses
    ran = [r for r in responses if r.status_code == 201 and REPLAYED not in r.headers]
    assert len(ran) == 1, [(r.status_code, dict(r.headers)) for r in responses]
    for response in responses:
        if response.status_code == 409:
            assert_in_flight(response)
        elif response is not ran[0]:
            assert_replay(response, ran[0])
    return ran[0]
