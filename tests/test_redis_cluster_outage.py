"""The Redis store when the whole Redis Cluster is down (3 masters, 3 replicas:
``tools/redis_cluster``): every node killed (connections refused) or frozen with SIGSTOP
(connections accepted, never answered), before the store's client is built or under a
client that has served requests. A cluster that cannot be reached is a 503 problem, or a
run without a claim where ``ON_STORE_ERROR`` is "open"; one whose commands time out is an
unknown outcome and never fails open; no store call lets a redis-py exception through.

Marked ``redis_cluster`` (slow: each test takes the cluster down and waits for it to be
whole again) and run in that ``.ci/run`` step.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import User

from idempotency_django.store.base import Scope, StoreError, get_store
from tests import writes
from tests.conftest import Post, effects, store_unavailable
from tools import redis_cluster

pytestmark = [pytest.mark.redis_cluster, pytest.mark.django_db(transaction=True)]

REDIS_STORE = "idempotency_django.store.redis.RedisStore"


@pytest.fixture(scope="module")
def cluster() -> str:
    try:
        import idempotency_django.store.redis  # noqa: F401
    except ImportError as error:
        pytest.skip(f"no Redis store: {error}")
    if not redis_cluster.healthy():
        pytest.skip("no Redis Cluster (python -m tools.redis_cluster start)")
    return redis_cluster.cluster_url()


@pytest.fixture
def on_cluster(cluster: str, settings: Any) -> Callable[..., None]:
    """Points the store at the cluster under a key prefix of the test's own (so its client
    is built anew), with the given options and settings."""

    def use(**more: Any) -> None:
        options = {
            "URL": cluster,
            "CLUSTER": True,
            "KEY_PREFIX": f"o{uuid.uuid4().hex[:8]}",
            "SOCKET_TIMEOUT": 0.5,
            "CONNECT_TIMEOUT": 0.5,
            **more.pop("STORE_OPTIONS", {}),
        }
        settings.IDEMPOTENCY = {"STORE": REDIS_STORE, "STORE_OPTIONS": options, **more}

    return use


def assert_503(response: Any) -> None:
    assert response.status_code == 503
    assert response["Content-Type"] == "application/problem+json"
    assert json.loads(response.content)["type"].endswith("store-unavailable")


@pytest.mark.parametrize("policy", ["closed", "open"])
def test_a_cluster_down_before_the_client_is_built(
    alice: User, post: Post, on_cluster: Callable[..., None], policy: str
) -> None:
    """No startup node answers while the client reads the cluster's map: 503, or a run
    without a claim when the view may fail open. Never a 500."""
    on_cluster(ON_STORE_ERROR=policy)
    with redis_cluster.all_down("kill"), store_unavailable() as sent:
        response = post("/effect/", {})

    if policy == "closed":
        assert_503(response)
        assert effects() == 0
    else:
        assert response.status_code == 201
        assert effects() == 1
    assert sent == [(policy, "unreachable")]


@pytest.mark.parametrize(("policy", "wait_replicas"), [("closed", 0), ("open", 0), ("open", 1)])
def test_a_cluster_killed_under_a_client_that_served_requests(
    alice: User, post: Post, on_cluster: Callable[..., None], policy: str, wait_replicas: int
) -> None:
    """The client has its map and its connections; the cluster dies (with
    ``WAIT_REPLICAS``: the write and its ``WAIT`` sent to the node itself, which asks
    the cluster for a new map when the node fails)."""
    on_cluster(ON_STORE_ERROR=policy, STORE_OPTIONS={"WAIT_REPLICAS": wait_replicas})
    assert post("/effect/", {}, key="before").status_code == 201

    with redis_cluster.all_down("kill"), store_unavailable() as sent:
        response = post("/effect/", {}, key="during")

    if policy == "closed":
        assert_503(response)
        assert effects() == 1
    else:
        assert response.status_code == 201
        assert effects() == 2
    assert sent == [(policy, "unreachable")]


def test_a_frozen_cluster_is_an_unknown_outcome_never_a_fail_open(
    alice: User, post: Post, on_cluster: Callable[..., None]
) -> None:
    """Frozen nodes accept the claim and never answer: it may run when they wake, so the
    timeout is not "unreachable". Each request's claim times out; by the third, redis-py
    also asks for a new map, cannot read it, and reports the claim's timeout as
    ``RedisClusterUnreachableError`` caused by it: still an unknown outcome."""
    on_cluster(ON_STORE_ERROR="open")
    assert post("/effect/", {}, key="before").status_code == 201

    with redis_cluster.all_down("stop"), store_unavailable() as sent:
        responses = [post("/effect/", {}, key=f"during-{n}") for n in range(3)]

    for response in responses:
        assert_503(response)
    assert sent == [("closed", "other")] * 3
    assert effects() == 1


def test_a_cluster_frozen_before_the_client_is_built_fails_open_when_asked(
    alice: User, post: Post, on_cluster: Callable[..., None]
) -> None:
    """Only the cluster's map was asked for, and never answered: nothing of the request's
    was sent, so the cluster is unreachable."""
    on_cluster(ON_STORE_ERROR="open")
    with redis_cluster.all_down("stop"), store_unavailable() as sent:
        response = post("/effect/", {})

    assert response.status_code == 201
    assert sent == [("open", "unreachable")]
    assert effects() == 1


def test_every_store_call_on_a_dead_cluster_is_a_store_error(
    on_cluster: Callable[..., None],
) -> None:
    """The claim, the reads, the completion, the release and the renewal (with a beat
    shorter and longer than ``SOCKET_TIMEOUT``): a ``StoreError`` of kind "unreachable"
    each, which the lifecycle and the heartbeat handle; ``usable`` says no."""
    on_cluster()
    store = get_store(REDIS_STORE)
    lookup = Scope("1", "POST /effect/", "k1")
    claim = writes.write("a" * 32)
    completion = writes.completion(201, b"{}", headers=())
    assert store.claim_or_read(claim) == "claimed"
    calls: dict[str, Callable[[], Any]] = {
        "claim": lambda: store.claim_or_read(writes.write("a" * 32, key="k2")),
        "read": lambda: store.read(lookup, "x"),  # type: ignore[attr-defined]
        "read_stored": lambda: store.read_stored(store.key(lookup)),  # type: ignore[attr-defined]
        "is_completed": lambda: store.is_completed(lookup, "a" * 32),
        "complete": lambda: store.complete(lookup, "a" * 32, completion),
        "release": lambda: store.release(lookup, "a" * 32),
        "renew, short beat": lambda: store.renew([(lookup, "a" * 32)], 30, 0.2),
        "renew": lambda: store.renew([(lookup, "a" * 32)], 30, 10),
    }
    kinds: dict[str, str] = {}
    with redis_cluster.all_down("kill"):
        for name, call in calls.items():
            try:
                call()
            except StoreError as error:
                kinds[name] = error.kind
        usable = store.usable()

    assert kinds == dict.fromkeys(calls, "unreachable")
    assert usable is False
