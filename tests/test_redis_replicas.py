"""``WAIT_REPLICAS`` on a master with one replica of the test's own
(``tools.redis_cluster.ReplicatedRedis``), no cluster: what no replica acknowledged is never
trusted. A claim or a take-over is refused (503) and its view never runs, also when its
first reply was lost and the resend finds its own record; a completion is sent again until
a replica acknowledges it, and the answer waits for it. The replica is frozen (SIGSTOP) so
that ``WAIT`` cannot be acknowledged; a reply is lost by killing the client's connection
while its ``WAIT`` blocks (``CLIENT KILL``), after the write it waits for has run.
"""

from __future__ import annotations

import json
import queue
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
from django.contrib.auth.models import User
from django.db import connections
from django.test import Client, RequestFactory
from django.utils import timezone

from idempotency_django import signals
from idempotency_django.core import claims, shell
from idempotency_django.keys import default_fingerprint
from idempotency_django.store.base import get_store
from idempotency_django.store.redis import RedisStore
from tests.conftest import effects, wait_until
from tests.project.views import gate
from tools import redis_cluster

if TYPE_CHECKING:
    from pytest_django import Settings as SettingsWrapper

redis = pytest.importorskip("redis")

pytestmark = [
    pytest.mark.redis,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]

REDIS_STORE = "idempotency_django.store.redis.RedisStore"
BODY = {"amount": 1, "gate": True}  # the gate is open unless a test holds the view in it


@pytest.fixture(autouse=True)
def _gate_open() -> None:
    gate.release.set()  # ``HeldRequest`` closes it


@pytest.fixture
def pair() -> Iterator[redis_cluster.ReplicatedRedis]:
    started = redis_cluster.ReplicatedRedis().start()
    yield started
    started.stop()


@pytest.fixture
def prefix(settings: SettingsWrapper, pair: redis_cluster.ReplicatedRedis) -> str:
    """The store on the pair's master with ``WAIT_REPLICAS = 1``, under a key prefix of this
    test's own (so its client, and every connection in its pool, is new)."""
    prefix = f"r{uuid.uuid4().hex[:8]}"
    use_pair(settings, pair, prefix)
    return prefix


def use_pair(
    settings: SettingsWrapper,
    pair: redis_cluster.ReplicatedRedis,
    prefix: str,
    *,
    wait_ms: int = 200,
    lease: float = 10,
) -> None:
    settings.IDEMPOTENCY = {
        "STORE": REDIS_STORE,
        "LEASE_SECONDS": lease,
        "STORE_OPTIONS": {
            "URL": pair.url,
            "KEY_PREFIX": prefix,
            "WAIT_REPLICAS": 1,
            "WAIT_TIMEOUT_MS": wait_ms,
            "SOCKET_TIMEOUT": 5.0,  # well over WAIT's: a refusal comes from WAIT's count
        },
    }


def send(key: str = "k1") -> Any:
    return Client().post(
        "/effect/",
        data=json.dumps(BODY),
        content_type="application/json",
        headers={"Idempotency-Key": key, "X-User": "alice"},
    )


def master(pair: redis_cluster.ReplicatedRedis) -> Any:
    return redis_cluster.client(pair.port)


def record(pair: redis_cluster.ReplicatedRedis, prefix: str) -> bytes | None:
    """The one record under ``prefix`` on the master (None: there is none)."""
    with master(pair) as connection:
        keys = connection.keys(f"{prefix}:*")
        assert len(keys) <= 1
        return bytes(connection.get(keys[0])) if keys else None


def waiting_clients(pair: redis_cluster.ReplicatedRedis) -> list[str]:
    """The ids of the master's clients blocked in ``WAIT``."""
    with master(pair) as connection:
        listed = connection.client_list()
    return [str(entry["id"]) for entry in listed if entry.get("cmd") == "wait"]


class LosesItsFirstReply:
    """Kills the connection of the first client seen blocked in ``WAIT`` on the master once
    ``written()`` says the write it waits for has run: its reply is lost."""

    def __init__(
        self, pair: redis_cluster.ReplicatedRedis, written: Callable[[], bool] = lambda: True
    ) -> None:
        self.pair = pair
        self.written = written
        self.killed: list[str] = []
        self.thread = threading.Thread(target=self._kill_one)
        self.thread.start()

    def _kill_one(self) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            waiting = waiting_clients(self.pair)
            if waiting and self.written():
                with master(self.pair) as connection:
                    connection.execute_command("CLIENT KILL ID", waiting[0])
                self.killed.append(waiting[0])
                return
            time.sleep(0.01)

    def join(self) -> list[str]:
        self.thread.join(30)
        return self.killed


@pytest.fixture
def not_stored() -> Iterator[list[str]]:
    keys: list[str] = []

    def receiver(signal: Any, **kwargs: Any) -> None:
        keys.append(signals.raw_key())

    signals.outcome_not_stored.connect(receiver, weak=False)
    yield keys
    signals.outcome_not_stored.disconnect(receiver)


# -- claims and take-overs ----------------------------------------------------------------------


def test_a_claim_no_replica_acknowledged_is_refused_and_its_view_never_runs(
    alice: User, pair: redis_cluster.ReplicatedRedis, prefix: str
) -> None:
    """A failover now would lose the claim and let a retry run the view a second time:
    503, the claim released, the view not run. Once the replica acknowledges, it runs."""
    with pair.frozen():
        refused = send()
        left = record(pair, prefix)

    assert refused.status_code == 503
    assert refused["Content-Type"] == "application/problem+json"
    assert effects() == 0
    assert left is None  # released, fenced by its token
    assert send().status_code == 201
    assert send()["Idempotent-Replayed"] == "true"
    assert effects() == 1


def test_a_claim_whose_reply_was_lost_is_confirmed_by_a_wait_or_refused(
    alice: User,
    pair: redis_cluster.ReplicatedRedis,
    settings: SettingsWrapper,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The claim is written and its reply lost (the connection killed while its WAIT
    blocks). The resend, on a new connection with the same token, finds its own record:
    not trusted as it is, but written again and waited for, and refused (503) when no
    replica acknowledges it. The view never runs unreplicated."""
    use_pair(settings, pair, prefix, wait_ms=2000)
    with pair.frozen():
        killer = LosesItsFirstReply(pair, written=lambda: record(pair, prefix) is not None)
        with caplog.at_level("WARNING", logger="idempotency_django"):
            refused = send()
        killed = killer.join()
        left = record(pair, prefix)

    assert refused.status_code == 503
    assert effects() == 0
    assert len(killed) == 1
    assert "retrying once on a new one" in caplog.text  # the resend
    assert left is None  # the resend released it
    assert send().status_code == 201
    assert effects() == 1


def test_a_take_over_whose_reply_was_lost_is_confirmed_by_a_wait_or_refused(
    alice: User,
    pair: redis_cluster.ReplicatedRedis,
    settings: SettingsWrapper,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A dead worker's lapsed claim is taken over, and the take-over's reply lost: the
    resend finds the record under its own token, writes it again, waits, and is refused
    when no replica acknowledges it."""
    dead = dead_workers_claim(alice, pair, prefix)
    use_pair(settings, pair, prefix, wait_ms=2000)

    def taken_over() -> bool:
        value = record(pair, prefix)
        return value is not None and value.split(b"|")[1] != dead

    with pair.frozen():
        killer = LosesItsFirstReply(pair, written=taken_over)
        with caplog.at_level("WARNING", logger="idempotency_django"):
            refused = send()
        killed = killer.join()

    assert refused.status_code == 503
    assert effects() == 0
    assert len(killed) == 1  # once the take-over had written the record
    assert "retrying once on a new one" in caplog.text
    assert send().status_code == 201
    assert effects() == 1


def test_a_take_over_no_replica_acknowledged_is_refused_and_released(
    alice: User, pair: redis_cluster.ReplicatedRedis, prefix: str
) -> None:
    """A dead worker's lapsed claim, taken over while no replica can acknowledge: refused
    (503) and released (fenced by the take-over's token), the view not run; once the replica
    is back, a retry runs it once."""
    dead_workers_claim(alice, pair, prefix)
    with pair.frozen():
        refused = send()
        left = record(pair, prefix)

    assert refused.status_code == 503
    assert refused["Content-Type"] == "application/problem+json"
    assert effects() == 0
    assert left is None
    assert send().status_code == 201
    assert effects() == 1


def dead_workers_claim(alice: User, pair: redis_cluster.ReplicatedRedis, prefix: str) -> bytes:
    """A claim of ``send()``'s key and request whose worker died (its lease has lapsed):
    its token."""
    request = RequestFactory().post(
        "/effect/", data=json.dumps(BODY), content_type="application/json"
    )
    policy = claims.ClaimPolicy(
        "default", lease=1, ttl=3600, in_flight="conflict", wait_seconds=0, retry_after=1
    )
    store = get_store(REDIS_STORE)
    assert isinstance(store, RedisStore)
    began = shell.claim_or_replay(
        claims.Scope(str(alice.pk), "POST /effect/", "k1"),
        default_fingerprint(request, "POST /effect/"),
        claims.ClaimPolicy(**{**policy.__dict__, "store": store}),
    )
    assert isinstance(began, claims.Claim)
    value = record(pair, prefix)
    assert value is not None
    with master(pair) as connection:
        (key,) = connection.keys(f"{prefix}:*")
        state, token, _lease, rest = value.split(b"|", 3)
        # Lapsed well before any WAIT's timeout: a lost claim's record is read with the
        # server's time before its WAIT and this process's after it.
        lapsed = str(int(time.time() * 1000) - 60_000).encode()
        connection.set(key, b"|".join([state, token, lapsed, rest]), keepttl=True)
    pair.wait_in_sync()
    return token


# -- completions --------------------------------------------------------------------------------


class HeldRequest:
    """``send()`` in a thread of its own, held in its view until ``release()``."""

    def __init__(self) -> None:
        gate.reset()
        self.answers: queue.Queue[Any] = queue.Queue()
        self.thread = threading.Thread(target=self._send)
        self.thread.start()
        assert gate.entered.wait(10)

    def _send(self) -> None:
        try:
            self.answers.put(send())
        finally:
            connections.close_all()  # a thread's own are never reused

    def release(self) -> None:
        gate.release.set()

    def answer(self) -> Any:
        self.thread.join(30)
        return self.answers.get(timeout=1)


def test_a_completion_waits_until_a_replica_acknowledges_it(
    alice: User,
    pair: redis_cluster.ReplicatedRedis,
    settings: SettingsWrapper,
    prefix: str,
    not_stored: list[str],
) -> None:
    """The view has run; the replica cannot acknowledge: the completion is on the master,
    and the request waits in a ``WAIT`` for it, not answered. The replica comes back: the
    answer is sent, the replica has the outcome, and a retry replays."""
    use_pair(settings, pair, prefix, wait_ms=1500)
    held = HeldRequest()
    try:
        with pair.frozen():
            held.release()
            completed = wait_until(
                lambda: (
                    (record(pair, prefix) or b"").startswith(b"c|") and bool(waiting_clients(pair))
                ),
                timeout=10,
            )
            unanswered = held.thread.is_alive()
        response = held.answer()
    finally:
        gate.release.set()
    (key,) = master(pair).keys(f"{prefix}:*")

    assert completed  # written on the master, its WAIT blocked
    assert unanswered  # …and the answer waited
    assert response.status_code == 201
    assert (pair.replica_get(key) or b"").startswith(b"c|")
    assert not_stored == []
    replay = send()
    assert replay["Idempotent-Replayed"] == "true"
    assert replay.content == response.content
    assert effects() == 1


def test_with_wait_replicas_a_first_request_is_still_two_round_trips(
    alice: User,
    pair: redis_cluster.ReplicatedRedis,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The claim's and the completion's ``WAIT`` each go in the same round trip as their
    write: what WAIT_REPLICAS adds is the replica's acknowledgement, not a round trip."""
    from tests.test_redis_store import _count_script_round_trips

    assert send("warm-up").status_code == 201  # a new Redis has no script cached yet
    calls = _count_script_round_trips(monkeypatch)
    response = send()

    assert response.status_code == 201
    assert len(calls) == 2
    assert all(b"WAIT" in call for call in calls)


def test_a_completion_no_replica_acknowledged_within_its_lease_is_signalled(
    alice: User,
    pair: redis_cluster.ReplicatedRedis,
    settings: SettingsWrapper,
    prefix: str,
    not_stored: list[str],
) -> None:
    """The replica stays frozen past the claim's lease: the completion is sent again until
    then, and given up: the work's answer is sent, ``outcome_not_stored`` is signalled."""
    use_pair(settings, pair, prefix, lease=1)
    held = HeldRequest()
    try:
        with pair.frozen():
            began = time.monotonic()
            held.release()
            response = held.answer()
            took = time.monotonic() - began
    finally:
        gate.release.set()

    assert response.status_code == 201
    assert not_stored == ["k1"]
    assert took >= 0.5  # sent again for most of the lease, not given up at once
    assert effects() == 1
    assert timezone.now()  # (the key's fate is the replication's: see the test above)
