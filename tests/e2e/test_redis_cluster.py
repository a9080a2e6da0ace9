"""The cluster harness does what the Redis store's cluster tests rely on, seen by a plain
redis-py ``RedisCluster`` client: a migration answers ``ASK`` then ``MOVED``, a killed
master's replicated writes survive its replica's promotion, a write made while the replica
is cut off is lost, and a standalone server restarts with or without its AOF."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from redis.cluster import RedisCluster

from tools import redis_cluster

pytestmark = pytest.mark.redis_cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    if not redis_cluster.healthy():
        pytest.skip("no Redis Cluster (python -m tools.redis_cluster start)")
    client = RedisCluster.from_url(redis_cluster.cluster_url())
    yield client
    client.close()


def errors(port: int, kind: str) -> int:
    with redis_cluster.client(port) as connection:
        entry = connection.info("errorstats").get(f"errorstat_{kind}", {})
    return int(entry["count"]) if entry else 0


def test_a_slot_migration_answers_ask_then_moved(cluster: RedisCluster) -> None:
    key = f"{{h-{uuid.uuid4()}}}:record"
    cluster.set(key, "claim")
    migration = redis_cluster.SlotMigration.of(redis_cluster.keyslot(key))
    source = redis_cluster.client(migration.source.port)
    migration.begin()
    try:
        assert source.get(key) == b"claim"  # still on the source: served there
        assert migration.move_keys() == 1
        with pytest.raises(redis.exceptions.AskError):
            source.get(key)
        asks = errors(migration.source.port, "ASK")
        assert cluster.get(key) == b"claim"
        assert errors(migration.source.port, "ASK") == asks + 1
    finally:
        migration.finish()
    assert redis_cluster.owner(migration.slot).id == migration.target.id
    with pytest.raises(redis.exceptions.MovedError):
        source.get(key)
    source.close()


def test_a_killed_masters_replicated_write_survives_the_promotion(cluster: RedisCluster) -> None:
    key = f"{{h-{uuid.uuid4()}}}:record"
    cluster.set(key, "claim")
    master = redis_cluster.owner(redis_cluster.keyslot(key))
    with redis_cluster.client(master.port) as connection:
        assert connection.execute_command("WAIT", 1, 5000) == 1
    try:
        promoted = redis_cluster.kill_master(master.port)
        assert promoted.port != master.port
        assert redis_cluster.owner(redis_cluster.keyslot(key)).port == promoted.port
        assert cluster.get(key) == b"claim"
    finally:
        redis_cluster.restart_node(master.port)
    restarted = next(node for node in redis_cluster.topology() if node.port == master.port)
    assert restarted.role == "replica"
    assert restarted.master_id == promoted.id


def test_a_write_the_replica_never_saw_is_lost_in_the_failover(cluster: RedisCluster) -> None:
    key = f"{{h-{uuid.uuid4()}}}:record"
    cluster.set(key, "before")
    master = redis_cluster.owner(redis_cluster.keyslot(key))
    with redis_cluster.client(master.port) as connection:
        assert connection.execute_command("WAIT", 1, 5000) == 1
    try:
        with redis_cluster.replica_cut_off(master):
            assert cluster.set(key, "acknowledged")
            with redis_cluster.client(master.port) as connection:
                assert connection.execute_command("WAIT", 1, 200) == 0
            redis_cluster.kill_node(master.port)
        redis_cluster.wait_promoted(master)
        assert cluster.get(key) == b"before"
    finally:
        redis_cluster.restart_node(master.port)


@pytest.mark.parametrize(("appendfsync", "kept"), [(None, None), ("always", b"claim")])
def test_a_standalone_server_restarts(appendfsync: str | None, kept: bytes | None) -> None:
    server = redis_cluster.StandaloneRedis(appendfsync=appendfsync)
    try:
        server.start()
    except (OSError, RuntimeError, TimeoutError) as error:
        pytest.skip(f"no redis-server: {error}")
    try:
        client = redis.Redis.from_url(server.url)
        client.set("record", "claim")
        server.kill()
        with pytest.raises(redis.exceptions.ConnectionError):
            redis_cluster.client(server.port).ping()
        server.start()
        assert client.get("record") == kept
        client.close()
    finally:
        server.stop()
