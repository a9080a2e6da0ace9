"""The health check: ``idempotency_health_view`` and ``manage.py idempotency_health``.

Against the real store: a database that refuses connections, one whose records table is
locked by another connection (the round trip must give up within its bound), expired
records the purge left, a heartbeat whose thread is gone or whose renewals fail; and the
Redis store, up and unreachable.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from django.db import connection, connections, transaction
from django.test import Client
from django.utils import timezone

from idempotency_django.core import claims
from idempotency_django.core import heartbeat as heartbeat_module
from idempotency_django.core.heartbeat import Heartbeat
from idempotency_django.operations import health
from idempotency_django.purge import Pacing, purge_records
from tests.conftest import ON_REDIS, REDIS_URL
from tests.project.factories import IdempotencyRecordFactory
from tools.server import REPO_ROOT, example_env, run_python

if TYPE_CHECKING:
    from pytest_django import Settings as SettingsWrapper

pytestmark = pytest.mark.django_db

URL = "/health/idempotency/"
NAMES = ["store", "heartbeat", "purge_lag"]


def probe(client: Client) -> tuple[int, dict[str, Any]]:
    response = client.get(URL)
    assert response["Content-Type"] == "application/json"
    body = json.loads(response.content)
    assert [check["name"] for check in body["checks"]] == NAMES
    assert set(body) == {"status", "store", "checks"}
    for check in body["checks"]:
        assert set(check) == {"name", "ok", "message", "duration", "value"}
    return response.status_code, body


def check(body: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in body["checks"] if c["name"] == name]
    return found


@pytest.fixture
def beat(monkeypatch: pytest.MonkeyPatch) -> Iterator[Heartbeat]:
    """The heartbeat the health check reads, this test's own."""
    own = Heartbeat()
    monkeypatch.setattr(health, "process_heartbeat", own)
    yield own
    own.stop()


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def store_unreachable() -> Iterator[None]:
    """The store's database connection points where nothing answers, until the block ends:
    a port nothing listens on (PostgreSQL, MariaDB)."""
    wrapper = connections["default"]
    saved = dict(wrapper.settings_dict)
    wrapper.close()
    wrapper.settings_dict.update(HOST="127.0.0.1", PORT=str(closed_port()))
    try:
        yield
    finally:
        wrapper.close()
        wrapper.settings_dict.clear()
        wrapper.settings_dict.update(saved)


database_store = pytest.mark.database_store("the database store's own round trip and purge lag")


@database_store
@pytest.mark.django_db
def test_a_healthy_store_answers_200_and_every_check_passes(
    client: Client, beat: Heartbeat
) -> None:
    status, body = probe(client)

    assert status == 200
    assert body["status"] == "ok"
    assert body["store"] == "DatabaseStore"
    assert all(c["ok"] for c in body["checks"])
    assert check(body, "purge_lag")["message"] == "no expired record is left to purge"
    assert "no claim of this process to renew" in check(body, "heartbeat")["message"]


@database_store
@pytest.mark.django_db(transaction=True)
def test_a_store_that_refuses_connections_answers_503_without_its_error_text(
    client: Client, beat: Heartbeat
) -> None:
    if connection.vendor == "sqlite":
        pytest.skip("SQLite's in-memory test database cannot be made unreachable")
    with store_unreachable():
        status, body = probe(client)

    assert status == 503
    assert body["status"] == "fail"
    store = check(body, "store")
    assert not store["ok"]
    assert store["message"].startswith("the store failed (")
    assert store["message"].endswith("the error is logged")
    assert "127.0.0.1" not in json.dumps(body)  # no host or port for whoever probes
    assert check(body, "purge_lag") == {
        "name": "purge_lag",
        "ok": False,
        "message": "not checked: the store did not answer",
        "duration": 0.0,
        "value": None,
    }
    # Back up: the next probe connects afresh.
    assert probe(client)[0] == 200


@database_store
@pytest.mark.django_db(transaction=True)
def test_a_store_that_stalls_fails_within_the_timeout(
    client: Client, beat: Heartbeat, settings: SettingsWrapper
) -> None:
    """Another connection holds the records table locked: the round trip gives up at
    ``HEALTH_TIMEOUT_SECONDS`` (the statement timeout) and says so."""
    if connection.vendor != "postgresql":
        pytest.skip("LOCK TABLE … ACCESS EXCLUSIVE blocks reads on PostgreSQL")
    settings.IDEMPOTENCY = {"HEALTH_TIMEOUT_SECONDS": 0.2}
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic(using="default"), connection.cursor() as cursor:
                cursor.execute("LOCK TABLE idempotency_django_idempotencyrecord")
                locked.set()
                release.wait(10)  # the probe gives up long before; a hung one waits this
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(30)
        status, body = probe(client)
    finally:
        release.set()
        holder.join()

    assert status == 503
    store = check(body, "store")
    assert store["message"].startswith(
        "the store did not answer within 0.2 s (HEALTH_TIMEOUT_SECONDS)"
    )
    assert store["duration"] < 10  # gave up, and did not wait for the lock to be released


@database_store
@pytest.mark.django_db
def test_a_purge_lag_over_the_threshold_answers_503_until_the_purge_runs(
    client: Client, beat: Heartbeat, settings: SettingsWrapper
) -> None:
    settings.IDEMPOTENCY = {"HEALTH_MAX_PURGE_LAG_SECONDS": 86400}
    now = timezone.now()
    IdempotencyRecordFactory.completed(
        key="recent", created_at=now - timedelta(days=1), expires_at=now - timedelta(hours=1)
    )
    status, body = probe(client)
    assert status == 200
    lag = check(body, "purge_lag")
    assert lag["ok"]
    assert 3500 < lag["value"] < 3700

    IdempotencyRecordFactory.completed(
        key="old", created_at=now - timedelta(days=3), expires_at=now - timedelta(days=2)
    )
    status, body = probe(client)
    assert status == 503
    lag = check(body, "purge_lag")
    assert not lag["ok"]
    assert 2 * 86400 - 100 < lag["value"] < 2 * 86400 + 100
    assert "more than HEALTH_MAX_PURGE_LAG_SECONDS (86400 s)" in lag["message"]
    assert "the purge is not running or cannot keep up" in lag["message"]

    purge_records(pacing=Pacing.flat_out())
    assert probe(client)[0] == 200


def test_a_heartbeat_whose_thread_is_gone_fails(client: Client, beat: Heartbeat) -> None:
    """Claims of this process that nothing renews: their leases lapse under running views."""
    scope = claims.Scope("1", "POST /x/", "k")
    claim = claims.Claim(scope, "t" * 32, "default")
    # Registered without a thread: as if the heartbeat thread had died.
    beat._entries[claim.token] = heartbeat_module._Entry(
        claim, 30, time.monotonic() + 60, time.monotonic()
    )

    body = json.loads(client.get(URL).content)

    heart = check(body, "heartbeat")
    assert not heart["ok"]
    assert heart["message"].startswith("the heartbeat thread is not running: 1 claim(s)")
    assert body["status"] == "fail"


def test_a_heartbeat_whose_renewals_fail_is_late_and_fails(client: Client, beat: Heartbeat) -> None:
    scope = claims.Scope("1", "POST /x/", "k")
    claim = claims.Claim(scope, "t" * 32, "default")
    beat.register(claim, lease=30, max_run=60)  # its thread runs, first beat in 10 s
    assert claim.token in beat._entries
    # Its last renewal that succeeded was 21 s ago: two beats of a 30 s lease missed.
    entry = beat._entries[claim.token]
    beat._entries[claim.token] = heartbeat_module._Entry(
        claim, 30, entry.stop_renewing_at, time.monotonic() - 21
    )

    heart = check(json.loads(client.get(URL).content), "heartbeat")

    assert not heart["ok"]
    assert heart["message"].startswith("1 of 1 claim(s) of this process missed two renewals")
    assert heart["value"] > 20


def test_a_heartbeat_that_keeps_up_passes(client: Client, beat: Heartbeat) -> None:
    claim = claims.Claim(claims.Scope("1", "POST /x/", "k"), "t" * 32, "default")
    beat.register(claim, lease=30, max_run=60)

    heart = check(json.loads(client.get(URL).content), "heartbeat")

    assert heart["ok"]
    assert heart["message"].startswith("renewing 1 claim(s); the oldest renewal is")


def command_env(database_url: str) -> dict[str, str]:
    env = example_env(database_url)
    env["PYTHONPATH"] = str(REPO_ROOT)
    return env


def test_the_command_prints_the_json_and_exits_0(tmp_path: Path) -> None:
    """A real project runs it: exit 0 and the JSON when the store answers (and below: exit
    1, the same JSON with the store's error text, and the failed checks on stderr when it
    does not)."""
    env = command_env(f"sqlite:///{tmp_path / 'example.sqlite3'}")
    assert run_python(env, "manage.py", "migrate", "-v", "0").returncode == 0
    ok = run_python(env, "manage.py", "idempotency_health")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["status"] == "ok"


def test_the_command_exits_1_with_the_json_when_the_store_is_down() -> None:
    pytest.importorskip("psycopg", reason="PostgreSQL's driver (the postgres extra)")
    port = closed_port()
    down = run_python(
        command_env(f"postgres://root@127.0.0.1:{port}/nothing"), "manage.py", "idempotency_health"
    )
    assert down.returncode == 1, down.stderr
    body = json.loads(down.stdout)
    assert body["status"] == "fail"
    store = check(body, "store")
    assert store["message"].startswith("the store failed (unreachable: OperationalError): ")
    assert f"port {port} failed" in store["message"]  # the operator sees the driver's text
    assert "CommandError: Idempotency health check failed: store, purge_lag." in down.stderr


# -- the Redis store ----------------------------------------------------------------------------

redis_only = pytest.mark.skipif(
    not (ON_REDIS or os.environ.get("IDEMPOTENCY_TEST_REDIS_URL")),
    reason="no Redis given (IDEMPOTENCY_TEST_REDIS_URL)",
)
REDIS_STORE = "idempotency_django.store.redis.RedisStore"


@redis_only
@pytest.mark.redis
def test_the_redis_store_is_pinged_and_has_no_purge_lag(
    client: Client, beat: Heartbeat, settings: SettingsWrapper
) -> None:
    pytest.importorskip("redis")
    settings.IDEMPOTENCY = {"STORE": REDIS_STORE, "STORE_OPTIONS": {"URL": REDIS_URL}}
    status, body = probe(client)
    assert status == 200, body
    assert body["store"] == "RedisStore"
    assert check(body, "purge_lag")["message"] == (
        "RedisStore expires its records itself: no purge lag"
    )

    settings.IDEMPOTENCY = {
        "STORE": REDIS_STORE,
        "STORE_OPTIONS": {"URL": f"redis://127.0.0.1:{closed_port()}/0"},
    }
    status, body = probe(client)
    assert status == 503
    assert check(body, "store")["message"].startswith("the store failed (unreachable: StoreError)")
