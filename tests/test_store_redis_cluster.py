"""``store/redis_cluster.py`` on the local Redis Cluster: the client it builds, the grouping
by node the heartbeat renews with, and a write followed by ``WAIT`` on one connection,
through ``ASK`` and ``MOVED`` and with a replica cut off."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from redis.cluster import RedisCluster

from tests.e2e import redis_cluster

redis_store_cluster = pytest.importorskip("idempotency_django.store.redis_cluster")

pytestmark = pytest.mark.redis_cluster

SINGLE_URL = "redis://127.0.0.1:6379/4"


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    if not redis_cluster.healthy():
        pytest.skip("no Redis Cluster (python -m tests.e2e.redis_cluster start)")
    client = redis_store_cluster.connect(redis_cluster.cluster_url(), cluster=True)
    assert isinstance(client, RedisCluster)
    yield client
    client.close()


def claim(key: str) -> list[object]:
    return ["SET", key, "token", "NX", "PX", 60_000]


def new_key() -> str:
    return f"{{w-{uuid.uuid4()}}}:claim"


def asks(port: int) -> int:
    with redis_cluster.client(port) as connection:
        entry = connection.info("errorstats").get("errorstat_ASK", {})
    return int(entry["count"]) if entry else 0


def on_replica(master: redis_cluster.Node, key: str) -> bytes | None:
    (replica,) = redis_cluster.replicas_of(master)
    with redis_cluster.client(replica.port) as connection:
        connection.execute_command("READONLY")
        value = connection.get(key)
    return value if isinstance(value, bytes) else None


def test_connect_builds_a_plain_client_unless_told_cluster() -> None:
    client = redis_store_cluster.connect(SINGLE_URL, cluster=False)
    assert type(client) is redis.Redis
    client.close()


def test_by_node_groups_keys_by_the_master_that_holds_them(cluster: RedisCluster) -> None:
    keys = [f"{{n-{number}}}:claim" for number in range(30)]
    groups = redis_store_cluster.by_node(cluster, keys, lambda key: key)
    assert sorted(key for group in groups for key in group) == sorted(keys)
    owners = [{redis_cluster.owner(redis_cluster.keyslot(key)).id for key in g} for g in groups]
    assert all(len(owner) == 1 for owner in owners)
    assert len(groups) == len({owner.pop() for owner in owners}) == 3


def test_write_and_wait_counts_the_replica_that_has_the_write(cluster: RedisCluster) -> None:
    key = new_key()
    assert redis_store_cluster.write_and_wait(cluster, key, claim(key), 1, 2000) == (True, 1)
    assert redis_store_cluster.write_and_wait(cluster, key, claim(key), 1, 2000) == (None, 1)
    master = redis_cluster.owner(redis_cluster.keyslot(key))
    assert on_replica(master, key) == b"token"


def test_write_and_wait_follows_ask_during_a_migration(cluster: RedisCluster) -> None:
    key = new_key()
    migration = redis_cluster.SlotMigration.of(redis_cluster.keyslot(key))
    migration.begin()
    try:
        before = asks(migration.source.port)
        assert redis_store_cluster.write_and_wait(cluster, key, claim(key), 1, 2000) == (True, 1)
        assert asks(migration.source.port) == before + 1
        assert migration.keys() == []  # written on the importing node
        with redis_cluster.client(migration.target.port) as connection:
            connection.execute_command("ASKING")
            assert connection.get(key) == b"token"
    finally:
        migration.finish()
    assert cluster.get(key) == b"token"


def test_write_and_wait_follows_moved_after_a_migration(cluster: RedisCluster) -> None:
    key = new_key()
    cluster.get(key)  # the client's map now names the current owner
    migration = redis_cluster.SlotMigration.of(redis_cluster.keyslot(key))
    migration.run()
    assert redis_store_cluster.write_and_wait(cluster, key, claim(key), 1, 2000) == (True, 1)
    with redis_cluster.client(migration.target.port) as connection:
        assert connection.get(key) == b"token"


def test_write_and_wait_reports_no_replica_when_it_is_cut_off(cluster: RedisCluster) -> None:
    key = new_key()
    master = redis_cluster.owner(redis_cluster.keyslot(key))
    with redis_cluster.replica_cut_off(master):
        assert redis_store_cluster.write_and_wait(cluster, key, claim(key), 1, 200) == (True, 0)
    redis_cluster.wait_healthy()


def test_write_and_wait_on_a_single_redis() -> None:
    client = redis_store_cluster.connect(SINGLE_URL, cluster=False)
    key = new_key()
    try:
        assert redis_store_cluster.write_and_wait(client, key, claim(key), 0, 100) == (True, 0)
        assert client.get(key) == b"token"
    except redis.exceptions.ConnectionError:
        pytest.skip(f"no Redis at {SINGLE_URL}")
    finally:
        client.delete(key)
        client.close()
