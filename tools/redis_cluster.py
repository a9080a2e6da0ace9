"""A local Redis Cluster (3 masters, 3 replicas on ports 7100-7105), a throwaway Redis, a
small cluster of masters only, and a throwaway master with one replica.

Tests import it; operators run ``python -m tools.redis_cluster start|stop|status``.
``start_cluster()`` reuses a healthy running cluster, restarts members that died (their
``nodes.conf`` is kept) and otherwise builds a fresh one with ``redis-cli --cluster create``;
it returns once every node agrees that ``cluster_state:ok`` and every replica is in sync.
The helpers drive what the cluster tests need to observe: a slot migration step by step
(``ASK`` while it runs, ``MOVED`` after), a master killed with SIGKILL until its replica is
promoted, a standalone ``redis-server`` killed and restarted, the whole cluster down
(``all_down``), a cluster of one or two masters that starts in seconds (``SmallCluster``),
and a replica frozen so that ``WAIT`` cannot be acknowledged (``ReplicatedRedis``). Nodes
run with AOF
(``appendfsync everysec``, the common production setting) and a 1 s node timeout, so a
failover takes a few seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

HOST = "127.0.0.1"
# REDIS_CLUSTER_PORT moves the six ports (and REDIS_CLUSTER_DIR their data): a cluster of
# one's own next to the shared one (``benchmarks/run.py`` runs its cluster on 7200-7205).
BASE_PORT = int(os.environ.get("REDIS_CLUSTER_PORT", "7100"))
PORTS = tuple(range(BASE_PORT, BASE_PORT + 6))
NODE_TIMEOUT_MS = 1000
READY_WITHIN_SECONDS = 30.0
DIRECTORY = Path(
    os.environ.get("REDIS_CLUSTER_DIR", Path(tempfile.gettempdir()) / "idempotency-redis-cluster")
)


def cluster_url() -> str:
    """The URL a client starts from (any node; the client discovers the rest)."""
    return f"redis://{HOST}:{PORTS[0]}/0"


def _wait(check: Callable[[], bool], what: str, within: float = READY_WITHIN_SECONDS) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            if check():
                return
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"Redis: {what} not reached within {within:.0f} s")
        time.sleep(0.05)


def client(port: int) -> redis.Redis:
    """A plain (non-cluster) connection to one node, with short timeouts.

    ``CLUSTER INFO`` and ``CLUSTER NODES`` come back as the server's text (parsed here).
    """
    connection = redis.Redis(
        host=HOST,
        port=port,
        socket_timeout=5,
        socket_connect_timeout=2,
        retry=Retry(NoBackoff(), 0),  # a node that is down is reported at once
    )
    for command in ("CLUSTER INFO", "CLUSTER NODES"):
        connection.response_callbacks.pop(command, None)
    return connection


def answers(port: int) -> bool:
    try:
        with client(port) as connection:
            return bool(connection.ping())
    except (redis.RedisError, OSError):
        return False


def _server_binary() -> str:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not os.path.exists(binary):
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    return binary


# --- one redis-server process ------------------------------------------------------------------


def _start_server(port: int, directory: Path, *extra: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            _server_binary(),
            "--port", str(port),
            "--bind", HOST,
            "--daemonize", "yes",
            "--dir", str(directory),
            "--pidfile", str(directory / "redis.pid"),
            "--logfile", str(directory / "redis.log"),
            "--save", "",
            *extra,
        ],
        check=True,
        timeout=10,
    )  # fmt: skip
    _wait(lambda: answers(port), f"redis-server on port {port} answering")


def _pid(port: int, directory: Path) -> int | None:
    """The server's own pid (it reports it), else its pidfile's."""
    try:
        with client(port) as connection:
            return int(connection.info("server")["process_id"])
    except (redis.RedisError, OSError):
        pass
    try:
        return int((directory / "redis.pid").read_text().strip())
    except (OSError, ValueError):
        return None


def _kill(port: int, directory: Path, sig: signal.Signals = signal.SIGKILL) -> None:
    """Sends ``sig`` to the server on ``port`` and waits until it no longer answers."""
    pid = _pid(port, directory)
    if pid is None:
        return
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return
    _wait(lambda: not answers(port) and not _alive(pid), f"port {port} down", within=15)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (our own child) is dead for our purposes.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1]
    except OSError:
        return False
    return state != "Z"


# --- the cluster ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    port: int
    id: str
    role: str  # "master" or "replica"
    master_id: str | None
    slots: tuple[tuple[int, int], ...]

    def owns(self, slot: int) -> bool:
        return any(low <= slot <= high for low, high in self.slots)


def _node_directory(port: int) -> Path:
    return DIRECTORY / str(port)


def _cluster_args() -> list[str]:
    return [
        "--cluster-enabled", "yes",
        "--cluster-config-file", "nodes.conf",
        "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
        # A replica always stands for election, however long it was cut off.
        "--cluster-replica-validity-factor", "0",
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        # A replica's full sync starts at once (the default waits 5 s for more replicas).
        "--repl-diskless-sync-delay", "0",
    ]  # fmt: skip


def start_node(port: int) -> None:
    """(Re)starts one member with its kept ``nodes.conf``: it rejoins the cluster it knew."""
    _start_server(port, _node_directory(port), *_cluster_args())


def kill_node(port: int) -> None:
    """SIGKILL: no shutdown, no last write to disk, no goodbye to the cluster."""
    _kill(port, _node_directory(port))


def topology(via: Iterable[int] = PORTS) -> list[Node]:
    """The cluster as the first node that answers sees it; failed nodes left out."""
    for port in via:
        try:
            with client(port) as connection:
                text = connection.execute_command("CLUSTER NODES")
        except (redis.RedisError, OSError):
            continue
        if isinstance(text, bytes):
            text = text.decode()
        return _parse_nodes(text)
    raise RuntimeError("no Redis Cluster node answers")


def _parse_nodes(text: str) -> list[Node]:
    nodes = []
    for line in text.strip().splitlines():
        fields = line.split()
        flags = fields[2].split(",")
        if "fail" in flags or "noaddr" in flags or "handshake" in flags:
            continue
        port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
        slots = []
        for item in fields[8:]:
            if item.startswith("["):  # a migration in progress, not ownership
                continue
            low, _, high = item.partition("-")
            slots.append((int(low), int(high or low)))
        role = "master" if "master" in flags else "replica"
        master_id = None if fields[3] == "-" else fields[3]
        nodes.append(Node(port, fields[0], role, master_id, tuple(slots)))
    return sorted(nodes, key=lambda node: node.port)


def masters() -> list[Node]:
    return [node for node in topology() if node.role == "master" and node.slots]


def owner(slot: int) -> Node:
    for node in masters():
        if node.owns(slot):
            return node
    raise RuntimeError(f"no master owns slot {slot}")


def replicas_of(master: Node) -> list[Node]:
    return [node for node in topology() if node.master_id == master.id]


def keyslot(key: str | bytes) -> int:
    with client(masters()[0].port) as connection:
        return int(connection.execute_command("CLUSTER KEYSLOT", key))


def _info(port: int) -> dict[str, str]:
    with client(port) as connection:
        text = connection.execute_command("CLUSTER INFO")
    if isinstance(text, bytes):
        text = text.decode()
    return dict(line.split(":", 1) for line in text.split() if ":" in line)


def _replica_in_sync(port: int) -> bool:
    with client(port) as connection:
        info = connection.info("replication")
    return info.get("role") != "slave" or info.get("master_link_status") == "up"


def healthy(ports: Iterable[int] = PORTS) -> bool:
    """Every node answers, sees all six and ``cluster_state:ok``; 3 masters, each replicated."""
    ports = tuple(ports)
    try:
        for port in ports:
            info = _info(port)
            if info.get("cluster_state") != "ok" or info.get("cluster_known_nodes") != "6":
                return False
            if info.get("cluster_slots_assigned") != "16384" or info.get("cluster_size") != "3":
                return False
            if not _replica_in_sync(port):
                return False
        nodes = topology(ports)
    except (redis.RedisError, OSError, RuntimeError):
        return False
    primaries = [node for node in nodes if node.role == "master" and node.slots]
    return len(nodes) == 6 and all(
        sum(node.master_id == primary.id for node in nodes) == 1 for primary in primaries
    )


def wait_healthy(within: float = READY_WITHIN_SECONDS) -> None:
    _wait(healthy, "cluster_state:ok on all six nodes, replicas in sync", within)


def start_cluster() -> str:
    """Reuses a healthy cluster, restarts dead members, else builds a new one; returns its URL."""
    if healthy():
        return cluster_url()
    if all((_node_directory(port) / "nodes.conf").exists() for port in PORTS):
        for port in PORTS:
            if not answers(port):
                start_node(port)
        try:
            wait_healthy(within=15)
            return cluster_url()
        except TimeoutError:
            pass
    stop_cluster()
    for port in PORTS:
        start_node(port)
    subprocess.run(
        [
            shutil.which("redis-cli") or "redis-cli",
            "--cluster", "create",
            *(f"{HOST}:{port}" for port in PORTS),
            "--cluster-replicas", "1",
            "--cluster-yes",
        ],
        check=True,
        timeout=60,
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    wait_healthy()
    return cluster_url()


def stop_cluster() -> None:
    """Kills every member and removes the data directory."""
    for port in PORTS:
        kill_node(port)
    shutil.rmtree(DIRECTORY, ignore_errors=True)


def flush_cluster() -> None:
    """Empties every master (replicas follow)."""
    for node in masters():
        with client(node.port) as connection:
            connection.flushall()


def status() -> str:
    lines = []
    for port in PORTS:
        if not answers(port):
            lines.append(f"{port}  down")
            continue
        state = _info(port).get("cluster_state", "?")
        lines.append(f"{port}  up  cluster_state:{state}")
    try:
        for node in topology():
            ranges = " ".join(f"{low}-{high}" for low, high in node.slots)
            master = f" of {node.master_id[:8]}" if node.master_id else ""
            lines.append(f"  {node.port} {node.id[:8]} {node.role}{master} {ranges}".rstrip())
    except RuntimeError as error:
        lines.append(f"  {error}")
    lines.append("healthy" if healthy() else "NOT healthy")
    return "\n".join(lines)


# --- failover ------------------------------------------------------------------------------------


def kill_master(port: int, within: float = READY_WITHIN_SECONDS) -> Node:
    """SIGKILLs the master on ``port`` and waits until its replica is promoted and serving.

    Returns the promoted node. The cluster is ``ok`` again when this returns (the killed node
    is known as failed); ``restart_node(port)`` brings it back as the new master's replica.
    """
    master = next(node for node in topology() if node.port == port)
    if master.role != "master":
        raise ValueError(f"port {port} is not a master")
    if not replicas_of(master):
        raise RuntimeError(f"master on port {port} has no replica to promote")
    kill_node(port)
    return wait_promoted(master, within)


def wait_promoted(master: Node, within: float = READY_WITHIN_SECONDS) -> Node:
    """Waits until another node serves ``master``'s slots and every live node says ``ok``."""
    survivors = [p for p in PORTS if p != master.port]

    def promoted() -> bool:
        live = [p for p in survivors if answers(p)]
        nodes = topology(live)
        return any(
            node.port != master.port and node.role == "master" and node.slots == master.slots
            for node in nodes
        ) and all(_info(p).get("cluster_state") == "ok" for p in live)

    _wait(promoted, f"a replica of {master.port} promoted", within)
    return next(
        node
        for node in topology([p for p in survivors if answers(p)])
        if node.port != master.port and node.slots == master.slots
    )


@contextlib.contextmanager
def replica_cut_off(master: Node) -> Iterator[Node]:
    """Freezes ``master``'s replica (SIGSTOP) and drops its link, until the block ends.

    What the master acknowledges meanwhile reaches no replica: kill the master inside the
    block and the replica, resumed on exit, is promoted without it (the write is lost, as
    in a failover that beat replication). Merely freezing is not enough: the replication
    stream would wait in the frozen replica's socket and be applied on resume.
    """
    (replica,) = replicas_of(master)
    with client(replica.port) as connection:
        pid = int(connection.info("server")["process_id"])
    os.kill(pid, signal.SIGSTOP)
    try:
        with client(master.port) as connection:
            connection.execute_command("CLIENT KILL TYPE replica")
        yield replica
    finally:
        os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def all_down(how: str = "kill") -> Iterator[None]:
    """Every member down until the block ends: killed (``"kill"``, SIGKILL: connections are
    refused) or frozen (``"stop"``, SIGSTOP: connections are accepted and never answered).
    Then restarted (their ``nodes.conf`` kept) or resumed, and the cluster healthy again."""
    if how not in ("kill", "stop"):
        raise ValueError(f"how is 'kill' or 'stop', not {how!r}")
    frozen: list[int] = []
    try:
        for port in PORTS:
            if how == "kill":
                kill_node(port)
                continue
            pid = _pid(port, _node_directory(port))
            if pid is not None:
                os.kill(pid, signal.SIGSTOP)
                frozen.append(pid)
        yield
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        for port in PORTS:
            if not answers(port):
                start_node(port)
        wait_healthy()


def restart_node(port: int, within: float = READY_WITHIN_SECONDS) -> None:
    """Restarts a killed member and waits until the cluster is whole and in sync again."""
    if not answers(port):
        start_node(port)
    wait_healthy(within)


# --- slot migration, step by step --------------------------------------------------------------


@dataclass
class SlotMigration:
    """Moves ``slot`` from its owner to ``target`` in the steps a resharding takes.

    ``begin()`` marks the slot IMPORTING on the target and MIGRATING on the source: from then
    on a key the source no longer holds is answered with ``ASK``. ``move_keys()`` moves the
    slot's keys (or the given ones) with ``MIGRATE``. ``finish()`` assigns the slot to the
    target on every master (``SETSLOT NODE``): a client with the old map then gets ``MOVED``.
    """

    slot: int
    source: Node
    target: Node

    @classmethod
    def of(cls, slot: int, target: Node | None = None) -> SlotMigration:
        source = owner(slot)
        if target is None:
            target = next(node for node in masters() if node.id != source.id)
        return cls(slot, source, target)

    def begin(self) -> None:
        with client(self.target.port) as connection:
            connection.execute_command("CLUSTER SETSLOT", self.slot, "IMPORTING", self.source.id)
        with client(self.source.port) as connection:
            connection.execute_command("CLUSTER SETSLOT", self.slot, "MIGRATING", self.target.id)

    def keys(self) -> list[bytes]:
        with client(self.source.port) as connection:
            return list(connection.execute_command("CLUSTER GETKEYSINSLOT", self.slot, 1000))

    def move_keys(self, keys: Iterable[str | bytes] | None = None) -> int:
        chosen = list(self.keys() if keys is None else keys)
        if not chosen:
            return 0
        with client(self.source.port) as connection:
            connection.execute_command(
                "MIGRATE", HOST, self.target.port, "", 0, 5000, "KEYS", *chosen
            )
        return len(chosen)

    def finish(self) -> None:
        """Assigns the slot to the target: first the target, then the source, then the rest."""
        self.move_keys()
        order = [self.target, self.source] + [
            node for node in masters() if node.id not in {self.target.id, self.source.id}
        ]
        for node in order:
            with client(node.port) as connection:
                connection.execute_command("CLUSTER SETSLOT", self.slot, "NODE", self.target.id)
        _wait(lambda: owner(self.slot).id == self.target.id, f"slot {self.slot} moved")
        wait_healthy()

    def run(self) -> None:
        self.begin()
        self.finish()


# --- a standalone redis-server on a throwaway port ----------------------------------------------


@dataclass
class StandaloneRedis:
    """A ``redis-server`` of our own (default port 6391, or ``REDIS_STANDALONE_PORT``) for
    kill-and-restart tests.

    ``appendfsync`` is ``None`` for no persistence at all (a restart comes back empty),
    else an AOF policy (``always``, ``everysec``): a restart replays the AOF.
    """

    port: int = int(os.environ.get("REDIS_STANDALONE_PORT", "6391"))
    appendfsync: str | None = None
    directory: Path | None = None

    def __post_init__(self) -> None:
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix=f"idempotency-redis-{self.port}-"))

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def _args(self) -> list[str]:
        if self.appendfsync is None:
            return ["--appendonly", "no"]
        return ["--appendonly", "yes", "--appendfsync", self.appendfsync]

    def start(self) -> StandaloneRedis:
        assert self.directory is not None
        if not answers(self.port):
            _start_server(self.port, self.directory, *self._args())
        return self

    def pid(self) -> int | None:
        assert self.directory is not None
        return _pid(self.port, self.directory)

    def kill(self) -> None:
        """SIGKILL, as a crash or an OOM kill would."""
        assert self.directory is not None
        _kill(self.port, self.directory)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        self.kill()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


@dataclass
class SmallCluster:
    """A Redis Cluster of masters only on ``ports`` (one will do), the slots shared out in
    order: a real cluster client's map, ``MOVED`` (``move_slot``), an outage (``kill``) and
    a return (``start``) in a few seconds, without the six nodes of ``start_cluster``.
    Nothing is persisted but each node's ``nodes.conf``: a restart comes back empty, with
    its slots."""

    ports: tuple[int, ...]
    directory: Path | None = None

    def __post_init__(self) -> None:
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix=f"idempotency-cluster-{self.ports[0]}-"))

    @property
    def url(self) -> str:
        return f"redis+cluster://{HOST}:{self.ports[0]}/0"

    def _directory(self, port: int) -> Path:
        assert self.directory is not None
        return self.directory / str(port)

    def start(self) -> SmallCluster:
        for port in self.ports:
            if not answers(port):
                _start_server(
                    port,
                    self._directory(port),
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                    "--appendonly", "no",
                )  # fmt: skip
        if _info(self.ports[0]).get("cluster_slots_assigned") == "0":
            share = 16384 // len(self.ports)
            for index, port in enumerate(self.ports):
                high = 16383 if index == len(self.ports) - 1 else (index + 1) * share - 1
                with client(port) as connection:
                    connection.execute_command("CLUSTER ADDSLOTSRANGE", index * share, high)
            with client(self.ports[0]) as connection:
                for port in self.ports[1:]:
                    connection.execute_command("CLUSTER MEET", HOST, port)
        _wait(self._ok, f"a cluster of {len(self.ports)} ok on every node")
        return self

    def _ok(self) -> bool:
        for port in self.ports:
            info = _info(port)
            if info.get("cluster_state") != "ok":
                return False
            if info.get("cluster_known_nodes") != str(len(self.ports)):
                return False
        return True

    def nodes(self) -> list[Node]:
        return topology(self.ports)

    def owner(self, key: str) -> Node:
        slot = keyslot_of(self.ports[0], key)
        return next(node for node in self.nodes() if node.owns(slot))

    def move_slot(self, slot: int, to_port: int) -> None:
        """Gives ``slot`` (no key in it) to the node on ``to_port``, as a resharding does:
        importing, migrating, then the new owner on both; a client whose map is older is
        answered ``MOVED``."""
        nodes = {node.port: node for node in self.nodes()}
        source = next(node for node in nodes.values() if node.owns(slot))
        target = nodes[to_port]
        with client(target.port) as connection:
            connection.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source.id)
        with client(source.port) as connection:
            connection.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", target.id)
        for port in (target.port, source.port):
            with client(port) as connection:
                connection.execute_command("CLUSTER SETSLOT", slot, "NODE", target.id)
        _wait(
            lambda: all(
                next(node for node in topology([port]) if node.owns(slot)).port == to_port
                for port in self.ports
            ),
            f"slot {slot} on port {to_port} for every node",
        )

    def kill(self) -> None:
        for port in self.ports:
            _kill(port, self._directory(port))

    def stop(self) -> None:
        self.kill()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


def free_port(cluster: bool = False) -> int:
    """A port nothing listens on now; for a cluster node, one whose bus port (``port`` +
    10000) is free and fits too."""
    for _ in range(1000):
        with socket.socket() as sock:
            sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
        if not cluster:
            return port
        if port + 10000 > 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((HOST, port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port for a cluster node")


def keyslot_of(port: int, key: str | bytes) -> int:
    """The slot of ``key``, as the node on ``port`` computes it."""
    with client(port) as connection:
        return int(connection.execute_command("CLUSTER KEYSLOT", key))


# --- a master and its replica on throwaway ports -------------------------------------------------


@dataclass
class ReplicatedRedis:
    """A ``redis-server`` master and one replica of our own, no persistence, for what
    ``WAIT`` can and cannot confirm (ports: ``IDEMPOTENCY_TEST_SCRATCH_PORT`` and
    ``IDEMPOTENCY_TEST_REPLICA_PORT``, default 6390 and 6392).

    ``frozen()`` stops the replica (SIGSTOP) for the length of a block: the master still
    counts it as connected, but it acknowledges nothing, so a ``WAIT 1`` for a write made
    meanwhile times out, and on resume it catches up and acknowledges."""

    port: int = int(os.environ.get("IDEMPOTENCY_TEST_SCRATCH_PORT", "6390"))
    replica_port: int = int(os.environ.get("IDEMPOTENCY_TEST_REPLICA_PORT", "6392"))
    directory: Path | None = None

    def __post_init__(self) -> None:
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix=f"idempotency-redis-{self.port}-"))

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def start(self) -> ReplicatedRedis:
        assert self.directory is not None
        for port in (self.port, self.replica_port):
            if answers(port):
                raise RuntimeError(f"port {port} is taken by a Redis that is not ours")
        sync = ("--appendonly", "no", "--repl-diskless-sync-delay", "0")
        _start_server(self.port, self.directory / "master", *sync)
        _start_server(
            self.replica_port,
            self.directory / "replica",
            *sync,
            "--replicaof",
            HOST,
            str(self.port),
        )
        self.wait_in_sync()
        return self

    def wait_in_sync(self) -> None:
        """Until the replica acknowledges a write of the master's (``WAIT 1``)."""

        def acknowledged() -> bool:
            with client(self.port) as connection:
                connection.set("replicated-redis:probe", "1")
                return int(connection.execute_command("WAIT", 1, 200)) == 1

        _wait(acknowledged, f"the replica on port {self.replica_port} in sync")

    def replica_pid(self) -> int:
        assert self.directory is not None
        pid = _pid(self.replica_port, self.directory / "replica")
        assert pid is not None, "the replica is not running"
        return pid

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        pid = self.replica_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def replica_get(self, key: str | bytes) -> bytes | None:
        with client(self.replica_port) as connection:
            value = connection.get(key)
        return None if value is None else bytes(value)

    def stop(self) -> None:
        assert self.directory is not None
        with contextlib.suppress(ProcessLookupError, AssertionError):
            os.kill(self.replica_pid(), signal.SIGCONT)  # a frozen one cannot die of SIGKILL
        _kill(self.replica_port, self.directory / "replica")
        _kill(self.port, self.directory / "master")
        shutil.rmtree(self.directory, ignore_errors=True)


# --- a Redis store's URL ------------------------------------------------------------------------


def connect(url: str, **options: object) -> redis.Redis | RedisCluster:
    """A client for a Redis store's URL (``redis+cluster://``: a cluster), as the store
    makes it (``store/redis_cluster.connect``, which needs Django's settings to import);
    ``options`` go to redis-py (``socket_timeout=None`` for a long ``BLPOP``: its default
    socket timeout is 5 s)."""
    scheme, _, rest = url.partition("://")
    if scheme.endswith("+cluster"):
        return RedisCluster.from_url(f"{scheme.removesuffix('+cluster')}://{rest}", **options)
    return redis.Redis.from_url(url, **options)


def flush(url: str) -> None:
    """Empties the database a Redis store's URL names (on every master of a cluster)."""
    client = connect(url)
    try:
        if isinstance(client, RedisCluster):
            client.flushdb(target_nodes=RedisCluster.PRIMARIES)
        else:
            client.flushdb()
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.redis_cluster")
    parser.add_argument("command", choices=["start", "stop", "status"])
    command = parser.parse_args(argv).command
    if command == "start":
        started = time.monotonic()
        url = start_cluster()
        print(f"Redis Cluster ready at {url} ({time.monotonic() - started:.1f} s)")
        return 0
    if command == "stop":
        stop_cluster()
        print("Redis Cluster stopped")
        return 0
    print(status())
    return 0 if healthy() else 1


if __name__ == "__main__":
    sys.exit(main())
