"""Every failure of a Redis client is a failure kind, never a crash, and only a Redis that
cannot be reached may fail open. Real failures, each provoked for real: a cluster URL
nobody answers, a server without cluster mode, a pool whose one connection another thread
holds, a server at its ``maxclients`` or refusing our credentials, a paused server under a
renewal, and a Celery task (an in-process worker on an in-memory broker) retried through a
cluster outage until a one-node cluster comes up.

The Redis store on db 3 of the local Redis (``IDEMPOTENCY_TEST_REDIS_URL``), throwaway
servers on ``IDEMPOTENCY_TEST_SCRATCH_PORT`` (default 6390) and on free ports.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
from django.contrib.auth.models import User
from django.db import connections

from idempotency_django.store.base import Scope, StoreError, get_store
from tests import writes
from tests.conftest import REDIS_URL, Post, effects, store_unavailable
from tools import redis_cluster

if TYPE_CHECKING:
    from pytest_django import Settings as SettingsWrapper

redis = pytest.importorskip("redis")

from idempotency_django.store.redis import RedisStore  # noqa: E402 - needs redis-py

REDIS_STORE = "idempotency_django.store.redis.RedisStore"
PREFIX = "idemfail"
SCRATCH_PORT = int(os.environ.get("IDEMPOTENCY_TEST_SCRATCH_PORT", "6390"))


def _redis_up(url: str) -> bool:
    try:
        return bool(redis_cluster.connect(url).ping())
    except (redis.RedisError, redis.exceptions.RedisClusterException, IndexError):
        return False


needs_redis = pytest.mark.skipif(
    REDIS_URL.partition("://")[0].endswith("+cluster") or not _redis_up(REDIS_URL),
    reason=f"needs a single Redis at {REDIS_URL}",
)
needs_server = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")

pytestmark = pytest.mark.redis


def use_redis(settings: SettingsWrapper, url: str, **more: Any) -> None:
    options = {"URL": url, "KEY_PREFIX": PREFIX, **more.pop("STORE_OPTIONS", {})}
    settings.IDEMPOTENCY = {"STORE": REDIS_STORE, "STORE_OPTIONS": options, **more}


def store() -> RedisStore:
    found = get_store(REDIS_STORE)
    assert isinstance(found, RedisStore)
    return found


def assert_503(response: Any) -> None:
    assert response.status_code == 503
    assert response["Content-Type"] == "application/problem+json"
    assert response["Retry-After"] == "1"
    assert json.loads(response.content)["type"].endswith("store-unavailable")


@pytest.fixture
def scratch() -> Iterator[redis_cluster.StandaloneRedis]:
    """A redis-server of this test's own (no persistence), stopped after it."""
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server")
    server = redis_cluster.StandaloneRedis(port=SCRATCH_PORT).start()
    yield server
    server.stop()


# -- a cluster that cannot be reached ----------------------------------------------------------


def test_a_cluster_that_cannot_be_reached_is_a_503_not_a_500(
    alice: User, post: Post, settings: SettingsWrapper
) -> None:
    """Building the cluster client asks its startup nodes for the map: none answers
    (``RedisClusterUnreachableError``, not a ``RedisError``). The view never runs."""
    use_redis(settings, f"redis+cluster://127.0.0.1:{redis_cluster.free_port()}/0")

    with store_unavailable() as sent:
        response = post("/effect/", {})

    assert_503(response)
    assert sent == [("closed", "unreachable")]
    assert effects() == 0


def test_a_cluster_that_cannot_be_reached_fails_open_when_asked(
    alice: User, post: Post, settings: SettingsWrapper
) -> None:
    url = f"redis+cluster://127.0.0.1:{redis_cluster.free_port()}/0"
    use_redis(settings, url, ON_STORE_ERROR="open")

    with store_unavailable() as sent:
        response = post("/effect/", {})

    assert response.status_code == 201
    assert sent == [("open", "unreachable")]
    assert effects() == 1


def test_a_cluster_url_on_a_redis_without_cluster_mode_never_fails_open(
    alice: User, post: Post, settings: SettingsWrapper, scratch: redis_cluster.StandaloneRedis
) -> None:
    """Redis answers, but is no cluster: a configuration error, not an outage."""
    use_redis(settings, f"redis+cluster://127.0.0.1:{scratch.port}/0", ON_STORE_ERROR="open")

    with store_unavailable() as sent:
        response = post("/effect/", {})

    assert_503(response)
    assert sent == [("closed", "other")]
    assert effects() == 0


@needs_server
def test_a_cluster_that_says_it_is_down_fails_closed_or_open_as_asked(
    alice: User, post: Post, settings: SettingsWrapper
) -> None:
    """A cluster whose slots no node serves (as during a failover) refuses every command
    with ``CLUSTERDOWN``: nothing ran, so it is unreachable. A one-node cluster here, its
    client built by a first request, then every slot taken from it."""
    cluster = redis_cluster.SmallCluster((redis_cluster.free_port(cluster=True),)).start()
    try:
        use_redis(settings, cluster.url)
        assert post("/effect/", {}, key="before").status_code == 201
        with redis_cluster.client(cluster.ports[0]) as node:
            node.execute_command("CLUSTER DELSLOTSRANGE", 0, 16383)
        with store_unavailable() as sent:
            closed = post("/effect/", {}, key="closed")
            settings.IDEMPOTENCY = {**settings.IDEMPOTENCY, "ON_STORE_ERROR": "open"}
            opened = post("/effect/", {}, key="open")
    finally:
        cluster.stop()

    assert_503(closed)
    assert opened.status_code == 201
    assert sent == [("closed", "unreachable"), ("open", "unreachable")]
    assert effects() == 2


# -- exhaustion: Redis is there, but has no connection to spare --------------------------------


@needs_redis
def test_a_full_pool_never_fails_open(alice: User, post: Post, settings: SettingsWrapper) -> None:
    """``max_connections=1`` and another thread holds that connection: redis-py raises
    ``MaxConnectionsError``, a ``ConnectionError``. Failing open would run the view twice
    for two identical requests while Redis answers everyone else."""
    use_redis(settings, f"{REDIS_URL}?max_connections=1", ON_STORE_ERROR="open")
    pool = store().client().connection_pool
    assert pool.max_connections == 1
    held, done = threading.Event(), threading.Event()

    def holder() -> None:
        connection = pool.get_connection()
        held.set()
        done.wait(10)
        pool.release(connection)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(10)
        with store_unavailable() as sent:
            refused = post("/effect/", {})
    finally:
        done.set()
        thread.join(10)

    assert_503(refused)
    assert sent == [("closed", "other")]
    assert effects() == 0
    assert post("/effect/", {}, key="k2").status_code == 201  # the connection is back


@needs_redis
def test_a_blocking_pool_with_no_connection_to_spare_is_other() -> None:
    """``BlockingConnectionPool`` waits, then raises "No connection available."."""
    pool = redis.BlockingConnectionPool.from_url(REDIS_URL, max_connections=1, timeout=0.05)
    connection = pool.get_connection()
    try:
        with pytest.raises(redis.ConnectionError) as raised:
            redis.Redis(connection_pool=pool).ping()
    finally:
        pool.release(connection)
        pool.disconnect()

    assert "No connection available" in str(raised.value)
    assert store().failure_kind(raised.value) == "other"


@pytest.mark.parametrize("refusal", ["maxclients", "requirepass"])
def test_a_redis_that_refuses_a_connection_never_fails_open(
    alice: User,
    post: Post,
    settings: SettingsWrapper,
    scratch: redis_cluster.StandaloneRedis,
    refusal: str,
) -> None:
    """A server at its ``maxclients`` ("max number of clients reached": perhaps filled on
    purpose), or one that refuses our credentials: Redis is there, the request is a 503."""
    use_redis(settings, scratch.url, ON_STORE_ERROR="open")
    admin = redis.Redis(port=scratch.port, single_connection_client=True)
    admin.config_set(refusal, "1" if refusal == "maxclients" else "not-the-password")
    try:
        with store_unavailable() as sent:
            refused = post("/effect/", {})
    finally:
        if refusal == "requirepass":
            admin.execute_command("AUTH", "not-the-password")
        admin.config_set(refusal, "10000" if refusal == "maxclients" else "")
        admin.close()

    assert_503(refused)
    assert sent == [("closed", "other")]
    assert effects() == 0


# -- reset() and renew() --------------------------------------------------------------------


@needs_redis
def test_a_reset_leaves_the_connections_other_threads_are_using(
    settings: SettingsWrapper,
) -> None:
    """``shell.reconnecting`` resets the store after a lost connection. Another thread
    blocked in a command on the same pool must get its answer, not a closed socket."""
    use_redis(settings, REDIS_URL, STORE_OPTIONS={"SOCKET_TIMEOUT": 10})
    client = store().client()
    database = str(client.connection_pool.connection_kwargs.get("db", 0))
    key = f"{PREFIX}:blocked:{uuid.uuid4()}"
    answers: list[Any] = []

    def blocked() -> None:
        try:
            answers.append(client.blpop(key, timeout=8))
        except redis.RedisError as error:
            answers.append(error)

    thread = threading.Thread(target=blocked)
    thread.start()
    watcher = redis_cluster.connect(REDIS_URL)
    try:
        deadline = time.monotonic() + 10
        while not any(
            entry.get("cmd") == "blpop" and entry.get("db") == database
            for entry in watcher.client_list()
        ):
            assert time.monotonic() < deadline, "the other thread never blocked"
            time.sleep(0.02)
        store().reset()
        watcher.lpush(key, "answer")
    finally:
        thread.join(10)
        watcher.delete(key)
        watcher.close()

    assert answers == [(key.encode(), b"answer")]


def test_a_renewal_is_bounded_by_its_timeout_not_by_socket_timeout(
    settings: SettingsWrapper, scratch: redis_cluster.StandaloneRedis
) -> None:
    """The heartbeat gives ``renew`` a third of the lease: a renewal that waits out a
    longer ``SOCKET_TIMEOUT`` comes back after the next beat was due, as the database
    store's statement timeout prevents. Redis paused for 3 s; ``SOCKET_TIMEOUT`` 5 s."""
    use_redis(settings, scratch.url, STORE_OPTIONS={"SOCKET_TIMEOUT": 5})
    lookup = Scope("1", "POST /effect/", "k1")
    assert store().claim_or_read(writes.write("a" * 32)) == "claimed"
    assert store().renew([(lookup, "a" * 32)], 30, 0.3) == 1  # its client is up
    redis.Redis(port=scratch.port).execute_command("CLIENT", "PAUSE", "3000", "ALL")

    started = time.monotonic()
    with pytest.raises(StoreError) as raised:
        store().renew([(lookup, "a" * 32)], 30, 0.3)
    took = time.monotonic() - started

    assert raised.value.kind == "other"  # timed out: it may have run
    assert took < 2.0


# -- Celery: a cluster outage is a retry, and the work runs once when it is back -----------------


def wait_for(condition: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"not within {within} s: {what}"
        time.sleep(0.05)


@pytest.fixture
def in_process_worker() -> Iterator[Any]:
    """A real Celery worker (``celery.contrib.testing``: consumer, ETA timer, acks) in a
    thread of this process, on an in-memory broker and result backend: the app, with a
    task ``charge`` on the Redis store, keyed by its ``order`` argument."""
    celery = pytest.importorskip("celery")
    from celery import _state
    from celery import signals as celery_signals
    from celery.contrib.testing.worker import start_worker

    from idempotency_django.celery import IdempotentTask
    from tests.models import SideEffect

    # The worker makes its app the current and default one: given back after the test.
    previous = getattr(_state._tls, "current_app", None), _state.default_app
    app = celery.Celery("redis-failures", broker="memory://", backend="cache+memory://")
    app.conf.update(task_default_queue=f"q-{uuid.uuid4()}")

    @app.task(
        base=IdempotentTask,
        name="tests.redis_failures.charge",
        idempotency={"scope": "orders", "key": "order", "store": REDIS_STORE},
    )
    def charge(order: str) -> dict[str, Any]:
        return {"effect": SideEffect.objects.create(label=f"charge:{order}").pk}

    def close_connections(**kwargs: Any) -> None:
        connections.close_all()  # the worker thread's own

    def keep_logging(**kwargs: Any) -> None:
        """A receiver: Celery then leaves logging alone (it would set the root logger's
        level to the worker's, and later tests' ``caplog`` would see nothing)."""

    celery_signals.task_postrun.connect(close_connections, sender=charge, weak=False)
    celery_signals.setup_logging.connect(keep_logging, weak=False)
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=30):
            yield app
    finally:
        celery_signals.setup_logging.disconnect(keep_logging)
        celery_signals.task_postrun.disconnect(close_connections, sender=charge)
        _state._set_current_app(previous[0])
        _state.set_default_app(previous[1])


@needs_server
@pytest.mark.django_db(
    transaction=True, databases="__all__"
)  # Celery runs the checks: every database on Django 6.1
def test_a_celery_task_is_retried_through_a_cluster_outage_and_runs_once_after_it(
    settings: SettingsWrapper, in_process_worker: Any
) -> None:
    """The store is a cluster that cannot be reached (its client cannot even be built):
    the task is retried (its message is not failed and acked), and once a cluster answers
    at that address, it runs once."""
    cluster = redis_cluster.SmallCluster((redis_cluster.free_port(cluster=True),))
    use_redis(settings, cluster.url)
    charge = in_process_worker.tasks["tests.redis_failures.charge"]
    order = f"order-{uuid.uuid4()}"
    try:
        message = charge.delay(order)
        wait_for(lambda: message.state == "RETRY", 30, "the task retried")
        assert effects(f"charge:{order}") == 0
        cluster.start()

        result = message.get(timeout=30)
    finally:
        cluster.stop()

    assert message.state == "SUCCESS"
    assert effects(f"charge:{order}") == 1
    assert result == {"effect": effects_pk(order)}


def effects_pk(order: str) -> int:
    from tests.models import SideEffect

    return int(SideEffect.objects.get(label=f"charge:{order}").pk)
