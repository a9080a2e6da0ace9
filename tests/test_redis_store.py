"""The Redis store (``store/redis.py``) on a real Redis: the same answers as the database
store, its fencing, its lease on Redis's clock, renewal in one round trip, the hash tag,
and its failures (Redis down, restarted, paused) against a throwaway ``redis-server`` on
port 6390. Uses Redis db 3 (``IDEMPOTENCY_TEST_REDIS_URL``), flushed before each test."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from idempotency_django import signals
from idempotency_django.checks import check_settings
from idempotency_django.core import claims
from idempotency_django.core.heartbeat import Heartbeat
from idempotency_django.models import IdempotencyRecord
from idempotency_django.store.base import Completion, Scope, StoreError, Write, get_store
from idempotency_django.store.redis import RedisStore, record_key
from tests import writes
from tests.conftest import REDIS_URL, Post, effects, wait_until
from tests.project.views import gate
from tools import redis_cluster

if TYPE_CHECKING:
    from pytest_django import Settings as SettingsWrapper

redis = pytest.importorskip("redis")
RedisCluster = redis.cluster.RedisCluster

REDIS_STORE = "idempotency_django.store.redis.RedisStore"
PREFIX = "idemtest"
# IDEMPOTENCY_TEST_SCRATCH_PORT moves it, for two suites side by side on one machine.
SCRATCH_PORT = int(os.environ.get("IDEMPOTENCY_TEST_SCRATCH_PORT", "6390"))


def _redis_up(url: str) -> bool:
    try:
        return bool(redis_cluster.connect(url).ping())
    except (redis.RedisError, IndexError):
        return False


pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(not _redis_up(REDIS_URL), reason=f"no Redis at {REDIS_URL}"),
]


def use_redis(settings: SettingsWrapper, url: str = REDIS_URL, **more: Any) -> None:
    options = {"URL": url, "KEY_PREFIX": PREFIX, **more.pop("STORE_OPTIONS", {})}
    settings.IDEMPOTENCY = {"STORE": REDIS_STORE, "STORE_OPTIONS": options, **more}


@pytest.fixture(autouse=True)
def _on_redis(settings: SettingsWrapper) -> None:
    redis_cluster.flush(REDIS_URL)  # a redis+cluster:// URL: every master
    use_redis(settings)
    return


def redis_client() -> Any:
    return redis_cluster.connect(REDIS_URL)  # redis+cluster://: the cluster


def record_keys() -> list[bytes]:
    """The store's keys (on every master, on a cluster)."""
    client = redis_client()
    if isinstance(client, RedisCluster):
        return list(client.keys(f"{PREFIX}:*", target_nodes=RedisCluster.PRIMARIES))
    return list(client.keys(f"{PREFIX}:*"))


def store() -> RedisStore:
    found = get_store(REDIS_STORE)
    assert isinstance(found, RedisStore)
    return found


def lookup(key: str = "k1", account: str = "1") -> Scope:
    return Scope(account, "POST /effect/", key)


def claim_values(
    token: str,
    *,
    key: str = "k1",
    lease: float = 30,
    ttl: float = 3600,
    account: str = "1",
    fingerprint: str = "2:" + "a" * 64,
) -> Write:
    return writes.write(
        token, account=account, key=key, fingerprint=fingerprint, lease=lease, ttl=ttl
    )


def complete_values(status: int = 201, body: bytes | None = b"done") -> Completion:
    return writes.completion(status, body)


def server_ms() -> int:
    seconds, micros = redis_client().time()
    return int(seconds) * 1000 + int(micros) // 1000


def set_lease(key: str, lease_ms: int) -> None:
    """Rewrite a record's lease (Redis server ms), as a dead worker's would be."""
    client = redis_client()
    value = client.get(key)
    state, token, _lease, rest = value.split(b"|", 3)
    client.set(key, b"|".join([state, token, str(lease_ms).encode(), rest]), keepttl=True)


# -- the same answers as the database store -----------------------------------------------------


def test_a_first_request_runs_and_its_retry_is_replayed_from_redis_not_the_database(
    alice: User, post: Post
) -> None:
    first = post("/effect/", {"amount": 1})
    retry = post("/effect/", {"amount": 1})

    assert first.status_code == 201
    assert retry.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert retry["Location"] == first["Location"]
    assert effects() == 1
    assert IdempotencyRecord.objects.count() == 0
    keys = record_keys()
    assert len(keys) == 1
    assert 0 < redis_client().pttl(keys[0]) <= 24 * 3600 * 1000  # TTL_SECONDS, by Redis


def test_another_body_with_the_same_key_is_422(alice: User, post: Post) -> None:
    assert post("/effect/", {"amount": 1}).status_code == 201
    response = post("/effect/", {"amount": 2})

    assert response.status_code == 422
    assert response["Content-Type"] == "application/problem+json"
    assert effects() == 1


def test_a_5xx_releases_the_key_and_the_retry_runs(alice: User, post: Post) -> None:
    assert post("/effect/", {"status": 503}).status_code == 503
    assert record_keys() == []

    assert post("/effect/", {"status": 201}).status_code == 201
    assert effects() == 2


@pytest.mark.django_db(transaction=True)
def test_a_duplicate_in_flight_gets_409_with_retry_after(alice: User) -> None:
    answers: dict[str, Any] = {}

    def first() -> None:
        answers["first"] = send(Client(), {"amount": 1, "gate": True})

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert gate.entered.wait(10)
        duplicate = send(Client(), {"amount": 1, "gate": True})
    finally:
        gate.release.set()
        thread.join(10)

    assert duplicate.status_code == 409
    assert duplicate["Retry-After"] == "1"
    assert answers["first"].status_code == 201
    assert effects() == 1


def send(client: Client, body: Any, key: str = "k1", path: str = "/effect/") -> Any:
    return client.post(
        path,
        data=json.dumps(body),
        content_type="application/json",
        headers={"Idempotency-Key": key, "X-User": "alice"},
    )


@pytest.mark.django_db(transaction=True)
def test_the_wait_policy_replays_once_the_first_completes(alice: User) -> None:
    answers: dict[str, Any] = {}

    def first() -> None:
        answers["first"] = send(Client(), {"gate": True}, path="/waiting/")

    thread = threading.Thread(target=first)
    thread.start()
    assert gate.entered.wait(10)
    waiter = threading.Thread(
        target=lambda: answers.update(second=send(Client(), {"gate": True}, path="/waiting/"))
    )
    waiter.start()
    gate.release.set()
    thread.join(20)
    waiter.join(20)

    assert answers["first"].status_code == 201
    assert answers["second"].status_code == 201
    assert answers["second"]["Idempotent-Replayed"] == "true"
    assert effects("waiting") == 1


def test_signals_are_sent_as_with_the_database_store(alice: User, post: Post) -> None:
    seen: list[str] = []

    def receiver(signal: Any, **kwargs: Any) -> None:
        seen.append(signals.raw_key())

    signals.claimed.connect(receiver, weak=False)
    signals.replayed.connect(receiver, weak=False)
    try:
        post("/effect/", {})
        post("/effect/", {})
    finally:
        signals.claimed.disconnect(receiver)
        signals.replayed.disconnect(receiver)

    assert seen == ["k1", "k1"]


def test_encrypted_responses_are_sealed_in_redis(
    alice: User, post: Post, settings: SettingsWrapper
) -> None:
    from cryptography.fernet import Fernet

    use_redis(
        settings,
        RESPONSE_CODEC="idempotency_django.codecs.FernetCodec",
        ENCRYPTION_KEYS=[Fernet.generate_key().decode()],
    )
    first = post("/effect/", {"secret": "s3cr3t-body"})
    retry = post("/effect/", {"secret": "s3cr3t-body"})

    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    (key,) = record_keys()
    assert b"s3cr3t-body" not in redis_client().get(key)


# -- fencing, the lease on Redis's clock, renewal, the hash tag ----------------------------------


def test_completion_release_and_renewal_are_fenced_by_the_token() -> None:
    redis_store = store()
    assert redis_store.claim_or_read(claim_values("a" * 32)) == "claimed"

    assert not redis_store.complete(lookup(), "b" * 32, complete_values())
    assert redis_store.release(lookup(), "b" * 32) == 0
    assert redis_store.renew([(lookup(), "b" * 32)], 30, 1) == 0
    snapshot = redis_store.read(lookup(), "")
    assert snapshot is not None
    assert snapshot.state == "in_progress"

    assert redis_store.complete(lookup(), "a" * 32, complete_values())
    # Sent again (its first reply lost): answered as stored, and the first outcome is kept.
    assert redis_store.complete(lookup(), "a" * 32, complete_values(200, b"again"))
    completed = redis_store.read(lookup(), "2:" + "a" * 64)
    assert completed is not None
    assert completed.stored is not None
    assert (completed.stored.status, completed.stored.body) == (201, b"done")
    assert redis_store.renew([(lookup(), "a" * 32)], 30, 1) == 0  # completed
    assert redis_store.is_completed(lookup(), "a" * 32)
    # Fenced by the state too: a late release (its first reply lost) keeps the outcome.
    assert redis_store.release(lookup(), "a" * 32) == 0
    completed = redis_store.read(lookup(), "2:" + "a" * 64)
    assert completed is not None
    assert completed.state == "completed"
    assert completed.stored is not None
    assert completed.stored.body == b"done"


def test_the_redis_store_has_no_purge_lag_as_redis_deletes_expired_keys_itself() -> None:
    redis_store = store()
    assert redis_store.claim_or_read(claim_values("a" * 32)) == "claimed"
    assert redis_store.complete(lookup(), "a" * 32, complete_values())
    # The record carries a Redis TTL: Redis deletes it when that runs out, so no expired
    # record is ever left behind for a purge to lag on.
    (key,) = record_keys()
    assert redis_client().pttl(key) > 0
    assert redis_store.oldest_expired() is None


def test_a_completed_record_keeps_the_claims_fingerprint_and_its_response() -> None:
    redis_store = store()
    fingerprint = "custom:has|pipes\nand a newline"
    values = claim_values("a" * 32, fingerprint=fingerprint)
    assert redis_store.claim_or_read(values) == "claimed"
    assert redis_store.complete(lookup(), "a" * 32, complete_values(body=b"\n|x\n"))

    snapshot = redis_store.read(lookup(), fingerprint)

    assert snapshot is not None
    assert snapshot.fingerprint == fingerprint
    assert snapshot.stored is not None
    assert (snapshot.stored.status, snapshot.stored.body) == (201, b"\n|x\n")
    assert snapshot.stored.headers == [("Location", "/x/1")]


def test_take_over_compares_the_lease_with_redis_time_not_the_clients_clock(
    alice: User, post: Post, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client whose clock runs two minutes ahead reads a live lease as lapsed; the
    take-over script, on Redis's clock, refuses: the view never runs a second time."""
    redis_store = store()
    fingerprint = _fingerprint(post)
    values = claim_values("a" * 32, account=str(alice.pk), fingerprint=fingerprint)
    assert redis_store.claim_or_read(values) == "claimed"
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() + timedelta(minutes=2))

    response = post("/effect/", {"amount": 1})

    assert response.status_code == 409
    assert effects() == 0


def test_a_lease_renewed_between_the_read_and_the_take_over_is_not_taken_over() -> None:
    """The take-over script checks the lease itself, on Redis's clock: a record read as
    lapsed and renewed since (its heartbeat was late, not dead) is left to its owner."""
    redis_store = store()
    values = claim_values("a" * 32)
    assert redis_store.claim_or_read(values) == "claimed"
    key = redis_store.key(values.scope)
    set_lease(key, server_ms() - 1)
    lapsed = redis_store.read(lookup(), values.fingerprint)
    assert lapsed is not None
    set_lease(key, server_ms() + 30_000)  # renewed in between

    assert not redis_store.take_over(lapsed, claim_values("b" * 32))
    assert redis_client().get(key).split(b"|")[1] == b"a" * 32

    set_lease(key, server_ms() - 1)  # now lapsed for good
    assert redis_store.take_over(lapsed, claim_values("b" * 32))
    assert redis_client().get(key).split(b"|")[1] == b"b" * 32


def test_a_lapsed_lease_by_redis_time_is_taken_over_and_runs_once(alice: User, post: Post) -> None:
    redis_store = store()
    fingerprint = _fingerprint(post)
    values = claim_values("a" * 32, account=str(alice.pk), fingerprint=fingerprint)
    assert redis_store.claim_or_read(values) == "claimed"
    set_lease(redis_store.key(values.scope), server_ms() - 5_000)  # its worker died 5 s ago

    retry = post("/effect/", {"amount": 1})
    again = post("/effect/", {"amount": 1})

    assert retry.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert effects() == 1  # the dead worker's never wrote; the take-over ran once


def _fingerprint(post: Post) -> str:
    """The fingerprint ``post("/effect/", {"amount": 1})`` gets."""
    from django.test import RequestFactory

    from idempotency_django.keys import default_fingerprint

    request = RequestFactory().post(
        "/effect/", data=json.dumps({"amount": 1}), content_type="application/json"
    )
    return default_fingerprint(request, "POST /effect/")


@pytest.mark.skipif(
    "+cluster" in REDIS_URL,
    reason="one script a slot on a cluster, one round trip a master: "
    "test_store_redis_cluster.py::test_eval_per_node_is_one_round_trip_per_node",
)
def test_the_heartbeat_renews_every_claim_in_one_round_trip(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    redis_store = store()
    for index in range(3):
        values = claim_values(f"{index}" * 32, key=f"k{index}", lease=2)
        assert redis_store.claim_or_read(values) == "claimed"
    client = redis_client()
    before = {key: int(client.get(key).split(b"|")[2]) for key in client.keys(f"{PREFIX}:*")}
    # Loaded first: on a Redis that has not seen the script yet, its first EVALSHA is
    # answered NOSCRIPT and sent again, which is the script cache's round trip, not ours.
    client.script_load(redis_store._scripts["renew"].script)
    calls = _count_script_round_trips(monkeypatch)
    beat = Heartbeat()
    for index in range(3):
        beat.register(
            claims.Claim(
                claims.Scope("1", "POST /effect/", f"k{index}"),
                f"{index}" * 32,
                "default",
                3600,
                redis_store,
            ),
            lease=30,
            max_run=60,
        )
    try:
        assert beat.renew_once() == 3
    finally:
        beat.stop()

    assert len(calls) == 1
    for key, lease in before.items():
        renewed = int(client.get(key).split(b"|")[2])
        assert renewed >= lease + 25_000  # pushed to 30 s from now, on Redis's clock


def test_a_first_request_is_two_round_trips_and_a_replay_one(
    alice: User, post: Post, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The healthy path: the claim and the completion, nothing more (a completion is sent
    again only when the store failed it); a replay is the claim's one round trip."""
    assert post("/effect/", {}, key="warm-up").status_code == 201  # scripts cached (EVALSHA)
    calls = _count_script_round_trips(monkeypatch)
    first = post("/effect/", {"amount": 1})
    claimed_and_completed = len(calls)
    replay = post("/effect/", {"amount": 1})

    assert first.status_code == 201
    assert replay["Idempotent-Replayed"] == "true"
    assert claimed_and_completed == 2
    assert len(calls) == 3


def _count_script_round_trips(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The writes that carry a script (EVALSHA or EVAL, alone or in a pipeline) the calling
    thread sends from now on: one write is one round trip. Counted on this thread's
    connections, not the server's commandstats, which count every client of a shared Redis,
    nor a heartbeat thread's own beat, which may come at any time on a loaded machine."""
    from redis.connection import AbstractConnection

    sent: list[bytes] = []
    send = AbstractConnection.send_packed_command
    caller = threading.get_ident()

    def counting(self: Any, command: Any, check_health: bool = True) -> None:
        if threading.get_ident() != caller:
            return send(self, command, check_health)
        chunks = (
            [command] if isinstance(command, (bytes, bytearray, memoryview, str)) else list(command)
        )
        packed = b"".join(c.encode() if isinstance(c, str) else bytes(c) for c in chunks)
        if b"EVALSHA" in packed or b"\r\nEVAL\r\n" in packed:
            sent.append(packed)
        send(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)
    return sent


def test_every_key_of_a_record_is_in_one_slot_through_a_hash_tag() -> None:
    from redis.crc import key_slot

    key = record_key("idem", lookup("k{1}"))
    tag = key[key.index("{") + 1 : key.index("}")]

    assert key.startswith("idem:{")
    assert key.endswith("}")
    assert len(tag) == 64  # the scope's SHA-256: no brace of the key itself can split it
    assert key_slot(key.encode()) == key_slot(f"other:{{{tag}}}:wait".encode())
    assert record_key("idem", lookup("k1")) != record_key("idem", lookup("k1", account="2"))


def test_a_record_in_progress_outlives_a_ttl_shorter_than_its_leases() -> None:
    redis_store = store()
    values = claim_values("a" * 32, lease=30, ttl=1)
    redis_store.claim_or_read(values)

    assert redis_client().pttl(redis_store.key(values.scope)) > 60_000  # three leases


# -- failure: down, restarted, slow ------------------------------------------------------------


def test_redis_down_fails_closed_with_a_503(
    alice: User, post: Post, settings: SettingsWrapper
) -> None:
    use_redis(settings, f"redis://127.0.0.1:{_free_port()}/0")
    response = post("/effect/", {})

    assert response.status_code == 503
    assert response["Retry-After"] == "1"
    assert response["Content-Type"] == "application/problem+json"
    assert effects() == 0


def test_redis_down_fails_open_when_asked(
    alice: User, post: Post, settings: SettingsWrapper
) -> None:
    use_redis(settings, f"redis://127.0.0.1:{_free_port()}/0", ON_STORE_ERROR="open")

    assert post("/effect/", {}).status_code == 201
    assert effects() == 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def scratch_redis(tmp_path: Path) -> Iterator[Callable[[], None]]:
    """A throwaway redis-server on port 6390 (no persistence); the fixture's value restarts
    it (SIGKILL, then a new one on the same port)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    processes: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        process = subprocess.Popen(
            ["redis-server", "--port", str(SCRATCH_PORT), "--save", "", "--appendonly", "no"],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
        )
        processes.append(process)
        deadline = time.monotonic() + 10
        while not _redis_up(f"redis://127.0.0.1:{SCRATCH_PORT}/0"):
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)

    def restart() -> None:
        processes[-1].send_signal(signal.SIGKILL)
        processes[-1].wait(10)
        start()

    start()
    yield restart
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(10)


@pytest.mark.django_db(transaction=True)
def test_redis_restarted_mid_flight_reports_the_lost_outcome_and_serves_again(
    alice: User, settings: SettingsWrapper, scratch_redis: Callable[[], None]
) -> None:
    """The claim is lost with the server's memory: the work's answer is sent, the loss is
    signalled (``completion_lost``), and the next request is served by the new server."""
    use_redis(settings, f"redis://127.0.0.1:{SCRATCH_PORT}/0")
    lost: list[Any] = []

    def receiver(signal: Any, **kwargs: Any) -> None:
        lost.append({**kwargs, "key": signals.raw_key()})

    signals.outcome_not_stored.connect(receiver, weak=False)
    signals.completion_lost.connect(receiver, weak=False)
    answers: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: answers.update(first=send(Client(), {"amount": 1, "gate": True}))
    )
    try:
        thread.start()
        assert gate.entered.wait(10)
        scratch_redis()
        gate.release.set()
        thread.join(20)
        later = send(Client(), {"amount": 1}, key="k2")
    finally:
        gate.release.set()
        signals.outcome_not_stored.disconnect(receiver)
        signals.completion_lost.disconnect(receiver)

    assert answers["first"].status_code == 201
    assert [entry["key"] for entry in lost] == ["k1"]  # the lost outcome, told loudly
    assert later.status_code == 201
    assert effects() == 2


def test_a_paused_redis_is_an_unknown_outcome_never_a_fail_open(
    alice: User, post: Post, settings: SettingsWrapper, scratch_redis: Callable[[], None]
) -> None:
    """A claim that times out may have been written: a 503, even with ON_STORE_ERROR
    'open' (which only a refused or lost connection may take), and the view never runs."""
    url = f"redis://127.0.0.1:{SCRATCH_PORT}/0"
    use_redis(settings, url, ON_STORE_ERROR="open", STORE_OPTIONS={"SOCKET_TIMEOUT": 0.2})
    redis.Redis.from_url(url).execute_command("CLIENT", "PAUSE", "1500", "ALL")

    response = post("/effect/", {})

    assert response.status_code == 503
    assert effects() == 0


def test_a_timeout_is_other_and_a_refused_connection_unreachable() -> None:
    redis_store = store()

    assert redis_store.failure_kind(redis.TimeoutError("slow")) == "other"
    assert redis_store.failure_kind(redis.ConnectionError("refused")) == "unreachable"
    assert redis_store.failure_kind(StoreError("x", "unreachable")) == "unreachable"


# -- settings, checks, the purge, the example --------------------------------------------------


def test_atomic_mode_with_the_redis_store_is_refused_by_a_check(settings: SettingsWrapper) -> None:
    use_redis(settings, MODE="atomic")

    assert [m.id for m in check_settings()] == ["idempotency_django.E025"]


def test_an_unloadable_store_is_refused_by_a_check(settings: SettingsWrapper) -> None:
    settings.IDEMPOTENCY = {"STORE": "no.such.Store"}

    assert [m.id for m in check_settings()] == ["idempotency_django.E019"]


@pytest.mark.parametrize(
    "options",
    [
        {"URL": "http://x"},
        {"KEY_PREFIX": ""},
        {"KEY_PREFIX": "a{b}"},
        {"SOCKET_TIMEOUT": 0},
        {"CONNECT_TIMEOUT": "1"},
        {"PORT": 1},
    ],
)
def test_bad_store_options_are_refused_by_a_check(
    settings: SettingsWrapper, options: dict[str, Any]
) -> None:
    settings.IDEMPOTENCY = {"STORE": REDIS_STORE, "STORE_OPTIONS": options}

    assert [m.id for m in check_settings()] == ["idempotency_django.E026"]


def test_a_view_that_asks_for_atomic_mode_on_redis_is_refused_where_declared() -> None:
    from django.core.exceptions import ImproperlyConfigured

    from idempotency_django.decorators import idempotent

    with pytest.raises(ImproperlyConfigured, match="atomic"):
        idempotent(store=REDIS_STORE, mode="atomic")(lambda request: None)


def _declare_view() -> None:
    from idempotency_django.decorators import idempotent

    @idempotent(store=REDIS_STORE)
    def charge(request: Any) -> Any:
        return None


def _declare_drf_view() -> None:
    from rest_framework.views import APIView

    from idempotency_django.drf import IdempotentMixin

    class Charge(IdempotentMixin, APIView):
        idempotency_store = REDIS_STORE


def _declare_ninja_operation() -> None:
    from idempotency_django.ninja import idempotent as ninja_idempotent

    @ninja_idempotent(store=REDIS_STORE)
    def charge(request: Any) -> Any:
        return None


def _declare_task() -> None:
    from idempotency_django.tasks import idempotent_task

    idempotent_task(scope="s", key="message_id", name="receipt", store=REDIS_STORE)


DECLARATIONS = {
    "decorator": _declare_view,
    "drf": _declare_drf_view,
    "ninja": _declare_ninja_operation,
    "task": _declare_task,
}


@pytest.mark.parametrize("declare", DECLARATIONS.values(), ids=DECLARATIONS.keys())
def test_a_redis_store_of_its_own_under_a_project_wide_atomic_mode_is_refused_where_declared(
    settings: SettingsWrapper, declare: Callable[[], None]
) -> None:
    """The project's MODE is "atomic" (with the database store, as E025 wants): a view or
    task that names the Redis store and no mode of its own would answer every request with
    ``ImproperlyConfigured``, a 500. It is refused when it is declared, naming it."""
    from django.core.exceptions import ImproperlyConfigured

    settings.IDEMPOTENCY = {
        "MODE": "atomic",
        "STORE": "idempotency_django.store.database.DatabaseStore",
    }

    with pytest.raises(
        ImproperlyConfigured, match=r"store=.*RedisStore.* under IDEMPOTENCY MODE 'atomic'"
    ):
        declare()


@pytest.mark.parametrize("mode", [None, "commit"])
def test_a_redis_store_of_its_own_is_declared_where_the_mode_allows_it(
    settings: SettingsWrapper, alice: User, mode: str | None
) -> None:
    """Under MODE "commit", or with the view's own ``mode="commit"`` under MODE "atomic",
    the view is declared, and served on the Redis store."""
    from django.http import JsonResponse
    from django.test import RequestFactory

    from idempotency_django.decorators import idempotent

    database = "idempotency_django.store.database.DatabaseStore"
    use_redis(settings, MODE="atomic" if mode else "commit", STORE=database)
    own = {"mode": mode} if mode else {}

    @idempotent(store=REDIS_STORE, **own)
    def view(request: Any) -> Any:
        return JsonResponse({}, status=201)

    def send() -> Any:
        request = RequestFactory().post(
            "/own/", data="{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY="k8"
        )
        request.user = alice
        return view(request)

    assert send().status_code == 201
    assert send()["Idempotent-Replayed"] == "true"
    assert len(record_keys()) == 1
    assert not IdempotencyRecord.objects.exists()


def test_a_bad_mode_setting_is_left_to_the_checks_when_a_store_is_declared(
    settings: SettingsWrapper,
) -> None:
    settings.IDEMPOTENCY = {"MODE": "atomc"}
    _declare_view()  # E002 reports it; importing the URLconf must not fail first


def test_a_view_can_use_the_database_store_under_a_redis_default(alice: User, post: Post) -> None:
    from django.http import JsonResponse
    from django.test import RequestFactory

    from idempotency_django.decorators import idempotent

    @idempotent(store="idempotency_django.store.database.DatabaseStore")
    def view(request: Any) -> Any:
        return JsonResponse({}, status=201)

    request = RequestFactory().post(
        "/own/", data="{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY="k9"
    )
    request.user = alice

    assert view(request).status_code == 201
    assert IdempotencyRecord.objects.filter(key="k9").count() == 1
    assert record_keys() == []


def test_the_purge_says_the_redis_store_needs_none(capsys: pytest.CaptureFixture[str]) -> None:
    call_command("purge_idempotency_keys")

    assert "nothing to purge" in capsys.readouterr().out


def test_reseal_says_it_leaves_redis_records_as_they_are(
    alice: User, post: Post, settings: SettingsWrapper, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rotation must not read "Resealed 0" as "no record needs the old key": the Redis
    records sealed by it are still there, and the command says so."""
    from cryptography.fernet import Fernet

    old = Fernet.generate_key().decode()
    codec = "idempotency_django.codecs.FernetCodec"
    use_redis(settings, RESPONSE_CODEC=codec, ENCRYPTION_KEYS=[old])
    post("/effect/", {"n": 1})
    (key,) = record_keys()
    sealed = redis_client().get(key)
    use_redis(settings, RESPONSE_CODEC=codec, ENCRYPTION_KEYS=[Fernet.generate_key().decode(), old])

    call_command("reseal_idempotency_responses")

    out = capsys.readouterr().out
    assert "are not resealed" in out
    assert "Resealed" not in out
    assert redis_client().get(key) == sealed  # left as it is: the old key still opens it


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_the_test_kit_proves_single_flight_on_redis(alice: User) -> None:
    from idempotency_django.testing import assert_single_flight

    assert_single_flight(
        Client,
        "/effect/",
        {"amount": 1},
        side_effects=lambda: effects(),
        headers={"X-User": "alice"},
        requests=8,
    )
    assert IdempotencyRecord.objects.count() == 0


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_the_example_on_redis_writes_no_idempotency_rows(tmp_path: Path) -> None:
    from tools.server import example_env, run_python

    child = r"""
import base64, json, django
django.setup()
from django.core.management import call_command
from django.test import Client
from idempotency_django.models import IdempotencyRecord
call_command("migrate", verbosity=0)
auth = {"HTTP_AUTHORIZATION": "Basic " + base64.b64encode(b"alice:alice").decode()}
def charge():
    return Client().post("/charges/", {"amount": 1000, "currency": "eur", "card": "tok_visa"},
        content_type="application/json", HTTP_IDEMPOTENCY_KEY="order-1", **auth)
first, retry = charge(), charge()
print(json.dumps([first.status_code, retry.status_code, retry.get("Idempotent-Replayed"),
    IdempotencyRecord.objects.count()]))
"""
    env = example_env(
        f"sqlite:///{tmp_path / 'example.sqlite3'}",
        EXAMPLE_PROVIDER_DELAY_MS="0",
        EXAMPLE_REDIS_URL=REDIS_URL,
        EXAMPLE_REDIS_KEY_PREFIX=PREFIX,
    )
    result = run_python({**os.environ, **env}, "-c", child)

    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == [201, 201, "true", 0]
    assert len(record_keys()) == 1


# -- a worker killed mid-flight -----------------------------------------------------------------

KILLED_WORKER = r"""
import os, sys, time, django
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.project.settings")
from idempotency_django.conf import DEFAULTS
DEFAULTS["STORE"] = "idempotency_django.store.redis.RedisStore"
DEFAULTS["STORE_OPTIONS"] = {"URL": sys.argv[1], "KEY_PREFIX": sys.argv[2]}
django.setup()
from idempotency_django.tasks import claim_once
with claim_once("receipts", "m-1", lease_seconds=1) as run:
    print("claimed", flush=True)
    time.sleep(120)  # SIGKILLed here: the work never finishes, nothing is completed
"""


def test_a_worker_killed_mid_flight_is_taken_over_once_its_lease_lapses() -> None:
    """SIGKILL a process holding a claim: a duplicate is refused while the dead worker's
    lease runs (Redis's clock), then takes the key over and runs once."""
    from idempotency_django.tasks import TaskInFlight, claim_once

    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_WORKER, REDIS_URL, PREFIX],
        cwd=Path(__file__).resolve().parent.parent,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"claimed"
        child.send_signal(signal.SIGKILL)
        child.wait(10)

        with pytest.raises(TaskInFlight), claim_once("receipts", "m-1", lease_seconds=1):
            pytest.fail("ran while the dead worker's lease was live")
        ran = []
        with claim_once(
            "receipts", "m-1", lease_seconds=1, in_flight="wait", wait_seconds=10
        ) as run:
            assert not run.done
            ran.append(1)
            run.result = "sent"
        with claim_once("receipts", "m-1") as again:
            assert again.done
            assert again.result == "sent"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)

    assert ran == [1]


class Stall:
    """A request held in its view (``gate``) in a thread of its own, and the throwaway Redis
    its store uses: ``pause`` stops Redis taking writes (``CLIENT PAUSE WRITE``) once the view
    has run, and reads, while nothing can move it, the lease the claim was last renewed
    for (Redis ms)."""

    def __init__(self, url: str, body: dict[str, Any] | None = None) -> None:
        self.redis = redis.Redis.from_url(url)
        self.answers: dict[str, Any] = {}
        self.thread = threading.Thread(
            target=lambda: self.answers.update(first=send(Client(), {**(body or {}), "gate": True}))
        )
        self.thread.start()
        assert gate.entered.wait(10)

    def pause(self, milliseconds: int) -> int:
        self.redis.execute_command("CLIENT", "PAUSE", str(milliseconds), "WRITE")
        (key,) = self.redis.keys(f"{PREFIX}:*")  # reads are served during the pause
        return int(self.redis.get(key).split(b"|")[2])

    def finish(self) -> Any:
        gate.release.set()
        self.thread.join(30)
        return self.answers["first"]

    def server_ms(self) -> int:
        seconds, micros = self.redis.time()
        return int(seconds) * 1000 + int(micros) // 1000


@pytest.fixture
def not_stored() -> Iterator[list[str]]:
    """The keys ``outcome_not_stored`` is sent for."""
    keys: list[str] = []

    def receiver(signal: Any, **kwargs: Any) -> None:
        keys.append(signals.raw_key())

    signals.outcome_not_stored.connect(receiver, weak=False)
    yield keys
    signals.outcome_not_stored.disconnect(receiver)


@pytest.mark.django_db(transaction=True)
def test_a_stall_longer_than_the_socket_timeout_still_stores_the_outcome(
    alice: User,
    settings: SettingsWrapper,
    scratch_redis: Callable[[], None],
    not_stored: list[str],
) -> None:
    """Redis takes no write (``CLIENT PAUSE WRITE``) for four socket timeouts, just as the
    view has run: the completion times out, is sent again until Redis takes it, and the
    answer waits for it. A late duplicate, after the lease the claim held has lapsed,
    replays: the work ran once."""
    url = f"redis://127.0.0.1:{SCRATCH_PORT}/0"
    use_redis(settings, url, LEASE_SECONDS=3, STORE_OPTIONS={"SOCKET_TIMEOUT": 0.3})
    first = Stall(url, {"amount": 1})
    try:
        lease_ms = first.pause(1200)
        paused = time.monotonic()
        response = first.finish()
        waited = time.monotonic() - paused
        lapsed = wait_until(lambda: first.server_ms() > lease_ms, timeout=10)
        late = send(Client(), {"amount": 1, "gate": True})
    finally:
        gate.release.set()

    assert response.status_code == 201
    assert lapsed
    assert late.status_code == 201
    assert late.get("Idempotent-Replayed") == "true"
    assert late.content == response.content
    assert effects() == 1
    assert not_stored == []
    assert waited >= 1.0  # the answer waited for the completion, through the pause


@pytest.mark.django_db(transaction=True)
def test_a_view_past_max_run_still_stores_its_outcome_through_a_stall(
    alice: User,
    settings: SettingsWrapper,
    scratch_redis: Callable[[], None],
    not_stored: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A view that ran longer than its lease, and past MAX_RUN_SECONDS (its renewals have
    stopped), then meets a stall: its completion is still sent again until the lease it
    was last renewed for may lapse, which is later than its claim's, and the stall ends
    before. MAX_RUN_SECONDS ends renewals; it does not cut a completion short."""
    url = f"redis://127.0.0.1:{SCRATCH_PORT}/0"
    use_redis(
        settings,
        url,
        LEASE_SECONDS=3,
        MAX_RUN_SECONDS=3,
        STORE_OPTIONS={"SOCKET_TIMEOUT": 0.3},
    )
    with caplog.at_level(logging.WARNING, logger="idempotency_django"):
        first = Stall(url, {"amount": 1})
        try:
            # Renewed at least once, then past MAX_RUN_SECONDS: no longer renewed.
            assert wait_until(lambda: "ran past MAX_RUN_SECONDS" in caplog.text, timeout=20)
            lease_ms = first.pause(1000)
            response = first.finish()
            lapsed = wait_until(lambda: first.server_ms() > lease_ms, timeout=10)
            late = send(Client(), {"amount": 1, "gate": True})
        finally:
            gate.release.set()

    assert response.status_code == 201
    assert lapsed
    assert late.get("Idempotent-Replayed") == "true"
    assert effects() == 1
    assert not_stored == []


class PausedAfterTheClaim:
    """``CLIENT PAUSE <ms> WRITE`` on the store's Redis as soon as the next claim is made
    (``signals.claimed``): its work runs, and its completion meets the stall. ``lease_ms``:
    the claim's lease (Redis ms), read during the pause, when nothing can move it."""

    def __init__(self, url: str, milliseconds: int) -> None:
        self.redis = redis.Redis.from_url(url)
        self.milliseconds = milliseconds
        self.lease_ms: int | None = None

    def __enter__(self) -> PausedAfterTheClaim:
        signals.claimed.connect(self._pause, weak=False)
        return self

    def __exit__(self, *exc_info: object) -> None:
        signals.claimed.disconnect(self._pause)

    def _pause(self, signal: Any, **kwargs: Any) -> None:
        if self.lease_ms is None:
            self.redis.execute_command("CLIENT", "PAUSE", str(self.milliseconds), "WRITE")
            (key,) = self.redis.keys(f"{PREFIX}:*")
            self.lease_ms = int(self.redis.get(key).split(b"|")[2])

    def lapsed(self) -> bool:
        seconds, micros = self.redis.time()
        assert self.lease_ms is not None
        return int(seconds) * 1000 + int(micros) // 1000 > self.lease_ms


@pytest.mark.django_db(transaction=True)
def test_an_async_views_outcome_survives_a_stall(
    alice: User,
    settings: SettingsWrapper,
    scratch_redis: Callable[[], None],
    not_stored: list[str],
) -> None:
    """The same for an async view: its completion, in a thread off the event loop, is sent
    again through the stall, and a late duplicate replays."""
    url = f"redis://127.0.0.1:{SCRATCH_PORT}/0"
    use_redis(settings, url, LEASE_SECONDS=3, STORE_OPTIONS={"SOCKET_TIMEOUT": 0.3})
    with PausedAfterTheClaim(url, 1200) as stall:
        response = send(Client(), {"amount": 1}, path="/async/")
    lapsed = wait_until(stall.lapsed, timeout=10)
    late = send(Client(), {"amount": 1}, path="/async/")

    assert response.status_code == 201
    assert lapsed
    assert late.get("Idempotent-Replayed") == "true"
    assert late.content == response.content
    assert effects("async") == 1
    assert not_stored == []


@pytest.mark.django_db(transaction=True)
def test_a_tasks_result_survives_a_stall(
    settings: SettingsWrapper, scratch_redis: Callable[[], None], not_stored: list[str]
) -> None:
    """The same for a task: its result is stored through the stall, and a redelivery after
    the lease has lapsed gets it instead of running the work again."""
    from idempotency_django.tasks import claim_once

    url = f"redis://127.0.0.1:{SCRATCH_PORT}/0"
    use_redis(settings, url, LEASE_SECONDS=3, STORE_OPTIONS={"SOCKET_TIMEOUT": 0.3})
    ran: list[str] = []
    with PausedAfterTheClaim(url, 1200) as stall, claim_once("receipts", "m-1") as run:
        assert not run.done
        ran.append("sent")
        run.result = "sent"
    lapsed = wait_until(stall.lapsed, timeout=10)
    with claim_once("receipts", "m-1") as redelivered:
        if not redelivered.done:
            ran.append("sent again")

    assert lapsed
    assert redelivered.done
    assert redelivered.result == "sent"
    assert ran == ["sent"]
    assert not_stored == []


RACING_WORKER = r"""
import os, sys, time, django
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.project.settings")
from idempotency_django.conf import DEFAULTS
DEFAULTS["STORE"] = "idempotency_django.store.redis.RedisStore"
DEFAULTS["STORE_OPTIONS"] = {"URL": sys.argv[1], "KEY_PREFIX": sys.argv[2]}
django.setup()
from idempotency_django.tasks import TaskInFlight, claim_once
from tools import redis_cluster
# No socket timeout: redis-py's default (5 s) is shorter than the BLPOPs below.
client = redis_cluster.connect(sys.argv[1], socket_timeout=None)  # redis+cluster://: the cluster
client.rpush(sys.argv[2] + ":ready", 1)
client.blpop(sys.argv[2] + ":go", timeout=30)  # all start together
try:
    with claim_once("race", "k-1") as run:
        if not run.done:
            client.incr(sys.argv[2] + ":ran")
            client.blpop(sys.argv[2] + ":finish", timeout=30)  # held until all have tried
            run.result = "ran"
    print("ran" if run.result == "ran" else "replayed", flush=True)
except TaskInFlight:
    print("in flight", flush=True)
"""


def test_processes_racing_one_key_run_it_once() -> None:
    """Six processes released together claim one key: one runs, the others are refused."""
    # No socket timeout: redis-py's default (5 s) is shorter than the BLPOP for six children
    # starting Django on a loaded machine.
    client = redis_cluster.connect(REDIS_URL, socket_timeout=None)
    root = Path(__file__).resolve().parent.parent
    children = [
        subprocess.Popen(
            [sys.executable, "-c", RACING_WORKER, REDIS_URL, PREFIX],
            cwd=root,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(root)},
        )
        for _ in range(6)
    ]
    try:
        for _ in children:
            assert client.blpop(f"{PREFIX}:ready", timeout=60) is not None
        client.rpush(f"{PREFIX}:go", *([1] * len(children)))
        deadline = time.monotonic() + 60
        # The losers are answered while the winner is held: wait for them to exit.
        while sum(child.poll() is not None for child in children) < len(children) - 1:
            assert time.monotonic() < deadline, "the losers were not answered"
            time.sleep(0.02)
        held = [child for child in children if child.poll() is None]
        client.rpush(f"{PREFIX}:finish", 1)
        answers = [child.communicate(timeout=30)[0].strip() for child in children]
    finally:
        client.rpush(f"{PREFIX}:finish", 1)
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(10)

    assert [child.returncode for child in children] == [0] * len(children)
    assert len(held) == 1
    assert sorted(answers) == [b"in flight"] * (len(children) - 1) + [b"ran"]
    assert int(client.get(f"{PREFIX}:ran")) == 1
