"""What the Redis store decides around its client, in the main suite: no six-node cluster.

The URLs and options that name a cluster (``rediss+cluster://`` too) and E026; the
server's clock a read turns a record's lease into (one Redis, db 3 of the local one or
``IDEMPOTENCY_TEST_REDIS_URL``); and ``write_and_wait`` following a ``MOVED`` itself, on a
real two-master cluster started here: the write and its ``WAIT`` go to a node's own
connection, which redis-py's cluster client never sees, so the redirection is this
package's logic, and only a cluster node that gave a slot away answers ``MOVED``.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
from django.utils import timezone

from tests import writes
from tests.conftest import REDIS_URL
from tools import redis_cluster

if TYPE_CHECKING:
    from pytest_django import Settings as SettingsWrapper

redis = pytest.importorskip("redis")

from idempotency_django.store import redis_cluster as store_cluster  # noqa: E402
from idempotency_django.store.base import get_store  # noqa: E402
from idempotency_django.store.redis import RedisStore  # noqa: E402

RedisCluster = redis.cluster.RedisCluster


# -- URLs and options ----------------------------------------------------------------------------


def test_connect_builds_a_plain_client_unless_told_cluster() -> None:
    client = store_cluster.connect("redis://127.0.0.1:6379/4", cluster=False)
    assert type(client) is redis.Redis
    client.close()


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis+cluster://127.0.0.1:7100/0", ("redis://127.0.0.1:7100/0", True)),
        ("rediss+cluster://h:1/0", ("rediss://h:1/0", True)),
        ("redis://127.0.0.1:6379/4", ("redis://127.0.0.1:6379/4", False)),
        ("unix:///run/redis.sock", ("unix:///run/redis.sock", False)),
    ],
)
def test_a_cluster_is_named_by_the_option_or_the_urls_scheme(
    url: str, expected: tuple[str, bool]
) -> None:
    assert store_cluster.cluster_url(url) == expected
    assert store_cluster.cluster_url(url, True) == (expected[0], True)


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"CLUSTER": "yes"}, "CLUSTER 'yes' is not True or False"),
        ({"WAIT_REPLICAS": -1}, "WAIT_REPLICAS -1 is not a whole number >= 0"),
        ({"WAIT_REPLICAS": True}, "WAIT_REPLICAS True is not a whole number >= 0"),
        ({"WAIT_TIMEOUT_MS": 0}, "WAIT_TIMEOUT_MS 0 is not a whole number >= 1"),
        ({"URL": "http://127.0.0.1:7100/0"}, "URL 'http://127.0.0.1:7100/0' is not a redis://"),
    ],
)
def test_e026_names_a_bad_cluster_or_wait_option(options: dict[str, object], problem: str) -> None:
    (error,) = RedisStore.check_options(options)
    assert error.id == "idempotency_django.E026"
    assert problem in error.msg


@pytest.mark.parametrize("scheme", ["redis+cluster", "rediss+cluster"])
def test_e026_accepts_a_cluster_url_and_the_wait_options(scheme: str) -> None:
    options = {"URL": f"{scheme}://127.0.0.1:7100/0", "WAIT_REPLICAS": 1}
    assert RedisStore.check_options({**options, "CLUSTER": True, "WAIT_TIMEOUT_MS": 50}) == []
    assert RedisStore.check_options(options) == []


# -- a read's clock: the server's, in milliseconds ------------------------------------------------


def _redis_up() -> bool:
    try:
        return bool(redis_cluster.connect(REDIS_URL).ping())
    except (redis.RedisError, redis.exceptions.RedisClusterException):
        return False


@pytest.mark.redis
@pytest.mark.skipif(not _redis_up(), reason=f"no Redis at {REDIS_URL}")
def test_a_read_gives_what_is_left_of_the_lease_by_the_servers_clock(
    settings: SettingsWrapper,
) -> None:
    """A claim with a 30 s lease and a 1 h TTL, then a read: what is left of them by the
    server's clock (``TIME`` in the same round trip, seconds and microseconds turned into
    the milliseconds the record holds), from this process's now. Both differences are of
    server times, so the bounds hold whatever this clock says: from the claim's send to
    the read's answer, give or take the millisecond they are rounded to."""
    settings.IDEMPOTENCY = {
        "STORE": "idempotency_django.store.redis.RedisStore",
        "STORE_OPTIONS": {"URL": REDIS_URL, "KEY_PREFIX": "idemlogic"},
    }
    store = get_store("idempotency_django.store.redis.RedisStore")
    now = timezone.now()
    values = writes.write("a" * 32, key=f"clock-{now.timestamp()}", now=now)
    lookup = values.scope
    store.client()  # connected first: the bounds are about the two round trips
    try:
        sent = timezone.now()
        assert store.claim_or_read(values) == "claimed"
        record = store.read(lookup, values.fingerprint)
        answered = timezone.now()
    finally:
        store.release(lookup, "a" * 32)

    assert record is not None
    assert record.lease_expires_at is not None
    rounding = timedelta(milliseconds=2)
    for left, when in (
        (timedelta(seconds=30), record.lease_expires_at),
        (timedelta(hours=1), record.expires_at),
    ):
        assert sent + left - rounding <= when <= answered + left + rounding


# -- MOVED, on a real cluster of two masters -------------------------------------------------------


@pytest.fixture(scope="module")
def two_masters() -> Iterator[redis_cluster.SmallCluster]:
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server")
    cluster = redis_cluster.SmallCluster(
        (redis_cluster.free_port(cluster=True), redis_cluster.free_port(cluster=True))
    )
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def asking(port: int) -> int:
    with redis.Redis(port=port) as connection:
        stats = connection.info("commandstats").get("cmdstat_asking", {})
    return int(stats.get("calls", 0))


def test_write_and_wait_follows_a_moved_and_learns_the_new_owner(
    two_masters: redis_cluster.SmallCluster,
) -> None:
    """The client's map is older than the slot's move: the old owner answers ``MOVED``.
    The write is sent again to the new owner (no ``ASKING``: not a migration), lands
    there, and the map names the new owner, so the next write goes there first."""
    client = RedisCluster.from_url(two_masters.url.replace("+cluster", ""))
    key = "{moved}:claim"
    old = two_masters.owner(key)
    new = next(port for port in two_masters.ports if port != old.port)
    assert client.get_node_from_key(key).port == old.port
    two_masters.move_slot(redis_cluster.keyslot_of(old.port, key), new)
    asked = asking(new)
    try:
        reply = store_cluster.write_and_wait(
            client, key, ["SET", key, "token", "NX", "PX", 60_000], 0, 100
        )
        owner_now = client.get_node_from_key(key).port
        with redis.Redis(port=new) as connection:
            stored = connection.get(key)
    finally:
        client.close()

    assert reply == (True, 0)
    assert stored == b"token"
    assert owner_now == new
    assert asking(new) == asked


# -- the command on the wire ----------------------------------------------------------------------


@pytest.mark.parametrize("hiredis", [True, False], ids=["hiredis", "pure-python"])
@pytest.mark.parametrize(
    "parts",
    [
        ("EVALSHA", "0" * 40, 1, "idem:{k}", "token", "10000", "", '{"f": "é"}\n'),
        ("EVALSHA", "0" * 40, 1, "idem:{k}", "token", "", "\n", b"\x00body" * 3000),
        ("EVAL", "return 1", 0),
    ],
    ids=["claim", "large-body", "eval"],
)
def test_a_script_is_sent_as_redis_py_would_send_it(
    parts: tuple[object, ...], hiredis: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store packs its script calls itself (one pass, hiredis's packer when installed):
    byte for byte what redis-py's own packer sends, with or without hiredis."""
    from redis._parsers.encoders import Encoder
    from redis.connection import PythonRespSerializer

    from idempotency_django.store import redis as redis_store

    if hiredis:
        pack = pytest.importorskip("hiredis").pack_command
        monkeypatch.setattr(redis_store, "_pack_command", pack)
    else:
        monkeypatch.setattr(redis_store, "_pack_command", None)
    encoder: Any = Encoder("utf-8", "strict", False)  # type: ignore[no-untyped-call]
    packer: Any = PythonRespSerializer(6000, encoder.encode)
    expected = b"".join(packer.pack(*parts))
    assert b"".join(redis_store._packed(encoder, parts)) == expected
