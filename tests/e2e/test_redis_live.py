"""The example on the Redis store, single Redis (db 4) and the local Redis Cluster, served
by gunicorn with 4 workers and by uvicorn: concurrent duplicates make one charge, and a
request whose workers are all SIGKILLed mid-flight keeps its key until its lease lapses,
then one retry takes over. The records are in Redis: the database holds none."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import requests

from tests.e2e.test_gunicorn import assert_replay_of
from tools import redis_cluster
from tools.server import (
    REPLAYED,
    Database,
    Server,
    assert_in_flight,
    charge_body,
    query,
    race_duplicates,
    retry_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.redis_cluster]

SINGLE = "redis://127.0.0.1:6379/4"
CLUSTER = "redis+cluster://127.0.0.1:7100/0"
CLIENTS = 8


@pytest.fixture(params=["redis-db4", "cluster"])
def redis_url(request: pytest.FixtureRequest) -> str:
    if request.param == "cluster":
        if not redis_cluster.healthy():
            pytest.skip("no Redis Cluster (python -m tools.redis_cluster start)")
        url = CLUSTER
    else:
        url = SINGLE
    try:
        redis_cluster.flush(url)
    except Exception as error:
        pytest.skip(f"no Redis at {url}: {error}")
    return url


def records_in_database(database: Database) -> int:
    return int(query(database, "SELECT COUNT(*) FROM idempotency_django_idempotencyrecord")[0][0])


def one_charge_from_duplicates(server: Server, key: str) -> None:
    body = charge_body()
    before = server.charge_count()
    barrier = threading.Barrier(CLIENTS, timeout=30)
    results: list[requests.Response | BaseException | None] = [None] * CLIENTS

    def client(index: int) -> None:
        try:
            barrier.wait()
            results[index] = server.post_charge(body, key=key)
        except BaseException as exc:
            results[index] = exc

    threads = [threading.Thread(target=client, args=(index,)) for index in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    responses = [result for result in results if isinstance(result, requests.Response)]
    assert len(responses) == CLIENTS, results
    ran = [r for r in responses if r.status_code == 201 and REPLAYED not in r.headers]
    assert len(ran) == 1, sorted(r.status_code for r in responses)
    for response in responses:
        if response.status_code == 409:
            assert_in_flight(response)
        else:
            assert response.status_code == 201
    charge_id = ran[0].json()["id"]
    assert server.charge_count() == before + 1
    assert_replay_of(server.post_charge(body, key=key), 201, charge_id)


def test_gunicorn_duplicates_make_one_charge_on_redis(
    start_example: Callable[..., Server], e2e_db: Database, redis_url: str, key: str
) -> None:
    server = start_example(EXAMPLE_REDIS_URL=redis_url)
    records = records_in_database(e2e_db)
    one_charge_from_duplicates(server, key)
    assert records_in_database(e2e_db) == records


def test_uvicorn_duplicates_make_one_charge_on_redis(
    uvicorn_example: Callable[..., Server], e2e_db: Database, redis_url: str, key: str
) -> None:
    server = uvicorn_example(workers=2, EXAMPLE_REDIS_URL=redis_url)
    records = records_in_database(e2e_db)
    one_charge_from_duplicates(server, key)
    assert records_in_database(e2e_db) == records


def test_killed_workers_keep_the_key_until_the_lease_lapses_then_one_retry_takes_over(
    start_example: Callable[..., Server], redis_url: str, key: str
) -> None:
    lease, delay = 8.0, 5.0  # see test_gunicorn's test of the same name
    server = start_example(
        EXAMPLE_REDIS_URL=redis_url,
        EXAMPLE_LEASE_SECONDS=str(lease),
        EXAMPLE_PROVIDER_DELAY_MS=str(int(delay * 1000)),
    )
    body = charge_body()
    before = server.charge_count()
    running, refused = race_duplicates(server, body, key=key)
    assert refused.outcome is not None, refused.error
    assert_in_flight(refused.outcome)

    killed = server.kill_workers()
    running.wait_done()
    assert running.outcome is None, "the request was answered although its worker died"
    (taken,), waited = retry_until(
        lambda: (server.post_charge(body, key=key),),
        lambda result: result[0].status_code != 409,
        within=40,
        every=0.5,
    )
    assert waited, "the first retry after the kill took over a claim whose lease was valid"
    for (response,) in waited:
        assert_in_flight(response)
    assert taken.status_code == 201, (taken.status_code, taken.text)
    assert REPLAYED not in taken.headers
    assert server.charge_count() == before + 1
    assert_replay_of(server.post_charge(body, key=key), 201, taken.json()["id"])
    assert not set(killed) & set(server.worker_pids())
