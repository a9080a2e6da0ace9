"""The Redis store on a master found through Redis Sentinel.

The URL and the options that name the Sentinels, and the check E029, without servers. Then
a real topology (``tools.ha.sentinel``: a master, a replica and three Sentinels of this
module's own): the store talks to the master the Sentinels name and finds the promoted
replica after a failover; a frozen Sentinel costs a timeout, not a hung request; Sentinels
that cannot name a master are a store outage (503, or a run unprotected under
``ON_STORE_ERROR = "open"``); the master killed under load answers 201 or 503, never a
500, and every key answered 201 ran once and replays. What a failover loses by design (a
claim the master acknowledged and never replicated) is pinned down, and ``WAIT_REPLICAS``
refusing it.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
from django.db import connections
from django.test import Client

from idempotency_django.checks import check_settings
from tests.conftest import effects, wait_until
from tests.project.views import gate
from tools import redis_cluster
from tools.ha.sentinel import SentinelTopology

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from pytest_django import Settings as SettingsWrapper

redis = pytest.importorskip("redis")

from idempotency_django.store import redis_sentinel  # noqa: E402
from idempotency_django.store.base import get_store  # noqa: E402
from idempotency_django.store.redis import RedisStore  # noqa: E402

REDIS_STORE = "idempotency_django.store.redis.RedisStore"
THREADS = 6
needs_sentinel = pytest.mark.skipif(
    shutil.which("redis-sentinel") is None or shutil.which("redis-server") is None,
    reason="needs redis-server and redis-sentinel",
)


# -- the URL, the options, E029 -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "redis+sentinel://h1:26380,h2/mymaster/2",
            redis_sentinel.SentinelConfig((("h1", 26380), ("h2", 26379)), "mymaster", 2),
        ),
        (
            "rediss+sentinel://user:p%40ss@[::1]:26379/cache",
            redis_sentinel.SentinelConfig(
                (("::1", 26379),), "cache", 0, username="user", password="p@ss", ssl=True
            ),
        ),
        (
            "redis+sentinel://:secret@h:1/m/",
            redis_sentinel.SentinelConfig((("h", 1),), "m", 0, password="secret"),
        ),
    ],
)
def test_a_sentinel_url_names_the_sentinels_the_service_and_the_masters_database(
    url: str, expected: redis_sentinel.SentinelConfig
) -> None:
    assert redis_sentinel.parse_url(url) == expected
    assert RedisStore.check_options({"URL": url}) == []


def test_the_options_name_the_sentinels_and_the_url_the_masters_database() -> None:
    options = {
        **RedisStore().options(),
        "URL": "rediss://:pw@ignored/3",
        "SENTINELS": [("s1", 26379), "s2:26380", "s3"],
        "SERVICE_NAME": "payments",
    }
    assert redis_sentinel.sentinel_config(options) == redis_sentinel.SentinelConfig(
        (("s1", 26379), ("s2", 26380), ("s3", 26379)), "payments", 3, password="pw", ssl=True
    )
    assert RedisStore.check_options({key: options[key] for key in options}) == []
    plain = RedisStore().options()
    assert redis_sentinel.sentinel_config(plain) is None


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"SENTINELS": [("h", 26379)]}, "SENTINELS without a SERVICE_NAME"),
        ({"SERVICE_NAME": "m"}, "SERVICE_NAME is given but no Sentinel"),
        ({"SENTINELS": "h:26379", "SERVICE_NAME": "m"}, "SENTINELS 'h:26379' is not a list"),
        ({"SENTINELS": [("h", 0)], "SERVICE_NAME": "m"}, "is not a host and a port 1-65535"),
        ({"SENTINELS": ["h:port"], "SERVICE_NAME": "m"}, "is not host:port"),
        ({"SENTINELS": [7], "SERVICE_NAME": "m"}, "is not a (host, port) pair"),
        ({"URL": "redis+sentinel://h:1/", "SENTINELS": []}, "names no service"),
        ({"URL": "redis+sentinel:///m/0"}, "names no Sentinel"),
        ({"URL": "redis+sentinel://h:1/m/x"}, "database 'x' is not a whole number"),
        (
            {"URL": "redis+sentinel://h:1/m", "SERVICE_NAME": "m"},
            "a redis+sentinel:// URL and SENTINELS or SERVICE_NAME",
        ),
        ({"URL": "redis+sentinel://h:1/m", "CLUSTER": True}, "CLUSTER and Sentinel together"),
        (
            {"URL": "unix:///run/redis.sock", "SENTINELS": ["h"], "SERVICE_NAME": "m"},
            "with SENTINELS is not a redis:// or rediss:// URL",
        ),
        ({"URL": "redis://h/x", "SENTINELS": ["h"], "SERVICE_NAME": "m"}, "is not a whole"),
        ({"URL": "redis+sentinel://h:1/m", "SENTINEL_PASSWORD": 1}, "SENTINEL_PASSWORD 1"),
        ({"SERVICE_NAME": 1}, "SERVICE_NAME 1 is not a string"),
    ],
)
def test_e029_names_sentinel_options_the_store_cannot_use(
    options: dict[str, object], problem: str
) -> None:
    errors = RedisStore.check_options(options)
    assert [error.id for error in errors] == ["idempotency_django.E029"]
    assert problem in str(errors[0].msg)


def test_e029_is_a_registered_check(settings: SettingsWrapper) -> None:
    settings.IDEMPOTENCY = {"STORE": REDIS_STORE, "STORE_OPTIONS": {"SERVICE_NAME": "m"}}
    assert [m.id for m in check_settings()] == ["idempotency_django.E029"]


@pytest.mark.parametrize(
    ("url", "check"),
    [("redis+sentinel://127.0.0.1:1/", "E029"), ("http://127.0.0.1:1/0", "E026")],
)
def test_a_url_the_store_cannot_use_is_reported_by_every_check_without_crashing(
    settings: SettingsWrapper, url: str, check: str
) -> None:
    """All the checks (the eviction check too, which asks the server): the URL's own
    error, never a ``ValueError`` out of ``manage.py check``."""
    from django.core.checks import run_checks

    settings.IDEMPOTENCY = {"STORE": REDIS_STORE, "STORE_OPTIONS": {"URL": url}}
    ids = [message.id for message in run_checks() if message.id]
    assert f"idempotency_django.{check}" in ids


@pytest.mark.django_db
def test_a_url_the_store_cannot_use_is_a_503_where_the_checks_were_silenced(
    settings: SettingsWrapper, alice: User
) -> None:
    settings.IDEMPOTENCY = {
        "STORE": REDIS_STORE,
        "ON_STORE_ERROR": "open",  # not "unreachable": a configuration never fails open
        "STORE_OPTIONS": {"URL": "redis+sentinel://127.0.0.1:1/"},
    }
    response = charge(f"k-{uuid.uuid4()}")
    assert response.status_code == 503
    assert response["Content-Type"] == "application/problem+json"
    assert effects() == 0


# -- Sentinels that name no master ----------------------------------------------------------------


def _nothing_listens() -> list[str]:
    return [f"127.0.0.1:{redis_cluster.free_port()}" for _ in range(2)]


def charge(key: str, client: Client | None = None) -> Any:
    return (client or Client()).post(
        "/keyed-effect/",
        data=json.dumps({"amount": 1}),
        content_type="application/json",
        headers={"Idempotency-Key": key, "X-User": "alice"},
    )


@pytest.mark.django_db
@pytest.mark.parametrize(("on_store_error", "status"), [("closed", 503), ("open", 201)])
def test_sentinels_that_cannot_be_reached_are_a_store_outage(
    settings: SettingsWrapper, alice: User, on_store_error: str, status: int
) -> None:
    """No Sentinel answers: nothing of the request reached a Redis, so this is the store
    being unreachable (``MasterNotFoundError``): 503 problem+json with ``Retry-After``, or
    under ``ON_STORE_ERROR = "open"`` the view run unprotected. Never a 500."""
    settings.IDEMPOTENCY = {
        "STORE": REDIS_STORE,
        "ON_STORE_ERROR": on_store_error,
        "STORE_OPTIONS": {
            "URL": f"redis+sentinel://{','.join(_nothing_listens())}/mymaster/0",
            "CONNECT_TIMEOUT": 0.5,
        },
    }
    response = charge(f"k-{uuid.uuid4()}")
    assert response.status_code == status
    assert effects() == (1 if on_store_error == "open" else 0)
    if status == 503:
        assert response["Content-Type"] == "application/problem+json"
        assert int(response["Retry-After"]) > 0


# -- a real topology ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def topology() -> Iterator[SentinelTopology]:
    if shutil.which("redis-sentinel") is None or shutil.which("redis-server") is None:
        pytest.skip("needs redis-server and redis-sentinel")
    started = SentinelTopology().start()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def prefix(topology: SentinelTopology, settings: SettingsWrapper) -> str:
    """The store on the topology (its URL alone), under a key prefix of this test's own;
    the topology whole again (a node killed by an earlier test restarted, in sync)."""
    topology.wait_ready()
    prefix = f"s{uuid.uuid4().hex[:8]}"
    use(settings, topology, prefix)
    return prefix


def use(settings: SettingsWrapper, topology: SentinelTopology, prefix: str, **options: Any) -> None:
    settings.IDEMPOTENCY = {
        "STORE": REDIS_STORE,
        "STORE_OPTIONS": {"URL": topology.url(), "KEY_PREFIX": prefix, **options},
    }


def answered(key: str, within: float = 20) -> Any:
    """``charge(key)``'s first answer that is not a 503: the first requests after a
    failover may meet the dead master's pooled connections (refused, then re-asked)."""
    deadline = time.monotonic() + within
    response = charge(key)
    while response.status_code == 503 and time.monotonic() < deadline:
        response = charge(key)
    return response


def records(port: int, prefix: str) -> list[bytes]:
    with redis_cluster.client(port) as connection:
        return [bytes(key) for key in connection.keys(f"{prefix}:*")]


def restart_killed(topology: SentinelTopology) -> None:
    for port in topology.redis_ports:
        if not redis_cluster.answers(port):
            topology.restart(port)


@needs_sentinel
@pytest.mark.redis
@pytest.mark.django_db(transaction=True)
def test_the_store_talks_to_the_master_the_sentinels_name(
    topology: SentinelTopology, prefix: str, alice: User
) -> None:
    """A claim lands on the master (written there, then replicated); after the master is
    killed and its replica promoted, the same process's store finds the new master: a
    replay of the first key, and a new key claimed there."""
    first = charge("k-before")
    assert first.status_code == 201
    master = topology.master()
    assert records(master, prefix)
    connection = get_store(REDIS_STORE).client().connection_pool.get_connection()
    try:
        assert connection.port == master  # redis-py's Sentinel pool: the master, not a replica
    finally:
        get_store(REDIS_STORE).client().connection_pool.release(connection)
    try:
        promoted = int(topology.kill_primary().rpartition(":")[2])
        assert promoted != master
        replay = answered("k-before")
        assert replay.status_code == 201
        assert replay["Idempotent-Replayed"] == "true"
        assert replay.content == first.content
        assert charge("k-after").status_code == 201
        assert len(records(promoted, prefix)) == 2
        assert effects() == 2
    finally:
        restart_killed(topology)


@needs_sentinel
@pytest.mark.redis
@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_a_frozen_sentinel_costs_a_timeout_not_a_hung_request(
    topology: SentinelTopology, prefix: str, settings: SettingsWrapper, alice: User
) -> None:
    """The first Sentinel asked accepts connections and never answers (SIGSTOP): the store
    gives it its own timeout (0.5 s here) and asks the next one, and the request is
    answered. Not redis-py's default for a Sentinel (5 s per Sentinel, for every new
    connection): the answer must come well before that."""
    use(settings, topology, prefix, CONNECT_TIMEOUT=0.5, SOCKET_TIMEOUT=0.5)
    with redis_cluster.client(topology.sentinel_ports[0]) as connection:
        pid = int(connection.info("server")["process_id"])
    results: queue.Queue[Any] = queue.Queue()
    os.kill(pid, signal.SIGSTOP)
    try:
        thread = threading.Thread(target=lambda: results.put(charge("k-frozen")))
        thread.start()
        response = results.get(timeout=4)  # 0.5 s for the frozen one, 5 s by default
    finally:
        os.kill(pid, signal.SIGCONT)
        thread.join(30)
    assert response.status_code == 201


@needs_sentinel
@pytest.mark.redis
@pytest.mark.django_db
def test_a_service_the_sentinels_do_not_know_is_an_outage(
    topology: SentinelTopology, settings: SettingsWrapper, alice: User
) -> None:
    settings.IDEMPOTENCY = {
        "STORE": REDIS_STORE,
        "STORE_OPTIONS": {"URL": topology.url().replace("/mymaster/", "/unknown/")},
    }
    response = charge("k-unknown")
    assert response.status_code == 503
    assert response["Content-Type"] == "application/problem+json"
    assert effects() == 0


@needs_sentinel
@pytest.mark.redis
@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("fault", "wait_replicas"),
    [("kill", 0), ("kill", 1), ("switch-over", 0)],
    ids=["kill-async", "kill-wait-replicas", "switch-over"],
)
def test_the_master_failed_over_under_load(
    topology: SentinelTopology,
    prefix: str,
    settings: SettingsWrapper,
    alice: User,
    fault: str,
    wait_replicas: int,
) -> None:
    """Threads send requests, a key each, while the master is SIGKILLed and the Sentinels
    promote its replica (the killed node is restarted, a replica of the new master, while
    the load goes on), or while the master hands over in a switch-over (its writes paused,
    then demoted: the store's connections to it are dropped or answered ``READONLY``, and
    it asks the Sentinels again). Every answer is 201 or 503 (never a 500); a key answered
    503 never ran; no key ran twice; and every key answered 201 replays its answer, except
    one whose outcome the killed master acknowledged and never replicated (possible only
    without ``WAIT_REPLICAS``; the test reports how many there were)."""
    use(settings, topology, prefix, WAIT_REPLICAS=wait_replicas, WAIT_TIMEOUT_MS=500)
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
                response = charge(key, client)
                with lock:
                    answered[key] = response
                number += 1
        finally:
            connections.close_all()

    threads = [threading.Thread(target=load, args=(worker,)) for worker in range(THREADS)]
    for thread in threads:
        thread.start()
    started.wait(timeout=10)
    try:
        assert wait_until(lambda: len(answered) >= 2 * THREADS, timeout=30)
        if fault == "kill":
            topology.kill_primary()  # and the killed node back: WAIT_REPLICAS needs it
        else:
            topology.failover()
        before = sum(1 for r in list(answered.values()) if r.status_code == 201)
        assert wait_until(
            lambda: (
                sum(1 for r in list(answered.values()) if r.status_code == 201)
                >= before + 2 * THREADS
            ),
            timeout=30,
        )
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
        restart_killed(topology)

    statuses = [response.status_code for response in answered.values()]
    ran = {key: effects(f"key:{key}") for key in answered}
    assert set(statuses) <= {201, 503}, sorted(set(statuses))
    assert {key: count for key, count in ran.items() if count > 1} == {}
    lost = []
    for key, response in answered.items():
        if response.status_code == 503:
            assert ran[key] == 0, key  # its claim failed: the view never ran
            continue
        assert ran[key] == 1, key
        replay = charge(key)
        if (
            fault == "kill"
            and not wait_replicas
            and (
                replay.status_code == 409  # its outcome was lost: in progress again
                or (replay.status_code == 201 and "Idempotent-Replayed" not in replay)
            )
        ):  # or its claim was lost, and the replay ran the view again
            lost.append(key)
            continue
        assert replay.status_code == 201, (key, replay.status_code)
        assert replay["Idempotent-Replayed"] == "true", key
        assert replay.content == response.content, key
    print(f"\n{len(answered)} keys, {statuses.count(503)} answered 503, outcomes lost: {lost}")


class InFlight:
    """One gated request in a thread of its own: its view holds until ``finish()``."""

    def __init__(self, key: str) -> None:
        self.result: queue.Queue[Any] = queue.Queue()
        self.thread = threading.Thread(target=self._send, args=(key,))
        self.thread.start()

    def _send(self, key: str) -> None:
        try:
            self.result.put(
                Client().post(
                    "/keyed-effect/",
                    data=json.dumps({"gate": True}),
                    content_type="application/json",
                    headers={"Idempotency-Key": key, "X-User": "alice"},
                )
            )
        finally:
            connections.close_all()

    def finish(self) -> Any:
        gate.release.set()
        self.thread.join(30)
        return self.result.get(timeout=1)


@needs_sentinel
@pytest.mark.redis
@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("wait_replicas", [0, 1], ids=["async", "wait-replicas"])
def test_a_claim_the_master_never_replicated_in_a_failover(
    topology: SentinelTopology,
    prefix: str,
    settings: SettingsWrapper,
    alice: User,
    wait_replicas: int,
) -> None:
    """What a Sentinel failover loses by design, and what ``WAIT_REPLICAS`` refuses.

    The replica is cut off (frozen, its link dropped), a request claims its key on the
    master, the master is killed and the replica promoted. Without ``WAIT_REPLICAS`` the
    claim was acknowledged and is gone: the view is running, and a retry of its key runs
    it a second time. With ``WAIT_REPLICAS = 1`` the claim no replica acknowledged is
    refused (503) before the view runs: the retry after the failover runs it once."""
    use(
        settings,
        topology,
        prefix,
        WAIT_REPLICAS=wait_replicas,
        WAIT_TIMEOUT_MS=500,
        SOCKET_TIMEOUT=5.0,
    )
    key = f"k-{uuid.uuid4()}"
    try:
        with topology.cut_off():
            first = InFlight(key)
            entered = wait_until(lambda: gate.entered.is_set() or not first.result.empty())
            assert entered
            killed = topology.master()
            topology.kill(killed)
        topology.wait_promoted(killed)
        topology.restart(killed)  # a replica again, for WAIT_REPLICAS to count
        retry = answered(key)
        answer = first.finish()
    finally:
        gate.release.set()
        restart_killed(topology)
    if wait_replicas:
        assert answer.status_code == 503
        assert retry.status_code == 201
        assert effects(f"key:{key}") == 1
    else:
        assert answer.status_code == 201
        assert retry.status_code == 201
        assert "Idempotent-Replayed" not in retry
        assert effects(f"key:{key}") == 2  # the documented loss: the view ran twice
