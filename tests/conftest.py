from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection, connections
from django.test import Client
from django.utils import timezone
from django.utils.crypto import salted_hmac

from idempotency_django import signals
from idempotency_django.conf import DEFAULTS
from idempotency_django.core import fingerprint, keys, transactions
from idempotency_django.core.heartbeat import heartbeat
from tests.models import SideEffect
from tests.project.factories import UserFactory
from tests.project.views import gate

# IDEMPOTENCY_TEST_STORE=redis runs the suite on the Redis store (IDEMPOTENCY_TEST_REDIS_URL,
# default db 3 of the local Redis, which the tests flush): it becomes the default STORE, so
# tests that replace the whole IDEMPOTENCY setting keep it. Tests of what only the database
# store has (atomic mode, SQL, admin rows, the purge) are marked ``database_store`` and
# skipped there, each with its reason.
ON_REDIS = os.environ.get("IDEMPOTENCY_TEST_STORE") == "redis"
REDIS_URL = os.environ.get("IDEMPOTENCY_TEST_REDIS_URL", "redis://127.0.0.1:6379/3")
PACKAGE_DEFAULTS = dict(DEFAULTS)  # as shipped, before the Redis run changes the store's
if ON_REDIS:
    DEFAULTS["STORE"] = "idempotency_django.store.redis.RedisStore"
    DEFAULTS["STORE_OPTIONS"] = {"URL": REDIS_URL, "KEY_PREFIX": "idemtest"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Concurrency and end-to-end tests need a real database; SQLite runs the rest. On the
    Redis store, the database store's own tests are skipped (``database_store``)."""
    if ON_REDIS:
        for item in items:
            marker = item.get_closest_marker("database_store")
            if marker is not None:
                reason = marker.args[0] if marker.args else "the database store's own behaviour"
                item.add_marker(pytest.mark.skip(reason=f"database store only: {reason}"))
    if connection.vendor in ("postgresql", "mysql"):
        return
    skip = pytest.mark.skip(reason="needs PostgreSQL or MariaDB (set DATABASE_URL)")
    for item in items:
        if "concurrency" in item.keywords or "e2e" in item.keywords:
            item.add_marker(skip)


# How to run what a run skipped, by the start of its reason (the reasons above and the
# fixtures' ``pytest.skip`` calls say what is missing; this says what to set).
HOW_TO_RUN = {
    "needs PostgreSQL or MariaDB": "DATABASE_URL=postgres://…/test or mysql://…/test",
    "e2e tests run on PostgreSQL": "DATABASE_URL=postgres://…/test or mysql://…/test",
    "the Celery worker tests run on PostgreSQL": "DATABASE_URL=postgres://…/test and a Redis",
    "prepared statements: PostgreSQL": "DATABASE_URL=postgres://…/test",
    "database store only": "unset IDEMPOTENCY_TEST_STORE (they run on the database store)",
    "needs a Redis": "a Redis at IDEMPOTENCY_TEST_REDIS_URL (default redis://127.0.0.1:6379/3)",
}


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Say which tests were skipped and why, grouped by reason, and how to run them: a bare
    ``N skipped`` leaves a newcomer guessing whether something is broken. ``-rs`` lists each
    skipped test instead."""
    reports = terminalreporter.stats.get("skipped", [])
    reasons: dict[str, int] = {}
    for report in reports:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if not reasons:
        return
    database = connection.vendor
    store = "the Redis store" if ON_REDIS else "the database store"
    terminalreporter.section(f"{len(reports)} skipped on {database}, {store}: why")
    for reason, count in sorted(reasons.items(), key=lambda item: (-item[1], item[0])):
        terminalreporter.write_line(f"{count:5d}  {reason}")
        for start, how in HOW_TO_RUN.items():
            if reason.startswith(start):
                terminalreporter.write_line(f"       to run them: {how}")
    terminalreporter.write_line(
        "Nothing is broken: each is for a database, store or service this run does not use. "
        "README.md ('Install and run the tests') runs them all; -rs lists each test."
    )


@pytest.fixture(scope="session", autouse=True)
def _stop_heartbeat() -> Iterator[None]:
    """Close the heartbeat thread's connection before the test databases are dropped."""
    yield
    heartbeat.stop()


@pytest.fixture(autouse=True)
def _empty_redis_store() -> None:
    """On the Redis store, each test starts with no records, as the database rolls back
    its rows: the test Redis database is flushed (it holds nothing else)."""
    if ON_REDIS:
        from tools import redis_cluster  # redis+cluster:// flushes every master

        redis_cluster.flush(REDIS_URL)


@pytest.fixture(autouse=True)
def _forget_warnings() -> None:
    """Warnings logged once per view, task, principal class or unknown key: each test sees
    its own."""
    transactions._warned.clear()
    keys._warned_principals.clear()
    fingerprint._unknown_keys.clear()


@pytest.fixture
def alice(db: None) -> User:
    return UserFactory(username="alice")


@pytest.fixture
def bob(db: None) -> User:
    return UserFactory(username="bob")


@pytest.fixture
def new_key() -> Callable[[], str]:
    return lambda: f"key-{uuid.uuid4()}"


@pytest.fixture(autouse=True)
def _open_gate() -> Iterator[None]:
    gate.reset()
    yield
    gate.release.set()


Post = Callable[..., Any]


@pytest.fixture
def post(client: Client) -> Post:
    """POST JSON as a user with an Idempotency-Key; ``key=None`` sends no key."""

    def send(
        path: str,
        body: Any = None,
        *,
        key: str | None = "k1",
        user: str | None = "alice",
        method: str = "post",
        content_type: str = "application/json",
        **headers: str,
    ) -> Any:
        if key is not None:
            headers["Idempotency-Key"] = key
        if user is not None:
            headers["X-User"] = user
        data = body if isinstance(body, bytes) else json.dumps(body if body is not None else {})
        return getattr(client, method)(path, data=data, content_type=content_type, headers=headers)

    return send


def effects(label: str | None = None) -> int:
    records = SideEffect.objects.all()
    return records.filter(label=label).count() if label else records.count()


def post_from_thread(path: str, body: Any, headers: dict[str, str]) -> Any:
    """POST ``body`` as JSON with ``headers`` from a thread of a concurrency test, whose
    database connections are closed after (a thread's own are never reused)."""
    try:
        return Client().post(
            path, data=json.dumps(body), content_type="application/json", headers=headers
        )
    finally:
        connections.close_all()


def wait_until(condition: Callable[[], bool], timeout: float = 20) -> bool:
    """Whether ``condition()`` came true within ``timeout`` seconds, polled every 50 ms."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def keyed(material: bytes, secret: str = "tests-only-not-secret") -> str:
    """Version 3 as docs/security.md states it: "3:", the key's id (8 hex digits of an HMAC
    of nothing) and 56 hex digits of an HMAC-SHA256 of the SHA-256 of the parts, both keyed
    by Django's ``salted_hmac`` with the secret."""
    key_id = salted_hmac(
        "idempotency_django.fingerprint.key-id", b"", secret=secret, algorithm="sha256"
    ).hexdigest()[:8]
    mac = salted_hmac(
        "idempotency_django.fingerprint", material, secret=secret, algorithm="sha256"
    ).hexdigest()
    return f"3:{key_id}{mac[:56]}"


def another_waits_for_a_row_lock() -> bool:
    """Whether another connection to this test database waits for a row lock now (other
    databases on the server, other suites', do not count). PostgreSQL says so; MariaDB's
    ``innodb_trx`` still said RUNNING for a waiting read in tests, so there it is a locking
    statement (``… FOR UPDATE``, or a ``SET STATEMENT … FOR UPDATE``) still running, which
    in these tests only a lock wait makes last."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database() AND pid <> pg_backend_pid()"
            )
        else:
            cursor.execute(
                "SELECT count(*) FROM information_schema.processlist WHERE db = DATABASE() "
                "AND id <> CONNECTION_ID() AND info LIKE %s",
                ["%FOR UPDATE%"],
            )
        return int(cursor.fetchone()[0]) > 0


class Skew:
    """This process's clock (``django.utils.timezone.now``, which the engine reads) moved
    ``seconds`` away from the real one, in every thread: an app server whose clock runs
    ahead of (or behind) the store's."""

    def __init__(self, real: Callable[[], datetime]) -> None:
        self.seconds = 0.0
        self._real = real

    def now(self) -> datetime:
        return self._real() + timedelta(seconds=self.seconds)


@pytest.fixture
def skew(monkeypatch: pytest.MonkeyPatch) -> Skew:
    """This process's clock, 0 s away from the real one until the test sets ``seconds``."""
    clock = Skew(timezone.now)
    monkeypatch.setattr(timezone, "now", clock.now)
    return clock


@contextlib.contextmanager
def store_unavailable() -> Iterator[list[tuple[str, str]]]:
    """The ``(policy, kind)`` of each ``store_unavailable`` signal sent in the block."""
    sent: list[tuple[str, str]] = []

    def receiver(signal: Any, **kwargs: Any) -> None:
        sent.append((kwargs["policy"], kwargs["kind"]))

    signals.store_unavailable.connect(receiver, weak=False)
    try:
        yield sent
    finally:
        signals.store_unavailable.disconnect(receiver)
