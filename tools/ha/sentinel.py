"""A Redis master and one replica under three Sentinels (Debian's ``redis-sentinel``), all
on this machine: the Redis store's Sentinel tests, and a campaign's ``--store sentinel``.

``SentinelTopology().start()`` (or ``with SentinelTopology() as topology:``) starts the
master and its replica (no persistence, as ``tools.redis_cluster.ReplicatedRedis``) and
three Sentinels that monitor them under the service name ``mymaster`` with quorum 2 and a
2 s ``down-after-milliseconds``, and returns once every Sentinel knows the other two and
the replica, and the replica is in sync. ``kill_primary()`` SIGKILLs the master and
returns once the Sentinels have promoted the replica and it accepts writes;
``failover()`` asks for a coordinated ``SENTINEL FAILOVER`` (nothing acknowledged is lost);
``restart(port)`` brings a killed node back, which the Sentinels turn into a replica of
the new master. ``cut_off()`` freezes the replica and drops its link, so that what the
master acknowledges meanwhile reaches no replica: the write a failover loses.

Ports: the master and replica on ``REDIS_SENTINEL_PORT`` and the next one (default
6393-6394), the Sentinels on ``SENTINEL_PORT`` and the next two (default 26393-26395).
Standalone: ``python -m tools.ha.sentinel start|status|failover|kill|stop`` (the
processes are daemons; ``start`` prints the store's URL).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tools.redis_cluster import HOST, _alive, _kill, _pid, _start_server, _wait, answers, client

SERVICE = "mymaster"
QUORUM = 2
# Not less: on a loaded host a Sentinel's link to a just-promoted master can miss 1 s of
# PINGs, and a second failover then promoted a replica restarted a moment before, still
# empty, and flushed the master that had taken the writes (docs/stores.md, Redis Sentinel).
DOWN_AFTER_MS = 2000
FAILOVER_TIMEOUT_MS = 5000
READY_WITHIN_SECONDS = 30.0


def _sentinel_binary() -> str:
    binary = shutil.which("redis-sentinel") or "/usr/bin/redis-sentinel"
    if not os.path.exists(binary):
        raise RuntimeError("redis-sentinel is not installed (apt-get install redis-sentinel)")
    return binary


@dataclass
class SentinelTopology:
    """A master, a replica and three Sentinels (see the module's docstring).

    ``directory`` holds each process's data, log and pidfile (and the Sentinels' rewritten
    configurations); a temporary one by default, removed by ``stop()``."""

    port: int = int(os.environ.get("REDIS_SENTINEL_PORT", "6393"))
    sentinel_port: int = int(os.environ.get("SENTINEL_PORT", "26393"))
    service: str = SERVICE
    directory: Path | None = None
    name: str = "sentinel"
    _keep: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix=f"idempotency-sentinel-{self.port}-"))
        else:
            self._keep = True

    # -- addresses ------------------------------------------------------------------------

    @property
    def redis_ports(self) -> tuple[int, int]:
        return (self.port, self.port + 1)

    @property
    def sentinel_ports(self) -> tuple[int, int, int]:
        return (self.sentinel_port, self.sentinel_port + 1, self.sentinel_port + 2)

    @property
    def sentinels(self) -> list[tuple[str, int]]:
        return [(HOST, port) for port in self.sentinel_ports]

    def url(self, db: int = 0) -> str:
        """The Redis store's URL: ``redis+sentinel://`` every Sentinel, the service, the db."""
        hosts = ",".join(f"{host}:{port}" for host, port in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}/{db}"

    @property
    def env(self) -> dict[str, str]:
        """``example_project/settings.py``'s Redis store on this topology."""
        return {"EXAMPLE_REDIS_URL": self.url()}

    def _dir(self, what: str) -> Path:
        assert self.directory is not None
        return self.directory / what

    # -- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> SentinelTopology:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> SentinelTopology:
        """Starts what is not running (a node that answers on its port is taken to be ours
        from an earlier ``start`` with the same directory), then waits until the whole
        topology is ready."""
        master, replica = self.redis_ports
        for port in (*self.redis_ports, *self.sentinel_ports):
            if answers(port) and not self._pidfile(port).exists():
                raise RuntimeError(f"port {port} is taken by a Redis that is not ours")
        sync = ("--appendonly", "no", "--repl-diskless-sync-delay", "0")
        if not answers(master):
            _start_server(master, self._dir(str(master)), *sync)
        if not answers(replica):
            _start_server(replica, self._dir(str(replica)), *sync, "--replicaof", HOST, str(master))
        for port in self.sentinel_ports:
            if not answers(port):
                self._start_sentinel(port, master)
        self.wait_ready()
        return self

    def _pidfile(self, port: int) -> Path:
        return self._dir(str(port)) / (
            "sentinel.pid" if port in self.sentinel_ports else "redis.pid"
        )

    def _start_sentinel(self, port: int, master: int) -> None:
        directory = self._dir(str(port))
        directory.mkdir(parents=True, exist_ok=True)
        config = directory / "sentinel.conf"
        config.write_text(
            "\n".join(
                [
                    f"port {port}",
                    f"bind {HOST}",
                    "daemonize yes",
                    f"pidfile {directory / 'sentinel.pid'}",
                    f"logfile {directory / 'sentinel.log'}",
                    f"dir {directory}",
                    f"sentinel monitor {self.service} {HOST} {master} {QUORUM}",
                    f"sentinel down-after-milliseconds {self.service} {DOWN_AFTER_MS}",
                    f"sentinel failover-timeout {self.service} {FAILOVER_TIMEOUT_MS}",
                    f"sentinel parallel-syncs {self.service} 1",
                    "",
                ]
            )
        )
        subprocess.run([_sentinel_binary(), str(config)], check=True, timeout=10)
        _wait(lambda: answers(port), f"redis-sentinel on port {port} answering")

    def _master_state(self, port: int) -> dict[str, str]:
        with client(port) as connection:
            return dict(connection.sentinel_master(self.service))

    def wait_ready(self, within: float = READY_WITHIN_SECONDS) -> None:
        """Until every Sentinel agrees on the master, knows the other two Sentinels and a
        replica, and the replica acknowledges the master's writes (``WAIT 1``)."""

        def ready() -> bool:
            states = [self._master_state(port) for port in self.sentinel_ports]
            masters = {(state["ip"], int(state["port"])) for state in states}
            if len(masters) != 1:
                return False
            if any(
                int(state["num-other-sentinels"]) != 2
                or int(state["num-slaves"]) < 1
                or state["flags"] != "master"
                for state in states
            ):
                return False
            if not all(self._replica_good(port) for port in self.sentinel_ports):
                return False
            ((_, port),) = masters
            with client(port) as connection:
                if connection.info("replication")["role"] != "master":
                    return False
                connection.set("sentinel-topology:probe", "1")
                return int(connection.execute_command("WAIT", 1, 200)) == 1

        _wait(ready, "three Sentinels agreeing on a master with a replica in sync", within)

    def _replica_good(self, port: int) -> bool:
        """The Sentinel on ``port`` sees a replica it could promote: up, linked to the
        master (a node just restarted is flagged down until the Sentinel hears from it)."""
        with client(port) as connection:
            replicas = connection.sentinel_slaves(self.service)
        return any(
            replica["flags"] == "slave" and replica.get("master-link-status") == "ok"
            for replica in replicas
        )

    def stop(self) -> None:
        """Kills every process (a frozen replica is resumed first) and removes the
        directory unless it was given."""
        for port in (*self.sentinel_ports, *self.redis_ports):
            pid = self._pid_of(port)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            _kill(port, self._dir(str(port)))
            if pid is not None and _alive(pid):  # answers() was already false: a pidfile's
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if not self._keep and self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)

    def _pid_of(self, port: int) -> int | None:
        if answers(port):
            return _pid(port, self._dir(str(port)))
        try:
            return int(self._pidfile(port).read_text().strip())
        except (OSError, ValueError):
            return None

    # -- who is the master ----------------------------------------------------------------

    def master(self) -> int:
        """The master's port, as the first Sentinel that answers sees it."""
        for port in self.sentinel_ports:
            with contextlib.suppress(redis.RedisError, OSError):
                with client(port) as connection:
                    _, master_port = connection.sentinel_get_master_addr_by_name(self.service)
                return int(master_port)
        raise RuntimeError("no Sentinel answers")

    def replica(self) -> int:
        """The other node's port."""
        master = self.master()
        return next(port for port in self.redis_ports if port != master)

    def _promoted(self, old: int) -> bool:
        """Every Sentinel names a master other than ``old``, sees it up (no failover or
        link still pending), and it accepts writes."""
        ports = set()
        for port in self.sentinel_ports:
            state = self._master_state(port)
            if state["flags"] != "master":
                return False
            ports.add(int(state["port"]))
        if len(ports) != 1 or old in ports:
            return False
        (new,) = ports
        with client(new) as connection:
            connection.set("sentinel-topology:probe", "1")
        return True

    # -- faults ---------------------------------------------------------------------------

    def kill_primary(self, within: float = READY_WITHIN_SECONDS, *, rejoin: bool = True) -> str:
        """SIGKILLs the master; returns (``host:port``) once every Sentinel names its
        promoted replica and it accepts writes, after the killed node is started again
        as a replica of the new master (what a campaign that kills again later needs;
        ``rejoin=False``: it stays down until ``restart``)."""
        old = self.master()
        self.kill(old)
        promoted = self.wait_promoted(old, within)
        if rejoin:
            self.restart(old, within)
        return promoted

    def kill(self, port: int) -> None:
        """SIGKILLs the node on ``port`` and waits until it no longer answers."""
        _kill(port, self._dir(str(port)))

    def wait_promoted(self, old: int, within: float = READY_WITHIN_SECONDS) -> str:
        """Until every Sentinel names a master other than ``old`` that accepts writes."""
        _wait(lambda: self._promoted(old), f"the replica of {old} promoted", within)
        return f"{HOST}:{self.master()}"

    def failover(self, within: float = READY_WITHIN_SECONDS) -> str:
        """A switch-over that loses nothing acknowledged: the master's writes are paused
        (``CLIENT PAUSE … WRITE``, as Redis's own ``FAILOVER`` does), the replica catches
        up, the Sentinels promote it (``SENTINEL FAILOVER``), and the old master is
        resumed only once it is demoted (``REPLICAOF`` the new one, its clients
        disconnected, as the Sentinels do), so a write held meanwhile is refused
        rather than acknowledged and lost. ``SENTINEL FAILOVER`` alone does not pause,
        and the Sentinels demote a live old master only when their next ``INFO`` of it
        (every 10 s) shows it still a master: what it acknowledges until then is lost.
        Returns the new master (``host:port``)."""
        old = self.master()
        with client(old) as connection:
            connection.execute_command("CLIENT PAUSE", FAILOVER_TIMEOUT_MS, "WRITE")
        try:
            _wait(lambda: self._caught_up(old), f"the replica of {old} caught up", within)

            def asked() -> bool:
                # NOGOODSLAVE until the Sentinel has fresh news of the replica: ask again.
                with client(self.sentinel_ports[0]) as connection:
                    return bool(connection.execute_command("SENTINEL FAILOVER", self.service))

            _wait(asked, "a Sentinel accepting SENTINEL FAILOVER", within)
            promoted = self.wait_promoted(old, within)
            # The Sentinels would demote the old master only once their next INFO shows
            # it still claims to be one (up to 10 s): demote it now, as they will.
            new_host, _, new_port = promoted.rpartition(":")
            with client(old) as connection:
                connection.execute_command("REPLICAOF", new_host, new_port)
                connection.execute_command("CLIENT KILL TYPE normal SKIPME yes")
            _wait(lambda: self._role(old) == "slave", f"{old} demoted", within)
        finally:
            with contextlib.suppress(redis.RedisError, OSError), client(old) as connection:
                connection.execute_command("CLIENT UNPAUSE")
        return promoted

    def _caught_up(self, port: int) -> bool:
        with client(port) as connection:
            info = connection.info("replication")
        replica = info.get("slave0")
        return isinstance(replica, dict) and int(replica["offset"]) == int(
            info["master_repl_offset"]
        )

    def _role(self, port: int) -> str:
        with client(port) as connection:
            return str(connection.info("replication")["role"])

    def restart(self, port: int, within: float = READY_WITHIN_SECONDS) -> None:
        """Starts the killed node on ``port`` again, as a replica of the current master
        (the Sentinels would make it one anyway), and waits until it is in sync."""
        if not answers(port):
            master = self.master()
            _start_server(
                port,
                self._dir(str(port)),
                "--appendonly", "no",
                "--repl-diskless-sync-delay", "0",
                "--replicaof", HOST, str(master),
            )  # fmt: skip
        self.wait_ready(within)

    @contextlib.contextmanager
    def cut_off(self) -> Iterator[int]:
        """Freezes the replica (SIGSTOP) and drops its link until the block ends: what the
        master acknowledges meanwhile reaches no replica (the replication stream would
        otherwise wait in the frozen replica's socket). Yields the replica's port."""
        replica = self.replica()
        pid = self._pid_of(replica)
        assert pid is not None, "the replica is not running"
        os.kill(pid, signal.SIGSTOP)
        try:
            with client(self.master()) as connection:
                connection.execute_command("CLIENT KILL TYPE replica")
            yield replica
        finally:
            os.kill(pid, signal.SIGCONT)

    def get(self, port: int, key: str | bytes) -> bytes | None:
        """``key`` as the node on ``port`` has it."""
        with client(port) as connection:
            value = connection.get(key)
        return None if value is None else bytes(value)

    def status(self) -> dict[str, object]:
        """Each node's role and each Sentinel's view of the master, for humans."""
        report: dict[str, object] = {}
        for port in self.redis_ports:
            try:
                with client(port) as connection:
                    report[f"redis {port}"] = connection.info("replication")["role"]
            except (redis.RedisError, OSError):
                report[f"redis {port}"] = "down"
        for port in self.sentinel_ports:
            try:
                state = self._master_state(port)
                report[f"sentinel {port}"] = (
                    f"master {state['ip']}:{state['port']} ({state['flags']})"
                )
            except (redis.RedisError, OSError):
                report[f"sentinel {port}"] = "down"
        return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.ha.sentinel")
    parser.add_argument("command", choices=["start", "stop", "status", "failover", "kill"])
    parser.add_argument(
        "--directory",
        type=Path,
        default=Path(tempfile.gettempdir()) / "idempotency-sentinel",
        help="where the processes keep their data, logs and pidfiles",
    )
    args = parser.parse_args(argv)
    topology = SentinelTopology(directory=args.directory)
    if args.command == "start":
        started = time.monotonic()
        topology.start()
        print(f"Sentinel topology ready ({time.monotonic() - started:.1f} s): {topology.url()}")
    elif args.command == "stop":
        topology.stop()
        print("Sentinel topology stopped")
    elif args.command == "failover":
        print(f"new master: {topology.failover()}")
    elif args.command == "kill":
        print(f"new master: {topology.kill_primary()}")
    else:
        print(json.dumps(topology.status(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
