"""What the Redis store needs to run on a Redis Cluster, and the optional ``WAIT``.

``connect`` builds a ``RedisCluster`` client when the options say ``CLUSTER`` or the URL is
``redis+cluster://`` (redis-py follows ``MOVED`` and ``ASK`` and finds a promoted replica
itself); ``by_node`` and ``eval_per_node`` let the heartbeat renew a process's claims in one
round trip per node (a script may only touch keys of one slot there); ``write_and_wait``
sends a write and its ``WAIT`` on one connection. The long story: ``docs/stores.md``
("Redis Cluster and failover").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypeVar

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.commands.core import Script
from redis.exceptions import RedisClusterException

K = TypeVar("K", bound=Hashable)

REDIRECTIONS = 5
"""How many ``MOVED``/``ASK`` a write-and-wait follows (a migration finishing, then a
failover) before it gives up and lets the caller's error policy answer."""


CLUSTER_SCHEME = "+cluster"
"""``redis+cluster://`` and ``rediss+cluster://`` name a cluster in the URL alone, for
settings that hold one string (an environment variable, ``EXAMPLE_REDIS_URL``)."""


CLUSTER_URLS = ("redis+cluster://", "rediss+cluster://")


def connect(url: str, *, cluster: bool = False, **options: Any) -> redis.Redis | RedisCluster:
    """A client for ``url``: a cluster client when ``cluster`` or when the URL's scheme
    ends in ``+cluster``, else a plain one."""
    url, cluster = cluster_url(url, cluster)
    if cluster:
        return RedisCluster.from_url(url, **options)
    return redis.Redis.from_url(url, **options)


def cluster_url(url: str, cluster: bool = False) -> tuple[str, bool]:
    """``url`` without a ``+cluster`` scheme suffix, and whether it names a cluster."""
    scheme, separator, rest = url.partition("://")
    if separator and scheme.endswith(CLUSTER_SCHEME):
        return f"{scheme[: -len(CLUSTER_SCHEME)]}://{rest}", True
    return url, cluster


def option_problems(options: dict[str, Any]) -> list[str]:
    """What is wrong with the Redis store's ``CLUSTER``, ``WAIT_REPLICAS`` and
    ``WAIT_TIMEOUT_MS`` options (its check E026 reports them)."""
    problems = []
    if not isinstance(options["CLUSTER"], bool):
        problems.append(f"CLUSTER {options['CLUSTER']!r} is not True or False")
    for name, least in (("WAIT_REPLICAS", 0), ("WAIT_TIMEOUT_MS", 1)):
        value = options[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            problems.append(f"{name} {value!r} is not a whole number >= {least}")
    return problems


def is_cluster(client: object) -> bool:
    return isinstance(client, RedisCluster)


def disconnect(client: redis.Redis | RedisCluster, *, in_use: bool = True) -> None:
    """Closes the client's connections (every node's, on a cluster); ``in_use=False``: only
    the idle ones, never a connection another thread is using right now."""
    if isinstance(client, RedisCluster):
        pools = [
            node.redis_connection.connection_pool
            for node in client.get_nodes()
            if node.redis_connection is not None
        ]
    else:
        pools = [client.connection_pool]
    for pool in pools:
        with contextlib.suppress(OSError):  # already closed
            pool.disconnect(inuse_connections=in_use)


def rediscover(client: RedisCluster) -> None:
    """Asks the cluster for its map again (a node failed), keeping the error that made us
    ask: a cluster that cannot be reached now is the caller's to report, as that error."""
    with contextlib.suppress(redis.RedisError, RedisClusterException):
        client.nodes_manager.initialize()


def time_and_get(client: redis.Redis | RedisCluster, key: str) -> tuple[int, Any]:
    """The server's clock (ms) and ``key``'s value, in one round trip to the node that
    holds it (a cluster's pipeline may not send ``TIME``, which names no key)."""
    if isinstance(client, RedisCluster):
        try:
            node_client = _node_client(client, client.get_node_from_key(key))
            return _time_and_get(node_client, key)
        except (redis.exceptions.MovedError, redis.exceptions.AskError):
            value = client.get(key)  # follows the redirection
            seconds, micros = client.time()
            return int(seconds) * 1000 + int(micros) // 1000, value
    return _time_and_get(client, key)


def _time_and_get(client: redis.Redis, key: str) -> tuple[int, Any]:
    pipe = client.pipeline(transaction=False)
    pipe.time()
    pipe.get(key)
    (seconds, micros), value = pipe.execute()
    return int(seconds) * 1000 + int(micros) // 1000, value


def by_node(client: RedisCluster, items: Iterable[K], key: Callable[[K], str]) -> list[list[K]]:
    """``items`` grouped by the master that holds ``key(item)``, per the client's slot map
    (a stale map costs a ``MOVED``, which the client follows)."""
    groups: dict[str, list[K]] = {}
    for item in items:
        node = client.get_node_from_key(key(item))
        groups.setdefault(node.name, []).append(item)
    return list(groups.values())


def eval_per_node(
    client: redis.Redis | RedisCluster, script: Script, calls: Sequence[tuple[str, Sequence[Any]]]
) -> list[Any]:
    """Runs ``script`` once per ``(key, args)`` of ``calls``, each on its one key, in one
    round trip per node (one in all on a single Redis); the replies in ``calls``' order.

    A call its node redirects (``MOVED``/``ASK``: a migration), or that meets a node without
    the script (``NOSCRIPT``: a promoted replica, a new node), is repeated on its own
    through the cluster client, which follows redirections and loads the script.
    """
    if not calls:
        return []
    if not isinstance(client, RedisCluster):
        return _eval_pipelined(client, script, calls, raise_errors=True)
    replies: list[Any] = [None] * len(calls)
    for group in by_node(client, range(len(calls)), lambda index: calls[index][0]):
        node = client.get_node_from_key(calls[group[0]][0])
        try:
            answered = _eval_pipelined(
                _node_client(client, node), script, [calls[index] for index in group]
            )
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            rediscover(client)  # a dead master: ask the cluster again
            answered = [redis.exceptions.ConnectionError()] * len(group)
        for index, reply in zip(group, answered, strict=True):
            replies[index] = reply
    for index, reply in enumerate(replies):
        if isinstance(reply, (redis.exceptions.ResponseError, redis.exceptions.ConnectionError)):
            key, args = calls[index]
            replies[index] = script(keys=[key], args=list(args), client=client)
    return replies


def _eval_pipelined(
    client: redis.Redis,
    script: Script,
    calls: Sequence[tuple[str, Sequence[Any]]],
    *,
    raise_errors: bool = False,
) -> list[Any]:
    """``EVALSHA`` for each call on one connection (not ``Script`` in a pipeline, which asks
    ``SCRIPT EXISTS`` first: a second round trip every time); ``NOSCRIPT`` loads it once."""
    for attempt in range(2):
        pipe = client.pipeline(transaction=False)
        for key, args in calls:
            pipe.execute_command("EVALSHA", script.sha, 1, key, *args)
        replies = pipe.execute(raise_on_error=False)
        missing = [reply for reply in replies if isinstance(reply, redis.exceptions.NoScriptError)]
        if not missing or attempt:
            break
        client.script_load(script.script)
    errors = [reply for reply in replies if isinstance(reply, Exception)]
    if errors and raise_errors:
        raise errors[0]
    return list(replies)


def write_and_wait(
    client: redis.Redis | RedisCluster,
    key: str,
    command: Sequence[Any],
    replicas: int,
    timeout_ms: int,
) -> tuple[Any, int]:
    """Runs ``command`` (which writes ``key``), then ``WAIT replicas timeout_ms``, on one
    connection: the command's reply and how many replicas acknowledged it.

    ``WAIT`` counts the replicas that acknowledged *that connection's* writes, so it cannot
    go through a pool that may hand out another connection, nor through the cluster client,
    which routes a keyless command anywhere. It follows ``MOVED`` and ``ASK`` itself, for
    the same reason."""
    if not isinstance(client, RedisCluster):
        return _pipeline(client, command, replicas, timeout_ms, asking=False)
    node = client.get_node_from_key(key)
    asking = False
    for _ in range(REDIRECTIONS):
        try:
            return _pipeline(_node_client(client, node), command, replicas, timeout_ms, asking)
        except redis.exceptions.MovedError as error:  # first: MovedError is an AskError
            client.nodes_manager.move_slot(error)
            node, asking = _node(client, error.host, error.port), False
        except redis.exceptions.AskError as error:
            node, asking = _node(client, error.host, error.port), True
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            # A dead master: the next call finds its promoted replica; this one's outcome
            # is unknown, which the caller's policy decides on.
            rediscover(client)
            raise
    raise redis.exceptions.ClusterError(f"too many redirections for a write of {key!r}")


def _node(client: RedisCluster, host: str, port: int) -> ClusterNode:
    node: ClusterNode | None = client.get_node(host=host, port=port)
    if node is None:
        client.nodes_manager.initialize()
        node = client.get_node(host=host, port=port)
    if node is None:
        raise redis.exceptions.ClusterError(f"no cluster node {host}:{port}")
    return node


def _node_client(client: RedisCluster, node: ClusterNode) -> redis.Redis:
    connection = client.get_redis_connection(node)
    if connection is None:
        client.nodes_manager.initialize()
        connection = client.get_redis_connection(node)
    return connection


def _pipeline(
    client: redis.Redis, command: Sequence[Any], replicas: int, timeout_ms: int, asking: bool
) -> tuple[Any, int]:
    pipe = client.pipeline(transaction=False)
    if asking:
        pipe.execute_command("ASKING")
    pipe.execute_command(*command)
    pipe.execute_command("WAIT", replicas, timeout_ms)
    replies = pipe.execute(raise_on_error=False)
    reply, acknowledged = replies[-2], replies[-1]
    if isinstance(reply, Exception):
        raise reply
    if isinstance(acknowledged, Exception):
        raise acknowledged
    return reply, int(acknowledged)
