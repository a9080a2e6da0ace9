"""The Redis store on a real Redis Cluster (3 masters, 3 replicas: ``tests/e2e/redis_cluster``).

Each test drives real requests through the test project's views with the store pointed at
the cluster, and looks at the cluster itself: which slot a record's keys hash to, which
node answered ``ASK`` or ``MOVED`` (``INFO errorstats`` counts the redirections a node
sent), which master was killed and which replica took over. Slow (a failover takes
seconds), so marked ``redis_cluster`` and run in a ``.ci/run`` step of its own.
"""

from __future__ import annotations

import json
import queue
import threading
import uuid
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connections
from django.test import Client

from tests.conftest import effects, post_from_thread, wait_until
from tests.project.views import gate
from tools import redis_cluster

pytestmark = [pytest.mark.redis_cluster, pytest.mark.django_db(transaction=True)]

REDIS_STORE = "idempotency_django.store.redis.RedisStore"
THREADS = 8


@pytest.fixture(scope="module")
def cluster() -> str:
    try:
        import idempotency_django.store.redis  # noqa: F401
    except ImportError as error:
        pytest.skip(f"no Redis store: {error}")
    if not redis_cluster.healthy():
        pytest.skip("no Redis Cluster (python -m tools.redis_cluster start)")
    return redis_cluster.cluster_url()


def store_settings(url: str, prefix: str, **options: Any) -> dict[str, Any]:
    return {
        "STORE": REDIS_STORE,
        "STORE_OPTIONS": {"URL": url, "CLUSTER": True, "KEY_PREFIX": prefix, **options},
    }


@pytest.fixture
def prefix(cluster: str, settings: Any) -> str:
    """The store on the cluster, under a key prefix of this test's own."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    settings.IDEMPOTENCY = {
        **getattr(settings, "IDEMPOTENCY", {}),
        **store_settings(cluster, prefix),
    }
    return prefix


def record_keys(prefix: str) -> list[bytes]:
    """Every key under ``prefix``, on every master."""
    found: list[bytes] = []
    for node in redis_cluster.masters():
        with redis_cluster.client(node.port) as connection:
            found.extend(connection.scan_iter(match=f"{prefix}*", count=1000))
    return found


def redirections(port: int, kind: str) -> int:
    """How many ``kind`` (``ASK``, ``MOVED``) errors the node on ``port`` has replied."""
    with redis_cluster.client(port) as connection:
        stats = connection.info("errorstats")
    entry = stats.get(f"errorstat_{kind}", {})
    return int(entry.get("count", 0)) if isinstance(entry, dict) else 0


def send(path: str, body: dict[str, Any], key: str) -> Any:
    return post_from_thread(path, body, {"Idempotency-Key": key, "X-User": "alice"})


class InFlight:
    """One gated request in a thread of its own: its view holds until ``finish()``."""

    def __init__(self, key: str, path: str = "/effect/") -> None:
        self.key = key
        self.path = path
        self.result: queue.Queue[Any] = queue.Queue()
        self.thread = threading.Thread(
            target=lambda: self.result.put(send(path, {"gate": True}, key))
        )
        self.thread.start()
        assert gate.entered.wait(20), "the view was never entered"

    def _send(self) -> None:
        self.result.put(send(self.path, {"gate": True}, self.key))

    def finish(self) -> Any:
        gate.release.set()
        self.thread.join(30)
        return self.result.get(timeout=1)


def test_threads_single_flight_on_the_cluster(alice: User, prefix: str) -> None:
    key = f"k-{uuid.uuid4()}"
    barrier = threading.Barrier(THREADS)
    results: queue.Queue[Any] = queue.Queue()

    def worker() -> None:
        barrier.wait(timeout=10)
        results.put(send("/effect/", {"gate": True}, key))

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    losers = [results.get(timeout=30) for _ in range(THREADS - 1)]
    gate.release.set()
    for thread in threads:
        thread.join(30)
    winner = results.get(timeout=1)

    assert effects() == 1
    assert winner.status_code == 201
    assert [r.status_code for r in losers] == [409] * (THREADS - 1)
    replay = send("/effect/", {"gate": True}, key)
    assert replay.status_code == 201
    assert replay["Idempotent-Replayed"] == "true"
    assert replay.content == winner.content


def test_a_records_keys_share_one_slot_through_a_hash_tag(alice: User, prefix: str) -> None:
    """Every key of a record hashes to one slot (its hash tag), and records spread over
    the masters: a constant tag would put every record on one node."""
    for number in range(30):
        assert send("/effect/", {"n": number}, f"k-{number}").status_code == 201
    keys = record_keys(prefix)
    assert keys
    by_tag: dict[bytes, set[int]] = {}
    for key in keys:
        assert b"{" in key, key
        assert b"}" in key, key
        tag = key[key.index(b"{") + 1 : key.index(b"}", key.index(b"{"))]
        assert tag, key
        by_tag.setdefault(tag, set()).add(redis_cluster.keyslot(key))
    assert len(by_tag) == 30
    assert all(len(slots) == 1 for slots in by_tag.values())
    owners = {redis_cluster.owner(next(iter(slots))).port for slots in by_tag.values()}
    assert len(owners) >= 2


def _in_flight_slot(prefix: str) -> int:
    keys = record_keys(prefix)
    assert keys, "the claim wrote no key"
    slots = {redis_cluster.keyslot(key) for key in keys}
    assert len(slots) == 1
    return slots.pop()


def test_ask_then_moved_while_the_slot_of_an_in_flight_key_migrates(
    alice: User, prefix: str
) -> None:
    """The claim is made, then its slot starts moving and its keys move: a duplicate is
    redirected with ASK and still sees the key in flight (409); the completion follows the
    ASK too. After the slot moved, a replay is redirected with MOVED. One execution."""
    key = f"k-{uuid.uuid4()}"
    first = InFlight(key)
    slot = _in_flight_slot(prefix)
    migration = redis_cluster.SlotMigration.of(slot)
    migration.begin()
    try:
        assert migration.move_keys() >= 1
        asks = redirections(migration.source.port, "ASK")
        duplicate = send("/effect/", {"gate": True}, key)
        assert duplicate.status_code == 409
        assert redirections(migration.source.port, "ASK") > asks
        asks = redirections(migration.source.port, "ASK")
        response = first.finish()
        assert response.status_code == 201
        assert redirections(migration.source.port, "ASK") > asks
    finally:
        gate.release.set()
        migration.finish()
    moved = redirections(migration.source.port, "MOVED")
    replay = send("/effect/", {"gate": True}, key)
    assert redirections(migration.source.port, "MOVED") > moved
    assert replay.status_code == 201
    assert replay["Idempotent-Replayed"] == "true"
    assert replay.content == response.content
    assert effects() == 1


def forget(prefix: str) -> None:
    """Deletes every key under ``prefix`` (as their expiry would) and waits until the
    deletion reached the replicas: a record of the same identity is then claimed afresh,
    on the slot the deleted one lived in."""
    for node in redis_cluster.masters():
        with redis_cluster.client(node.port) as connection:
            keys = list(connection.scan_iter(match=f"{prefix}*", count=1000))
            if keys:
                connection.delete(*keys)
                assert connection.execute_command("WAIT", 1, 5000) == 1


def test_a_claim_made_during_the_migration_lands_on_the_importing_node(
    alice: User, prefix: str
) -> None:
    """A claim of a key whose slot is migrating, and which the source does not hold, is
    made on the target (ASK); the duplicate finds it there (409), the replay after the
    migration too."""
    key = f"k-{uuid.uuid4()}"
    assert send("/effect/", {}, key).status_code == 201
    slot = _in_flight_slot(prefix)
    forget(prefix)
    migration = redis_cluster.SlotMigration.of(slot)
    migration.begin()
    try:
        asks = redirections(migration.source.port, "ASK")
        first = InFlight(key)
        assert redirections(migration.source.port, "ASK") > asks
        assert migration.keys() == []  # the claim is on the target, not the source
        assert send("/effect/", {"gate": True}, key).status_code == 409
        response = first.finish()
        assert response.status_code == 201
    finally:
        gate.release.set()
        migration.finish()
    replay = send("/effect/", {"gate": True}, key)
    assert replay["Idempotent-Replayed"] == "true"
    assert replay.content == response.content
    assert effects() == 2  # the probe, and the key claimed afresh once


def test_a_master_killed_mid_flight_with_a_replicated_claim(alice: User, prefix: str) -> None:
    """The master holding an in-flight claim is SIGKILLed after the claim reached its
    replica; the replica is promoted. The duplicate is told 409 (the claim survived; 503 if
    the client has not found the new master yet), the view's completion reaches the new
    master, the replay works: one execution."""
    key = f"k-{uuid.uuid4()}"
    first = InFlight(key)
    master = redis_cluster.owner(_in_flight_slot(prefix))
    with redis_cluster.client(master.port) as connection:
        assert connection.execute_command("WAIT", 1, 5000) == 1
    try:
        promoted = redis_cluster.kill_master(master.port)
        assert promoted.port != master.port
        duplicate = send("/effect/", {"gate": True}, key)
        assert duplicate.status_code in (409, 503)
        response = first.finish()
    finally:
        gate.release.set()
        redis_cluster.restart_node(master.port)
    assert response.status_code in (201, 503)
    replay = send("/effect/", {"gate": True}, key)
    if response.status_code == 201:
        assert replay.status_code == 201
        assert replay["Idempotent-Replayed"] == "true"
    else:
        assert replay.status_code in (409, 503)
    assert effects() == 1


@pytest.mark.concurrency  # threads writing the database at once: not on SQLite
def test_a_master_killed_mid_load_loses_no_outcome_that_was_answered(
    alice: User, prefix: str
) -> None:
    """Threads send requests, each with a key of its own, while a master is SIGKILLed and
    its replica promoted. Completions sent during the failover wait for the new master
    (the lease is 10 s, the failover a few). Afterwards every key answered 2xx replays its
    answer and ran once; every other key (503: its claim failed) never ran."""
    from tests.models import SideEffect

    answered: dict[str, Any] = {}
    lock = threading.Lock()
    stop = threading.Event()
    started = threading.Barrier(THREADS + 1)

    def load(worker: int) -> None:
        client = Client(raise_request_exception=False)  # an exception is its 500
        started.wait(timeout=10)
        number = 0
        try:
            while not stop.is_set():
                key = f"k-{worker}-{number}"
                response = client.post(
                    "/keyed-effect/",
                    data=json.dumps({"n": key}),
                    content_type="application/json",
                    headers={"Idempotency-Key": key, "X-User": "alice"},
                )
                with lock:
                    answered[key] = response
                number += 1
        finally:
            connections.close_all()

    threads = [threading.Thread(target=load, args=(worker,)) for worker in range(THREADS)]
    for thread in threads:
        thread.start()
    started.wait(timeout=10)
    victim = redis_cluster.masters()[0]
    try:
        assert wait_until(lambda: len(answered) >= 2 * THREADS, timeout=30)
        redis_cluster.kill_master(victim.port)
        before = len(answered)
        assert wait_until(lambda: len(answered) >= before + 2 * THREADS, timeout=30)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
        redis_cluster.restart_node(victim.port)

    statuses = [response.status_code for response in answered.values()]
    ran = {key: SideEffect.objects.filter(label=f"key:{key}").count() for key in answered}
    replays = {
        key: send("/keyed-effect/", {"n": key}, key)
        for key, response in answered.items()
        if response.status_code == 201
    }

    assert statuses.count(201) >= 4 * THREADS
    # A cluster in failover is a store failure (503) or an answer, never a crash.
    assert set(statuses) <= {201, 503}, sorted(set(statuses))
    assert {key: count for key, count in ran.items() if count > 1} == {}
    for key, response in answered.items():
        if response.status_code == 201:
            assert ran[key] == 1, key
        elif response.status_code == 503:
            assert ran[key] == 0, key  # its claim failed: the view never ran
    for key, replay in replays.items():
        assert replay.status_code == 201, key
        assert replay.get("Idempotent-Replayed") == "true", key
        assert replay.content == answered[key].content, key


def test_a_claim_acknowledged_but_not_replicated_is_lost_in_a_failover(
    alice: User, prefix: str
) -> None:
    """The documented loss (docs/stores.md): without ``WAIT_REPLICAS``, a claim the master
    acknowledged but did not replicate before it died is gone on the promoted replica, and
    a retry runs the view a second time. This test pins that honest limit down."""
    key = f"k-{uuid.uuid4()}"
    assert send("/effect/", {}, key).status_code == 201
    master = redis_cluster.owner(_in_flight_slot(prefix))
    forget(prefix)
    try:
        with redis_cluster.replica_cut_off(master):
            first = InFlight(key)
            redis_cluster.kill_node(master.port)
        redis_cluster.wait_promoted(master)
        second = send("/effect/", {}, key)
        assert second.status_code == 201
        assert "Idempotent-Replayed" not in second
        first.finish()
    finally:
        gate.release.set()
        redis_cluster.restart_node(master.port)
    assert effects() == 3  # the probe, and the same key's view twice


def test_wait_replicas_refuses_a_claim_that_was_not_replicated(
    alice: User, prefix: str, settings: Any
) -> None:
    """With ``WAIT_REPLICAS = 1`` a claim no replica acknowledged is not trusted: the
    request is answered 503 and its view never runs; after the failover a retry runs it
    once."""
    settings.IDEMPOTENCY = {
        **settings.IDEMPOTENCY,
        # WAIT's timeout well inside the socket's: the refusal must come from the replica
        # count, not from a read that timed out (an unknown outcome, a 503 too).
        **store_settings(
            redis_cluster.cluster_url(),
            prefix,
            WAIT_REPLICAS=1,
            WAIT_TIMEOUT_MS=1000,
            SOCKET_TIMEOUT=5.0,
        ),
    }
    # A replica restarted by an earlier test may still be syncing: WAIT 1 would time out.
    redis_cluster.wait_healthy()
    key = f"k-{uuid.uuid4()}"
    assert send("/effect/", {}, key).status_code == 201
    master = redis_cluster.owner(_in_flight_slot(prefix))
    forget(prefix)
    try:
        with redis_cluster.replica_cut_off(master):
            refused = send("/effect/", {}, key)
            assert refused.status_code == 503
            assert refused["Content-Type"] == "application/problem+json"
            assert effects() == 1
            redis_cluster.kill_node(master.port)
        redis_cluster.wait_promoted(master)
    finally:
        redis_cluster.restart_node(master.port)
    retried = send("/effect/", {}, key)
    assert retried.status_code == 201
    assert send("/effect/", {}, key)["Idempotent-Replayed"] == "true"
    assert effects() == 2
