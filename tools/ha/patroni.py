"""PostgreSQL with a streaming replica under Patroni (Debian's ``patroni`` and
``etcd-server``), on this machine: what a failover of the database store's primary loses.

``PatroniTopology(sync=True)`` (a context manager) starts one etcd member and two
PostgreSQL nodes, each under a Patroni of its own (configurations generated into a
directory of its own; Patroni and PostgreSQL run as the ``postgres`` user, since
PostgreSQL refuses root), and returns once one node leads, the other streams from it, and
the database ``DATABASE`` exists. ``sync=True`` is Patroni's ``synchronous_mode``:
Patroni names the replica in ``synchronous_standby_names`` and ``synchronous_commit`` is
``on``, so a commit returns once the replica has flushed it, and only that replica may be
promoted. When the replica is gone, Patroni turns synchronous replication off and the
primary commits alone (and then refuses to promote the replica, which may lack those
commits), unless ``strict=True`` (``synchronous_mode_strict``): commits then wait for a
replica. ``sync=False``: asynchronous streaming, the default of most installations.

``env`` reaches the current primary whichever node it is (libpq's multi-host form,
``target_session_attrs=read-write``: a standby is skipped); ``kill_primary()`` SIGKILLs
the leader's Patroni and PostgreSQL (a crashed host) and returns once the other node
leads and accepts writes; ``failover()`` is Patroni's clean switch-over
(``POST /switchover``); ``restart(name)`` brings a killed node back, as a replica (after
``pg_rewind`` when its timeline diverged).

Ports: etcd ``ETCD_PORT`` (client; peer + 10; default 2390), PostgreSQL ``PATRONI_PG_PORT``
and the next one (default 5490-5491), Patroni's REST API ``PATRONI_REST_PORT`` and the next
one (default 8490-8491). Standalone: ``python -m tools.ha.patroni start|status|stop``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

HOST = "127.0.0.1"
SCOPE = "idempotency-ha"
DATABASE = "idempotency"
USER = "postgres"
READY_WITHIN_SECONDS = 90.0
TTL = 10  # seconds a leader's key outlives its last renewal: a killed leader is replaced after
LOOP_WAIT = 1
LEADER_ROLES = ("leader", "master", "primary")  # Patroni's name for it changed over versions


def _wait(check: Callable[[], bool], what: str, within: float = READY_WITHIN_SECONDS) -> None:
    deadline = time.monotonic() + within
    while True:
        with contextlib.suppress(OSError, psycopg.Error, urllib.error.URLError, ValueError):
            if check():
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"Patroni: {what} not reached within {within:.0f} s")
        time.sleep(0.1)


def _bin_dir() -> Path:
    """The newest installed PostgreSQL's binaries (Debian: /usr/lib/postgresql/<major>/bin)."""
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/postgres"),
        key=lambda path: int(path.parent.parent.name),
    )
    if not found:
        raise RuntimeError("no PostgreSQL server binaries (apt-get install postgresql)")
    return found[-1].parent


def _binary(name: str) -> str:
    path = shutil.which(name) or f"/usr/bin/{name}"
    if not os.path.exists(path):
        raise RuntimeError(f"{name} is not installed (apt-get install patroni etcd-server)")
    return path


@dataclass
class Node:
    name: str
    pg_port: int
    rest_port: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.pg_port}"


@dataclass
class PatroniTopology:
    """etcd, and two PostgreSQL nodes under Patroni (see the module's docstring)."""

    sync: bool = True
    strict: bool = False
    etcd_port: int = int(os.environ.get("ETCD_PORT", "2390"))
    pg_port: int = int(os.environ.get("PATRONI_PG_PORT", "5490"))
    rest_port: int = int(os.environ.get("PATRONI_REST_PORT", "8490"))
    directory: Path | None = None
    name: str = "patroni"
    nodes: list[Node] = field(default_factory=list)
    _etcd: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="ha-patroni-"))
        self.nodes = [
            Node(f"node{index + 1}", self.pg_port + index, self.rest_port + index)
            for index in range(2)
        ]

    # -- what the app is given ------------------------------------------------------------

    @property
    def hosts(self) -> str:
        return ",".join(HOST for _ in self.nodes)

    @property
    def ports(self) -> str:
        return ",".join(str(node.pg_port) for node in self.nodes)

    def url(self, database: str = DATABASE) -> str:
        """A ``DATABASE_URL`` that reaches the current primary: libpq tries each host in
        turn and keeps the first that accepts writes (``target_session_attrs``). The
        hosts go in the query string: ``dj_database_url`` cannot parse a list of them in
        the URL's authority, and Django's ``HOST`` would override them, so it is left
        empty."""
        return (
            f"postgres://{USER}@/{database}?host={self.hosts}&port={self.ports}"
            "&target_session_attrs=read-write&connect_timeout=2"
        )

    def conninfo(self, database: str = DATABASE) -> str:
        return (
            f"host={self.hosts} port={self.ports} user={USER} dbname={database} "
            "target_session_attrs=read-write connect_timeout=2"
        )

    def databases_setting(self, database: str = DATABASE) -> dict[str, Any]:
        """Django's ``DATABASES["default"]`` for the current primary."""
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": database,
            "USER": USER,
            "HOST": "",
            "PORT": "",
            "OPTIONS": {
                "host": self.hosts,
                "port": self.ports,
                "target_session_attrs": "read-write",
                "connect_timeout": 2,
            },
        }

    @property
    def env(self) -> dict[str, str]:
        """``example_project/settings.py``'s database on this topology."""
        return {"DATABASE_URL": self.url()}

    # -- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> PatroniTopology:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _path(self, *parts: str) -> Path:
        assert self.directory is not None
        return self.directory.joinpath(*parts)

    def start(self) -> PatroniTopology:
        account = pwd.getpwnam(USER)
        assert self.directory is not None
        os.chown(self.directory, account.pw_uid, account.pw_gid)
        self._start_etcd()
        for node in self.nodes:
            self._write_config(node)
            self._start_node(node)
        self.wait_ready()
        with self.connect("postgres") as connection:
            connection.autocommit = True
            exists = connection.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)
            ).fetchone()
            if not exists:
                connection.execute(f'CREATE DATABASE "{DATABASE}"')
        return self

    def _start_etcd(self) -> None:
        data = self._path("etcd")
        client = f"http://{HOST}:{self.etcd_port}"
        peer = f"http://{HOST}:{self.etcd_port + 10}"
        log = self._path("etcd.log").open("ab")
        self._etcd = subprocess.Popen(
            [
                _binary("etcd"),
                "--name", "ha",
                "--data-dir", str(data),
                "--listen-client-urls", client,
                "--advertise-client-urls", client,
                "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"ha={peer}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        _wait(lambda: _http_json(f"{client}/health").get("health") == "true", "etcd healthy")

    def _write_config(self, node: Node) -> None:
        account = pwd.getpwnam(USER)
        home = self._path(node.name)
        home.mkdir(exist_ok=True)
        os.chown(home, account.pw_uid, account.pw_gid)
        trust = [
            "local all all trust",
            f"host all all {HOST}/32 trust",
            f"host replication replicator {HOST}/32 trust",
        ]
        parameters: dict[str, Any] = {
            "wal_level": "replica",
            "hot_standby": "on",
            "max_wal_senders": 5,
            "max_replication_slots": 5,
            "wal_log_hints": "on",
            "max_connections": 100,
            "synchronous_commit": "on",
            "shared_buffers": "32MB",
            "fsync": "on",
        }
        config = {
            "scope": SCOPE,
            "name": node.name,
            "log": {"level": "WARNING", "dir": str(home)},
            "restapi": {
                "listen": f"{HOST}:{node.rest_port}",
                "connect_address": f"{HOST}:{node.rest_port}",
            },
            "etcd3": {"hosts": f"{HOST}:{self.etcd_port}"},
            "bootstrap": {
                "dcs": {
                    "ttl": TTL,
                    "loop_wait": LOOP_WAIT,
                    "retry_timeout": 3,
                    "maximum_lag_on_failover": 64 * 1024 * 1024,
                    "synchronous_mode": self.sync,
                    "synchronous_mode_strict": self.sync and self.strict,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "use_slots": True,
                        "parameters": parameters,
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}],
                "pg_hba": trust,
            },
            "postgresql": {
                "listen": f"{HOST}:{node.pg_port}",
                "connect_address": f"{HOST}:{node.pg_port}",
                "data_dir": str(home / "data"),
                "bin_dir": str(_bin_dir()),
                "pgpass": str(home / "pgpass"),
                "authentication": {
                    "superuser": {"username": USER, "password": "ha"},
                    "replication": {"username": "replicator", "password": "ha"},
                    "rewind": {"username": USER, "password": "ha"},
                },
                "parameters": {"unix_socket_directories": str(home)},
                "pg_hba": trust,
            },
            "tags": {"nofailover": False, "noloadbalance": False},
        }
        # JSON is YAML: no YAML writer needed.
        path = home / "patroni.yml"
        path.write_text(json.dumps(config, indent=2))
        os.chown(path, account.pw_uid, account.pw_gid)

    def _start_node(self, node: Node) -> None:
        account = pwd.getpwnam(USER)
        home = self._path(node.name)
        log = (home / "patroni.out").open("ab")
        os.chown(home / "patroni.out", account.pw_uid, account.pw_gid)
        node.process = subprocess.Popen(
            [_binary("patroni"), str(home / "patroni.yml")],
            user=account.pw_uid,
            group=account.pw_gid,
            env={"PATH": os.environ.get("PATH", ""), "HOME": str(home), "LC_ALL": "C.UTF-8"},
            cwd=home,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killed with its PostgreSQL
        )

    def wait_ready(self, within: float = READY_WITHIN_SECONDS) -> None:
        """Until one node leads and accepts writes, and every other streams from it (in
        sync mode: is the synchronous standby)."""

        def ready() -> bool:
            members = self.members()
            leaders = [m for m in members if m["role"] in LEADER_ROLES]
            standbys = [
                m
                for m in members
                if m["role"] in (("sync_standby",) if self.sync else ("replica", "sync_standby"))
                and m["state"] in ("running", "streaming")
            ]
            if len(leaders) != 1 or len(standbys) != len(self.nodes) - 1:
                return False
            with self.connect("postgres") as connection:
                return not _in_recovery(connection)

        _wait(ready, "a leader and a streaming replica", within)

    def stop(self) -> None:
        """SIGKILLs every process group (Patroni and its PostgreSQL), etcd, and removes
        the directory."""
        for node in self.nodes:
            self._kill(node)
        if self._etcd is not None:
            self._etcd.kill()
            self._etcd.wait(10)
            self._etcd = None
        # PostgreSQL may outlive its Patroni's group (a postmaster Patroni restarted)
        for node in self.nodes:
            self._kill_postmaster(node)
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)

    def _kill(self, node: Node) -> None:
        if node.process is not None and node.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.process.pid, signal.SIGKILL)
            node.process.wait(10)
        self._kill_postmaster(node)

    def _kill_postmaster(self, node: Node) -> None:
        pidfile = self._path(node.name, "data", "postmaster.pid")
        with contextlib.suppress(OSError, ValueError):
            pid = int(pidfile.read_text().split()[0])
            os.kill(pid, signal.SIGKILL)
            _wait(lambda: not _alive(pid), f"{node.name}'s PostgreSQL gone", 15)

    # -- who leads ------------------------------------------------------------------------

    def members(self) -> list[dict[str, Any]]:
        """Patroni's ``/cluster`` from the first node that answers."""
        for node in self.nodes:
            with contextlib.suppress(OSError, urllib.error.URLError, ValueError):
                members = _http_json(f"http://{HOST}:{node.rest_port}/cluster")["members"]
                return list(members)
        return []

    def leader(self) -> Node:
        for member in self.members():
            if member["role"] in LEADER_ROLES:
                return next(node for node in self.nodes if node.name == member["name"])
        raise RuntimeError("no leader")

    def connect(self, database: str = DATABASE) -> psycopg.Connection[Any]:
        return psycopg.connect(self.conninfo(database))

    def node_connect(self, node: Node, database: str = DATABASE) -> psycopg.Connection[Any]:
        """A connection to one node, primary or standby."""
        return psycopg.connect(
            host=HOST, port=node.pg_port, user=USER, dbname=database, connect_timeout=2
        )

    def _leads(self, node: Node) -> bool:
        leaders = [m["name"] for m in self.members() if m["role"] in LEADER_ROLES]
        if leaders != [node.name]:
            return False
        with self.node_connect(node, "postgres") as connection:
            return not _in_recovery(connection)

    # -- faults ---------------------------------------------------------------------------

    def kill_primary(self, within: float = READY_WITHIN_SECONDS, *, rejoin: bool = True) -> str:
        """SIGKILLs the leader's Patroni and PostgreSQL, as a host that dies; returns the
        new primary (``host:port``) once the other node leads (after the leader key's
        ``TTL``) and accepts writes, after the killed node is started again and streams
        from the new primary (after ``pg_rewind``; ``rejoin=False``: it stays down until
        ``restart``)."""
        old = self.leader()
        self._kill(old)
        survivor = next(node for node in self.nodes if node.name != old.name)
        _wait(lambda: self._leads(survivor), f"{survivor.name} promoted", within)
        if rejoin:
            self.restart(old.name, within)
        return survivor.address

    def failover(self, within: float = READY_WITHIN_SECONDS) -> str:
        """Patroni's switch-over: the leader hands over to the replica (in sync mode, the
        synchronous standby: nothing committed is lost). Returns the new primary."""
        old = self.leader()
        target = next(node for node in self.nodes if node.name != old.name)
        body = json.dumps({"leader": old.name, "candidate": target.name}).encode()
        request = urllib.request.Request(
            f"http://{HOST}:{old.rest_port}/switchover",
            data=body,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
        _wait(lambda: self._leads(target), f"a switch-over to {target.name}", within)
        return target.address

    def restart(self, name: str, within: float = READY_WITHIN_SECONDS) -> None:
        """Starts a killed node's Patroni again; it rejoins as a replica."""
        node = next(node for node in self.nodes if node.name == name)
        if node.process is None or node.process.poll() is not None:
            self._start_node(node)
        self.wait_ready(within)

    def status(self) -> list[dict[str, Any]]:
        return self.members()


def _in_recovery(connection: psycopg.Connection[Any]) -> bool:
    """Whether the server is a standby (``pg_is_in_recovery()``)."""
    row = connection.execute("SELECT pg_is_in_recovery()").fetchone()
    return bool(row and row[0])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1]
    except OSError:
        return False
    return state != "Z"


def _http_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=2) as response:
        data: dict[str, Any] = json.loads(response.read())
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.ha.patroni")
    parser.add_argument("command", choices=["start"])
    parser.add_argument("--async", dest="sync", action="store_false", help="no synchronous mode")
    args = parser.parse_args(argv)
    topology = PatroniTopology(sync=args.sync)
    started = time.monotonic()
    with topology:
        print(f"Patroni ready ({time.monotonic() - started:.1f} s): DATABASE_URL={topology.url()}")
        print(json.dumps(topology.status(), indent=2))
        print("Ctrl-C stops it")
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
