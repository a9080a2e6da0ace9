"""The campaign's own store topologies: a database (PostgreSQL or MariaDB), a standalone
Redis, a Redis Cluster. Each implements ``topology.Topology``.

The database topologies use the shared server (``--database-url``) by default: stalls
(a locked records table) and terminated connections need nothing of their own. A restart
does: ``--own-server`` starts a PostgreSQL (``initdb`` + ``pg_ctl`` as the ``postgres``
user) or a MariaDB (``mariadb-install-db`` + ``mariadbd``) of the campaign's own, on its own
port and data directory, which the ``restart`` fault stops and starts again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tools.server import Database, connect, database, drop_database, query

RECORDS = "idempotency_django_idempotencyrecord"
OWN_POSTGRES_PORT = 8450  # within the campaign's range; PostgreSQL listens on 127.0.0.1 only
OWN_MARIADB_PORT = 8451
CLUSTER_PORT = int(os.environ.get("CAMPAIGN_CLUSTER_PORT", "7440"))
CLUSTER_DIR = os.environ.get("CAMPAIGN_CLUSTER_DIR", "/tmp/cluster-camp")


def cluster_env() -> None:
    """Point ``tools.redis_cluster`` at the campaign's own cluster (its ports and data
    directory); called by the entry points before anything imports it."""
    os.environ["REDIS_CLUSTER_PORT"] = str(CLUSTER_PORT)
    os.environ["REDIS_CLUSTER_DIR"] = CLUSTER_DIR


def _hold(seconds: float, statements: list[str], db: Database) -> None:
    """Run ``statements`` in one transaction on a connection of our own, hold it
    ``seconds``, roll back: a lock every app statement on the table waits behind."""
    with connect(db, db.name, autocommit=False) as conn:
        with conn.cursor() as cursor:
            for statement in statements:
                cursor.execute(statement)
        time.sleep(seconds)  # the stall's length is the fault
        conn.rollback()


class DatabaseTopology:
    """The database store on PostgreSQL or MariaDB."""

    def __init__(self, vendor: str, url: str | None = None, *, own_server: bool = False) -> None:
        self.vendor = vendor  # "postgres" or "mariadb"
        self.name = vendor
        self.own_server = own_server
        self._server: OwnServer | None = None
        default = {
            "postgres": "postgres://root@127.0.0.1:5432/camp_pg",
            "mariadb": "mysql://root@127.0.0.1:3306/camp_my",
        }[vendor]
        self.url = url or default
        self.env: dict[str, str] = {}
        self.faults = frozenset({"stall", "terminate", *(["restart"] if own_server else [])})
        self.db: Database | None = None

    def start(self) -> None:
        if self.own_server:
            self._server = OwnServer(self.vendor)
            self.url = self._server.start()
        self.db = database(self.url)
        self.env = {"DATABASE_URL": self.url}

    def stop(self) -> None:
        if self.db is not None and self._server is None:
            with contextlib.suppress(Exception):
                drop_database(self.db)
        if self._server is not None:
            self._server.stop()
            self._server = None

    def inject(self, fault: str, seconds: float) -> str:
        assert self.db is not None
        if fault == "stall":
            if self.db.vendor == "postgresql":
                statements = [f"LOCK TABLE {RECORDS} IN ACCESS EXCLUSIVE MODE"]
            else:
                # Held until the connection closes (``_hold``'s ``with``), rollback or not.
                statements = [f"LOCK TABLES {RECORDS} WRITE"]
            _hold(seconds, statements, self.db)
            return f"records table locked {seconds:.1f} s"
        if fault == "terminate":
            return f"terminated {self.terminate()} app connections"
        if fault == "restart":
            assert self._server is not None
            return self._server.restart(seconds)
        raise ValueError(f"{self.name} has no fault {fault!r}")

    def terminate(self) -> int:
        assert self.db is not None
        if self.db.vendor == "postgresql":
            rows = query(
                self.db,
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()",
                [self.db.name],
            )
            return len(rows)
        ids = [
            row[0]
            for row in query(
                self.db,
                "SELECT id FROM information_schema.processlist "
                "WHERE db = %s AND id <> CONNECTION_ID()",
                [self.db.name],
            )
        ]
        for ident in ids:
            with contextlib.suppress(Exception):
                query(self.db, f"KILL CONNECTION {int(ident)}")
        return len(ids)


class OwnServer:
    """A PostgreSQL or MariaDB server of the campaign's own, for restart faults."""

    def __init__(self, vendor: str) -> None:
        self.vendor = vendor
        self.directory = Path(tempfile.mkdtemp(prefix=f"camp-{vendor}-"))
        self.directory.chmod(0o777)
        self.process: subprocess.Popen[bytes] | None = None

    def _as_postgres(self, *args: str) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *args] if os.geteuid() == 0 else list(args)

    def _pg_bin(self, name: str) -> str:
        found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
        if not found:
            raise RuntimeError(f"no PostgreSQL {name} under /usr/lib/postgresql")
        return str(found[-1])

    def start(self) -> str:
        if self.vendor == "postgres":
            data = self.directory / "data"
            subprocess.run(
                self._as_postgres(
                    self._pg_bin("initdb"), "-D", str(data), "-A", "trust", "-U", "root"
                ),
                check=True,
                capture_output=True,
                timeout=120,
            )
            self._start()
            return f"postgres://root@127.0.0.1:{OWN_POSTGRES_PORT}/camp_own"
        data = self.directory / "data"
        subprocess.run(
            [
                "mariadb-install-db",
                "--no-defaults",
                f"--datadir={data}",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
                "--user=root" if os.geteuid() == 0 else f"--user={os.getlogin()}",
            ],
            check=True,
            capture_output=True,
            timeout=180,
        )
        self._start()
        return f"mysql://root@127.0.0.1:{OWN_MARIADB_PORT}/camp_own"

    def _start(self) -> None:
        if self.vendor == "postgres":
            subprocess.run(
                self._as_postgres(
                    self._pg_bin("pg_ctl"),
                    "-D", str(self.directory / "data"),
                    "-l", str(self.directory / "server.log"),
                    "-o",
                    f"-p {OWN_POSTGRES_PORT} -k {self.directory} "
                    "-c listen_addresses=127.0.0.1",
                    "-w", "start",
                ),
                check=True,
                capture_output=True,
                timeout=60,
            )  # fmt: skip
        else:
            log = (self.directory / "server.log").open("ab")
            self.process = subprocess.Popen(
                [
                    "mariadbd",
                    "--no-defaults",
                    f"--datadir={self.directory / 'data'}",
                    f"--port={OWN_MARIADB_PORT}",
                    "--bind-address=127.0.0.1",
                    f"--socket={self.directory / 'mysqld.sock'}",
                    "--user=root",
                    "--innodb-buffer-pool-size=64M",
                    "--skip-log-bin",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        url = (
            f"postgres://root@127.0.0.1:{OWN_POSTGRES_PORT}/postgres"
            if self.vendor == "postgres"
            else f"mysql://root@127.0.0.1:{OWN_MARIADB_PORT}/mysql"
        )
        while True:
            try:
                query(database(url), "SELECT 1")
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)  # polling the server is the readiness check

    def _stop(self, how: str = "fast") -> None:
        if self.vendor == "postgres":
            subprocess.run(
                self._as_postgres(
                    self._pg_bin("pg_ctl"), "-D", str(self.directory / "data"), "-m", how, "stop"
                ),
                capture_output=True,
                timeout=60,
                check=False,
            )
        elif self.process is not None:
            self.process.send_signal(signal.SIGKILL if how == "immediate" else signal.SIGTERM)
            self.process.wait(60)
            self.process = None

    def restart(self, seconds: float) -> str:
        started = time.monotonic()
        self._stop("immediate")
        time.sleep(seconds)  # the outage's length is the fault
        self._start()
        took = time.monotonic() - started
        return f"{self.vendor} killed, down {seconds:.1f} s, back in {took:.1f} s"

    def stop(self) -> None:
        self._stop("immediate")
        shutil.rmtree(self.directory, ignore_errors=True)


class RedisTopology:
    """A standalone ``redis-server`` of the campaign's own (AOF ``everysec``), on a port of
    the campaign's range: stalls (``CLIENT PAUSE``, ``DEBUG SLEEP``), dropped connections,
    restarts."""

    name = "redis"
    faults = frozenset({"stall", "sleep", "terminate", "restart"})

    def __init__(self, port: int = 6440, appendfsync: str = "everysec") -> None:
        from tools.redis_cluster import StandaloneRedis

        self.server = StandaloneRedis(port=port, appendfsync=appendfsync)
        self.env: dict[str, str] = {}

    def start(self) -> None:
        self.server.start()
        with self._client() as client:
            client.flushall()
        self.env = {"EXAMPLE_REDIS_URL": self.server.url}

    def _client(self) -> Any:
        from tools.redis_cluster import client

        return client(self.server.port)

    def stop(self) -> None:
        self.server.stop()

    def inject(self, fault: str, seconds: float) -> str:
        if fault == "stall":
            with self._client() as client:
                client.execute_command("CLIENT", "PAUSE", int(seconds * 1000), "ALL")
            time.sleep(seconds)  # the pause runs on the server
            return f"CLIENT PAUSE {seconds:.1f} s"
        if fault == "sleep":
            # DEBUG SLEEP blocks the server's one thread; our connection waits with it.
            client_thread = threading.Thread(target=self._debug_sleep, args=(seconds,))
            client_thread.start()
            client_thread.join()
            return f"DEBUG SLEEP {seconds:.1f} s"
        if fault == "terminate":
            with self._client() as client:
                killed = client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            return f"CLIENT KILL TYPE normal: {killed} connections"
        if fault == "restart":
            self.server.kill()
            time.sleep(seconds)  # the outage's length is the fault
            self.server.start()
            return f"redis SIGKILL, down {seconds:.1f} s, restarted (AOF everysec)"
        raise ValueError(f"redis has no fault {fault!r}")

    def _debug_sleep(self, seconds: float) -> None:
        import redis

        with (
            redis.Redis(port=self.server.port, socket_timeout=seconds + 10) as client,
            contextlib.suppress(redis.ResponseError),  # DEBUG disabled: not a stall
        ):
            client.execute_command("DEBUG", "SLEEP", seconds)


class ClusterTopology:
    """A Redis Cluster of three masters and three replicas (``tools.redis_cluster``, on
    ``REDIS_CLUSTER_PORT``, default 7440 here): a master killed (its replica promoted) and
    brought back, with or without ``WAIT_REPLICAS``."""

    faults = frozenset({"failover", "stall"})

    def __init__(self, wait_replicas: int = 0) -> None:
        from tools import redis_cluster

        # tools.redis_cluster reads its ports when first imported: the entry points set
        # them (``cluster_env``) before anything imports it. Never another's cluster: this
        # one is flushed, its masters killed, and it is removed at the end.
        if redis_cluster.PORTS[0] != CLUSTER_PORT or str(redis_cluster.DIRECTORY) != CLUSTER_DIR:
            raise RuntimeError(
                f"the campaign's cluster is {CLUSTER_PORT}-{CLUSTER_PORT + 5} in {CLUSTER_DIR}, "
                f"but tools.redis_cluster was imported with {redis_cluster.PORTS[0]} in "
                f"{redis_cluster.DIRECTORY}: set REDIS_CLUSTER_PORT and REDIS_CLUSTER_DIR first"
            )
        self.wait_replicas = wait_replicas
        self.name = "cluster" + (f"+wait{wait_replicas}" if wait_replicas else "")
        self.env: dict[str, str] = {}

    def start(self) -> None:
        from tools import redis_cluster

        url = redis_cluster.start_cluster()
        redis_cluster.flush_cluster()
        self.env = {"EXAMPLE_REDIS_URL": url.replace("redis://", "redis+cluster://")}
        if self.wait_replicas:
            self.env["CAMPAIGN_REDIS_WAIT_REPLICAS"] = str(self.wait_replicas)

    def stop(self) -> None:
        from tools import redis_cluster

        redis_cluster.stop_cluster()

    def inject(self, fault: str, seconds: float) -> str:
        from tools import redis_cluster

        if fault == "failover":
            started = time.monotonic()
            victim = redis_cluster.masters()[0]
            promoted = redis_cluster.kill_master(victim.port)
            took = time.monotonic() - started
            redis_cluster.restart_node(victim.port)
            redis_cluster.wait_healthy()
            return (
                f"SIGKILL master {victim.port}, replica {promoted.port} promoted in "
                f"{took:.1f} s, {victim.port} back as a replica"
            )
        if fault == "stall":
            port = redis_cluster.masters()[0].port
            with redis_cluster.client(port) as client:
                client.execute_command("CLIENT", "PAUSE", int(seconds * 1000), "ALL")
            time.sleep(seconds)
            return f"CLIENT PAUSE {seconds:.1f} s on master {port}"
        raise ValueError(f"cluster has no fault {fault!r}")
