"""``store/redis_cluster.py`` on the local Redis Cluster: the client it builds, the grouping
by node the heartbeat renews with, and a write followed by ``WAIT`` on one connection,
through ``ASK`` and ``MOVED`` and with a replica cut off."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from tools import redis_cluster

redis_store_cluster = pytest.importorskip("idempotency_django.store.redis_cluster")

pytestmark = pytest.mark.redis_cluster

SINGLE_URL = "redis://127.0.0.1:6379/4"


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    if not redis_cluster.healthy():
        pytest.skip("no Redis Cluster (python -m tools.redis_cluster start)")
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


def test_a_cluster_url_builds_a_cluster_client(cluster: RedisCluster) -> None:
    url = redis_cluster.cluster_url().replace("redis://", "redis+cluster://")
    client = redis_store_cluster.connect(url)
    assert isinstance(client, RedisCluster)
    assert len(client.get_primaries()) == 3
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


RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


def _claims(cluster: RedisCluster, count: int) -> list[str]:
    """``count`` claims dealt round-robin over the masters by the slots each owns now, so
    "keys on every master" never rests on how random keys fall (12 of them miss one of
    three masters about once in 40 runs)."""
    masters = redis_cluster.masters()
    keys: list[str] = []
    for _ in range(10_000 * count):
        if len(keys) == count:
            break
        key = f"{{e-{uuid.uuid4()}}}:claim"
        if masters[len(keys) % len(masters)].owns(key_slot(key.encode())):
            keys.append(key)
    assert len(keys) == count, "a master owns no slot"
    for key in keys:
        cluster.set(key, "token", px=60_000)
    return keys


def test_eval_per_node_runs_the_script_on_every_key_in_order(cluster: RedisCluster) -> None:
    """A fenced renewal: 1 for each key held with the token, 0 for the others, in the
    order asked, keys spread over all three masters."""
    held = _claims(cluster, 12)
    other = f"{{e-{uuid.uuid4()}}}:claim"
    cluster.set(other, "another-token", px=60_000)
    script = cluster.register_script(RENEW)
    calls = [(key, ["token", 600_000]) for key in [*held, other]]
    assert redis_store_cluster.eval_per_node(cluster, script, calls) == [1] * 12 + [0]
    assert all(cluster.pttl(key) > 60_000 for key in held)
    assert cluster.pttl(other) <= 60_000
    assert len({redis_cluster.owner(redis_cluster.keyslot(key)).id for key in held}) == 3


def test_eval_per_node_loads_the_script_where_it_is_missing(cluster: RedisCluster) -> None:
    held = _claims(cluster, 6)
    script = cluster.register_script(RENEW)
    for node in redis_cluster.masters():
        with redis_cluster.client(node.port) as connection:
            connection.script_flush()
    calls = [(key, ["token", 600_000]) for key in held]
    assert redis_store_cluster.eval_per_node(cluster, script, calls) == [1] * 6


def test_eval_per_node_follows_a_migration(cluster: RedisCluster) -> None:
    """Keys that moved (ASK) and a slot that moved (MOVED) are renewed all the same."""
    held = _claims(cluster, 6)
    script = cluster.register_script(RENEW)
    calls = [(key, ["token", 600_000]) for key in held]
    moving = redis_cluster.SlotMigration.of(redis_cluster.keyslot(held[0]))
    moving.begin()
    try:
        moving.move_keys()
        assert redis_store_cluster.eval_per_node(cluster, script, calls) == [1] * 6
    finally:
        moving.finish()
    moved = redis_cluster.SlotMigration.of(redis_cluster.keyslot(held[1]))
    moved.run()
    assert redis_store_cluster.eval_per_node(cluster, script, calls) == [1] * 6


def test_eval_per_node_on_a_single_redis() -> None:
    client = redis_store_cluster.connect(SINGLE_URL)
    keys = [f"{{e-{uuid.uuid4()}}}:claim" for _ in range(3)]
    try:
        for key in keys[:2]:
            client.set(key, "token", px=60_000)
        script = client.register_script(RENEW)
        calls = [(key, ["token", 600_000]) for key in keys]
        assert redis_store_cluster.eval_per_node(client, script, calls) == [1, 1, 0]
        assert redis_store_cluster.eval_per_node(client, script, []) == []
    except redis.exceptions.ConnectionError:
        pytest.skip(f"no Redis at {SINGLE_URL}")
    finally:
        client.delete(*keys)
        client.close()


def test_eval_per_node_is_one_round_trip_per_node(
    cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = _claims(cluster, 12)
    script = cluster.register_script(RENEW)
    calls = [(key, ["token", 600_000]) for key in held]
    redis_store_cluster.eval_per_node(cluster, script, calls)  # loads the script everywhere
    sent: list[int] = []
    execute = redis.client.Pipeline.execute

    def counted(self: redis.client.Pipeline, raise_on_error: bool = True) -> list[object]:
        sent.append(len(self.command_stack))
        return execute(self, raise_on_error)

    monkeypatch.setattr(redis.client.Pipeline, "execute", counted)
    assert redis_store_cluster.eval_per_node(cluster, script, calls) == [1] * 12
    # One pipeline per master that holds any of the keys (random keys may leave one out).
    per_master = [
        sum(redis_cluster.owner(redis_cluster.keyslot(key)).id == node.id for key in held)
        for node in redis_cluster.masters()
    ]
    holding = sorted(count for count in per_master if count)
    assert len(holding) >= 2  # the keys span several masters
    assert sorted(sent) == holding
