"""A real Prometheus scrapes the example under ``gunicorn -w 4`` (prometheus-client's
multiprocess mode, ``idempotency_django.metrics.gunicorn``) and its counters, read back
through Prometheus's HTTP API, equal the requests sent, summed across the workers: first
runs, replays, a 409, 422s, 400s and 503s while the store (a Redis of our own) is down."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tools import redis_cluster
from tools.server import (
    Database,
    Server,
    assert_in_flight,
    assert_problem,
    charge_body,
    example_env,
    free_port,
    new_key,
    spawn_gunicorn,
)

PACKAGE = Path(__file__).resolve().parents[2] / "idempotency_django"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
DEADLINE_SECONDS = 40
PREFIX = f"scrape-{os.getpid()}"


@pytest.fixture
def redis() -> Iterator[redis_cluster.StandaloneRedis]:
    try:
        server = redis_cluster.StandaloneRedis().start()
    except (RuntimeError, OSError, TimeoutError) as error:
        pytest.skip(f"no redis-server: {error}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def example(
    e2e_db: Database, redis: redis_cluster.StandaloneRedis, tmp_path: Path
) -> Iterator[Server]:
    env = example_env(
        e2e_db.url,
        EXAMPLE_REDIS_URL=redis.url,
        EXAMPLE_REDIS_KEY_PREFIX=PREFIX,
        EXAMPLE_METRICS="prometheus",
        EXAMPLE_PROVIDER_DELAY_MS="1500",
        PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "multiproc"),
    )
    server = spawn_gunicorn(
        env,
        tmp_path / "gunicorn.log",
        extra_args=["-c", "python:idempotency_django.metrics.gunicorn"],
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
        print(server.log())


@pytest.fixture
def prometheus(example: Server, tmp_path: Path) -> Iterator[str]:
    if not Path(PROMETHEUS).exists():
        pytest.skip("no prometheus server (apt-get install prometheus)")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n  - job_name: example\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{example.port}']\n"
    )
    log = (tmp_path / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(30)
        log.close()


def poll(what: str, get: Any, until: Any) -> Any:
    """``get()`` until ``until`` holds for it, within the deadline (Prometheus scrapes every
    second: polling its API is the synchronisation)."""
    deadline = time.monotonic() + DEADLINE_SECONDS
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = get()
        except requests.RequestException as error:
            last = error
        else:
            if until(last):
                return last
        time.sleep(0.2)
    raise AssertionError(f"{what}: never reached; last {last!r}")


def _query(base: str, promql: str) -> list[dict[str, Any]]:
    answer = requests.get(f"{base}/api/v1/query", params={"query": promql}, timeout=5).json()
    assert answer["status"] == "success", answer
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def outcomes(base: str) -> dict[str, float]:
    return {
        item["metric"]["idempotency_outcome"]: float(item["value"][1])
        for item in _query(base, "sum by (idempotency_outcome) (idempotency_requests_total)")
    }


def records_in(redis: redis_cluster.StandaloneRedis) -> int:
    import redis as redis_py

    client = redis_py.Redis.from_url(redis.url)
    try:
        return sum(1 for _ in client.scan_iter(match=f"{PREFIX}:*"))
    finally:
        client.close()


def target_up(base: str) -> bool:
    answer = requests.get(f"{base}/api/v1/targets", timeout=5).json()
    targets = answer["data"]["activeTargets"]
    return bool(targets) and all(target["health"] == "up" for target in targets)


def test_prometheus_counts_what_was_sent_across_four_workers(
    example: Server, prometheus: str, redis: redis_cluster.StandaloneRedis, tmp_path: Path
) -> None:
    poll("the scrape target up", lambda: target_up(prometheus), bool)
    bodies = {new_key(): charge_body() for _ in range(6)}
    for key, body in bodies.items():  # first runs
        assert example.post_charge(body, key=key).status_code == 201
    replays = list(bodies.items())[:4]
    for key, body in replays * 2:  # replays, on whichever worker accepts them
        response = example.post_charge(body, key=key)
        assert response.status_code == 201
        assert response.headers["Idempotent-Replayed"] == "true"
    for key, body in list(bodies.items())[:3]:  # the key reused with another body
        assert_problem(example.post_charge({**body, "amount": body["amount"] + 1}, key=key), 422)
    assert_problem(example.post_charge(charge_body(), key=None), 400)
    assert_problem(example.post_charge(charge_body(), key='"unterminated'), 400)
    # A duplicate while the first runs (the provider takes 1.5 s): 409.
    slow_key, slow_body = new_key(), charge_body()
    stored = records_in(redis)
    first: list[requests.Response] = []
    running = threading.Thread(
        target=lambda: first.append(example.post_charge(slow_body, key=slow_key))
    )
    running.start()
    poll("the slow charge's claim", lambda: records_in(redis), lambda count: count > stored)
    assert_in_flight(example.post_charge(slow_body, key=slow_key))
    running.join()
    assert first[0].status_code == 201
    # The store down: 503s, the view never runs.
    redis.kill()
    for _ in range(2):
        assert_problem(example.post_charge(charge_body(), key=new_key()), 503)

    expected = {
        "claimed": 6 + 1,
        "replayed": 8,
        "mismatch": 3,
        "key_invalid": 2,
        "in_flight": 1,
        "store_unavailable": 2,
    }
    got = poll(
        "the counters, summed across the workers",
        lambda: outcomes(prometheus),
        lambda found: sum(found.values()) >= sum(expected.values()),
    )
    assert got == {name: float(count) for name, count in expected.items()}
    # The shipped dashboard's queries all run on this Prometheus, and those of the traffic
    # sent here have an answer.
    dashboard = json.loads((PACKAGE / "metrics" / "grafana-dashboard.json").read_text())
    answered = {
        panel["title"]: _query(prometheus, target["expr"])
        for panel in dashboard["panels"]
        for target in panel["targets"]
    }
    for title in ("Protected requests by outcome", "Store latency, p95 by operation"):
        assert answered[title], title
    # Several workers counted them (one file each), and the scrape summed them.
    assert len(list((tmp_path / "multiproc").glob("counter_*.db"))) >= 2
