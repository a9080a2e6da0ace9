"""A Redis that may evict records: the system check W040 and ``RedisStore.eviction_policy``,
against a redis-server of the test's own (``REDIS_EVICTION_PORT``, default 6403)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from idempotency_django import checks
from idempotency_django.store.base import get_store
from tests.conftest import ON_REDIS, wait_until

redis = pytest.importorskip("redis")


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Start a redis-server of this test's own with the given arguments; its URL."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port = int(os.environ.get("REDIS_EVICTION_PORT", "6403"))
    processes: list[subprocess.Popen[bytes]] = []

    def start(*arguments: str) -> str:
        for process in processes:
            process.kill()
            process.wait(10)
        processes.append(
            subprocess.Popen(
                [
                    "redis-server",
                    "--port",
                    str(port),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    *arguments,
                ],
                cwd=tmp_path,
                stdout=subprocess.DEVNULL,
            )
        )
        url = f"redis://127.0.0.1:{port}/0"

        def up() -> bool:
            try:
                return bool(redis.Redis.from_url(url).ping())
            except redis.RedisError:
                return False

        assert wait_until(up, timeout=10), "redis-server did not start"
        return url

    yield start
    for process in processes:
        process.kill()
        process.wait(10)


def redis_store(settings: Any, url: str) -> None:
    settings.IDEMPOTENCY = {
        "STORE": "idempotency_django.store.redis.RedisStore",
        "STORE_OPTIONS": {"URL": url},
    }


def test_a_redis_that_evicts_keys_is_reported(settings: Any, own_redis: Any) -> None:
    redis_store(settings, own_redis("--maxmemory-policy", "allkeys-lru"))

    found = checks.check_store_eviction()

    assert [e.id for e in found] == ["idempotency_django.W040"]
    assert "allkeys-lru" in found[0].msg
    assert get_store().eviction_policy() == "allkeys-lru"  # type: ignore[attr-defined]


def test_a_redis_that_never_evicts_is_not_reported(settings: Any, own_redis: Any) -> None:
    redis_store(settings, own_redis("--maxmemory-policy", "noeviction"))

    assert checks.check_store_eviction() == []


def test_a_redis_that_does_not_tell_its_policy_is_not_reported(
    settings: Any, own_redis: Any
) -> None:
    """Managed services often disable CONFIG: the policy is then the operator's to set
    (docs/security.md), and startup is not held up by it."""
    redis_store(
        settings,
        own_redis("--maxmemory-policy", "allkeys-lru", "--rename-command", "CONFIG", '""'),
    )

    assert checks.check_store_eviction() == []
    assert get_store().eviction_policy() is None  # type: ignore[attr-defined]


def test_an_unreachable_redis_is_not_reported_by_the_eviction_check(settings: Any) -> None:
    redis_store(settings, "redis://127.0.0.1:1/0")

    assert checks.check_store_eviction() == []


def test_the_database_store_has_no_eviction_to_report() -> None:
    if ON_REDIS:
        pytest.skip("the suite's store is Redis")
    assert checks.check_store_eviction() == []
