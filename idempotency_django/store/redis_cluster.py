"""What the Redis store needs to run on a Redis Cluster, and the optional ``WAIT``.

``connect`` builds a ``RedisCluster`` client when the options say ``CLUSTER`` (redis-py
follows ``MOVED`` and ``ASK`` and finds a promoted replica itself); ``by_node`` groups keys
by the master that holds them, so that the heartbeat renews a process's claims in one
round trip per node (a script may only touch keys of one slot there). ``write_and_wait``
sends a write and ``WAIT n timeout`` on one connection in one round trip: ``WAIT`` counts
the replicas that acknowledged *that connection's* writes, so it cannot go through a pool
that may hand out another connection, nor through the cluster client, which routes a
keyless command anywhere. It follows ``MOVED`` and ``ASK`` itself, for the same reason.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypeVar

import redis
from redis.cluster import ClusterNode, RedisCluster

K = TypeVar("K", bound=Hashable)

REDIRECTIONS = 5
"""How many ``MOVED``/``ASK`` a write-and-wait follows (a migration finishing, then a
failover) before it gives up and lets the caller's error policy answer."""


def connect(url: str, *, cluster: bool, **options: Any) -> redis.Redis | RedisCluster:
    """A client for ``url``: a cluster client when ``cluster``, else a plain one."""
    if cluster:
        return RedisCluster.from_url(url, **options)
    return redis.Redis.from_url(url, **options)


def by_node(client: RedisCluster, items: Iterable[K], key: Callable[[K], str]) -> list[list[K]]:
    """``items`` grouped by the master that holds ``key(item)``, per the client's slot map
    (a stale map costs a ``MOVED``, which the client follows)."""
    groups: dict[str, list[K]] = {}
    for item in items:
        node = client.get_node_from_key(key(item))
        groups.setdefault(node.name, []).append(item)
    return list(groups.values())


def write_and_wait(
    client: redis.Redis | RedisCluster,
    key: str,
    command: Sequence[Any],
    replicas: int,
    timeout_ms: int,
) -> tuple[Any, int]:
    """Runs ``command`` (which writes ``key``), then ``WAIT replicas timeout_ms``, on one
    connection: the command's reply and how many replicas acknowledged it."""
    if not isinstance(client, RedisCluster):
        return _pipeline(client, command, replicas, timeout_ms, asking=False)
    node = client.get_node_from_key(key)
    asking = False
    for _ in range(REDIRECTIONS):
        try:
            return _pipeline(_node_client(client, node), command, replicas, timeout_ms, asking)
        except redis.exceptions.AskError as error:
            node, asking = _node(client, error.host, error.port), True
        except redis.exceptions.MovedError as error:
            client.nodes_manager.move_slot(error)
            node, asking = _node(client, error.host, error.port), False
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            # A dead master: the next call finds its promoted replica; this one's outcome
            # is unknown, which the caller's policy decides on.
            client.nodes_manager.initialize()
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
