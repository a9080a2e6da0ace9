"""The Celery integration (``idempotency_django.celery.IdempotentTask``): in this process
through ``apply()`` and direct calls, then a real worker (prefork, 2 processes) fed by a real
Redis broker, with duplicates, a store outage and a worker killed mid-task.

The worker tests need PostgreSQL (``DATABASE_URL``) and Redis (``CELERY_TEST_BROKER``,
default ``redis://127.0.0.1:6379/5``); without either they are skipped.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from idempotency_django.celery import IdempotentTask
from idempotency_django.core import keys
from idempotency_django.exceptions import InFlight
from idempotency_django.models import IdempotencyRecord
from idempotency_django.tasks import TaskInFlight, TaskStoreUnavailable
from tests import records
from tests.models import SideEffect
from tests.project import celery_app
from tests.project.celery_app import charge, charge_on_redis, held
from tools.redis_cluster import SmallCluster, free_port

pytestmark = pytest.mark.django_db(transaction=True)

REPO_ROOT = Path(__file__).resolve().parents[1]
READY_WITHIN_SECONDS = 45.0
RESULT_WITHIN_SECONDS = 30.0


def effects(task: str, key: str) -> list[SideEffect]:
    """The side effects of one task's key, oldest first."""
    return list(SideEffect.objects.filter(label__startswith=f"{task}:{key}:").order_by("pk"))


def new_order() -> str:
    return f"order-{uuid.uuid4()}"


@celery_app.app.task(base=IdempotentTask, bind=True, name="tests.note")
def note(self: IdempotentTask, text: str) -> dict[str, Any]:
    """Keyed by its task id (the default)."""
    return {"effect": SideEffect.objects.create(label=f"note:{self.request.id}:0").pk}


# --- in this process: apply() and direct calls ------------------------------------------------


def test_one_message_runs_once_whatever_its_deliveries() -> None:
    task_id = str(uuid.uuid4())
    first = note.apply(args=["hello"], task_id=task_id)
    again = note.apply(args=["hello"], task_id=task_id)
    other = note.apply(args=["hello"])

    assert [first.state, again.state, other.state] == ["SUCCESS"] * 3
    assert again.result == first.result
    assert other.result != first.result
    assert len(effects("note", task_id)) == 1
    assert SideEffect.objects.filter(label__startswith="note:").count() == 2
    record = records.get(key=task_id)
    assert (record.account, record.endpoint) == ("celery", "task:tests.note")


def test_a_business_key_dedupes_messages_that_carry_it() -> None:
    order = new_order()
    results = [charge.apply(args=[order, 100]) for _ in range(3)]

    assert [result.result for result in results] == [results[0].result] * 3
    assert len(effects("charge", order)) == 1
    record = records.get(key=order)
    assert (record.account, record.endpoint) == ("orders", "task:tests.charge")


def test_called_as_a_function_it_is_protected_by_its_key_argument() -> None:
    order = new_order()
    assert charge(order, 100) == charge(order, 100)
    assert len(effects("charge", order)) == 1


def test_called_as_a_function_without_a_key_argument_it_says_what_is_missing() -> None:
    with pytest.raises(TypeError, match="called without a task id"):
        note("hello")
    assert not SideEffect.objects.exists()


def test_called_as_a_function_a_key_in_flight_is_raised_to_the_caller() -> None:
    """No worker to retry it: the caller gets the plain API's TaskInFlight."""
    order = new_order()
    endpoint = "task:tests.charge"
    now = timezone.now()
    records.create(
        account="orders",
        endpoint=endpoint,
        key=order,
        fingerprint=keys.task_fingerprint(endpoint, {"amount": 100}, "test"),
        token="a" * 32,
        created_at=now,
        lease_expires_at=now + timedelta(seconds=10),
        expires_at=now + timedelta(days=1),
    )
    with pytest.raises(TaskInFlight):
        charge(order, 100)
    assert not effects("charge", order)


def test_apply_under_a_store_outage_gives_the_refusal_instead_of_recursing(
    settings: Any,
) -> None:
    """Run eagerly (``apply()``, ``task_always_eager``) nothing can deliver the message
    later: Celery would retry at once, in the same call and without the countdown, until
    ``RecursionError``. The caller gets the refusal, and nothing ran."""
    settings.IDEMPOTENCY = {
        "STORE": "idempotency_django.store.redis.RedisStore",
        "STORE_OPTIONS": {"URL": f"redis://127.0.0.1:{free_port()}/0"},  # nothing listens
    }
    result = note.apply(args=["hello"])

    assert result.state == "FAILURE"
    assert isinstance(result.result, TaskStoreUnavailable)
    assert not SideEffect.objects.exists()


def test_apply_of_a_key_in_flight_gives_task_in_flight() -> None:
    order = new_order()
    endpoint = "task:tests.charge"
    now = timezone.now()
    records.create(
        account="orders",
        endpoint=endpoint,
        key=order,
        fingerprint=keys.task_fingerprint(endpoint, {"amount": 100}, "test"),
        token="a" * 32,
        created_at=now,
        lease_expires_at=now + timedelta(seconds=10),
        expires_at=now + timedelta(days=1),
    )
    result = charge.apply(args=[order, 100])

    assert result.state == "FAILURE"
    # Celery keeps a failure's exception in a form that pickles: TaskInFlight's base.
    assert isinstance(result.result, InFlight)
    assert "still running" in str(result.result)
    assert not effects("charge", order)


def test_defaults_keep_the_message_until_the_work_is_done() -> None:
    assert charge.acks_late is True
    assert charge.reject_on_worker_lost is True
    assert charge.max_retries is None


# --- a real worker on a real Redis broker -----------------------------------------------------


@pytest.fixture(scope="module")
def broker() -> str:
    if connection.vendor != "postgresql":
        pytest.skip("the Celery worker tests run on PostgreSQL (DATABASE_URL)")
    import redis

    try:
        redis.Redis.from_url(celery_app.BROKER, socket_connect_timeout=2).ping()
    except redis.RedisError as error:
        pytest.skip(f"Redis is not answering at {celery_app.BROKER}: {error}")
    return celery_app.BROKER


class Worker:
    """``celery worker`` (prefork, 2 processes) in a session of its own, on its own queue."""

    def __init__(self, log_path: Path, queue: str, redis_store: str) -> None:
        self.queue = queue
        self.log_path = log_path
        self._log = log_path.open("wb")
        env = {
            **os.environ,
            "CELERY_TEST_DATABASE": str(connection.settings_dict["NAME"]),
            "CELERY_TEST_QUEUE": queue,
            "CELERY_TEST_REDIS_STORE": redis_store,
            "PYTHONUNBUFFERED": "1",
        }
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "tests.project.celery_app",
                "worker",
                "--pool",
                "prefork",
                "--concurrency",
                "2",
                "--queues",
                queue,
                "--hostname",
                f"{queue}@%h",
                "--without-gossip",
                "--without-mingle",
                "--loglevel",
                "INFO",
            ],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        wait_for(lambda: " ready." in self.log(), READY_WITHIN_SECONDS, self.log, self.process)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGQUIT)  # cold shutdown: the tests are over
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)
        self._log.close()


def wait_for(
    condition: Callable[[], bool],
    within: float,
    log: Callable[[], str],
    process: subprocess.Popen[bytes] | None = None,
) -> None:
    """Poll ``condition`` (the worker's state is only seen from outside) until it holds."""
    deadline = time.monotonic() + within
    while not condition():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the worker exited ({process.returncode}):\n{log()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within} s:\n{log()}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def redis_store() -> Iterator[SmallCluster]:
    """A one-node Redis Cluster on a free port, not started: ``charge_on_redis``'s store."""
    cluster = SmallCluster((free_port(cluster=True),))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def worker(
    broker: str,
    django_db_setup: None,
    tmp_path_factory: pytest.TempPathFactory,
    redis_store: SmallCluster,
) -> Iterator[Worker]:
    """One worker for the module's tests (each uses keys of its own), on the test database."""
    log_path = tmp_path_factory.mktemp("celery") / "worker.log"
    started = Worker(log_path, f"idempotency-test-{uuid.uuid4().hex[:12]}", redis_store.url)
    try:
        started.wait_ready()
        yield started
    finally:
        started.stop()


@contextlib.contextmanager
def store_refusing_connections() -> Iterator[None]:
    """The test database refuses new connections (the worker's) and the worker's open ones
    are closed, until the block ends: a store that cannot be reached."""
    import psycopg

    name = connection.settings_dict["NAME"]
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (ours,) = cursor.fetchone()
    server = {
        "host": connection.settings_dict["HOST"] or None,
        "port": connection.settings_dict["PORT"] or None,
        "user": connection.settings_dict["USER"] or None,
    }
    # Not from the test database itself: PostgreSQL won't close the current database.
    with psycopg.connect(dbname="postgres", autocommit=True, **server) as admin:
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = %s AND pid <> %s",
            [name, ours],
        )
        try:
            yield
        finally:
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')


@pytest.mark.celery
def test_worker_runs_eight_duplicate_messages_once(worker: Worker) -> None:
    """Eight messages carrying one order, to two worker processes at once: one charge, and
    every message's result is that charge."""
    order = new_order()
    sent = [charge.apply_async(args=[order, 100], queue=worker.queue) for _ in range(8)]

    results = [message.get(timeout=RESULT_WITHIN_SECONDS) for message in sent]

    assert len(effects("charge", order)) == 1, worker.log()
    assert results == [results[0]] * 8
    assert results[0]["effect"] == effects("charge", order)[0].pk


@pytest.mark.celery
def test_worker_retries_through_a_store_outage_and_runs_once_after_it(worker: Worker) -> None:
    """The store refuses connections: the task is retried (not acked as failed and dropped);
    once the store is back, the work runs once."""
    order = new_order()
    with store_refusing_connections():
        message = charge.apply_async(args=[order, 100], queue=worker.queue)
        # The worker tried, was refused, and scheduled a retry (the result backend says so).
        wait_for(lambda: message.state == "RETRY", RESULT_WITHIN_SECONDS, worker.log)
        retried_while_down = message.state
    assert retried_while_down == "RETRY"
    assert not effects("charge", order)

    result = message.get(timeout=RESULT_WITHIN_SECONDS)

    assert len(effects("charge", order)) == 1, worker.log()
    assert result == {"effect": effects("charge", order)[0].pk, "amount": 100}
    assert "TaskStoreUnavailable" in worker.log()


@pytest.mark.celery
def test_worker_retries_through_a_redis_cluster_outage_and_runs_once_after_it(
    worker: Worker, redis_store: SmallCluster
) -> None:
    """The store is a Redis Cluster that cannot be reached (redis-py raises
    ``RedisClusterUnreachableError``, which is no ``RedisError``): the task is retried, not
    failed and acked; once the cluster is up, the work runs once."""
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server")
    redis_store.kill()
    order = new_order()
    message = charge_on_redis.apply_async(args=[order, 100], queue=worker.queue)
    wait_for(lambda: message.state == "RETRY", RESULT_WITHIN_SECONDS, worker.log)
    assert not effects("charge_on_redis", order)
    redis_store.start()

    result = message.get(timeout=RESULT_WITHIN_SECONDS)

    assert len(effects("charge_on_redis", order)) == 1, worker.log()
    assert result == {"effect": effects("charge_on_redis", order)[0].pk, "amount": 100}
    assert "TaskStoreUnavailable" in worker.log()


@pytest.mark.celery
def test_worker_killed_mid_task_reruns_once_and_only_after_the_lease(worker: Worker) -> None:
    """SIGKILL the worker process running a task, after its side effect committed: the
    message is redelivered, held back while the dead run's lease is live, then run once
    more; the second run starts after the first run's lease lapsed."""
    task_id = str(uuid.uuid4())
    message = held.apply_async(args=["o-1"], queue=worker.queue, task_id=task_id)
    wait_for(lambda: len(effects("held", task_id)) == 1, RESULT_WITHIN_SECONDS, worker.log)
    first = effects("held", task_id)[0]
    pid = int(first.label.rsplit(":", 1)[1])

    os.kill(pid, signal.SIGKILL)
    record = records.get(key=task_id)
    lease = record.lease_expires_at
    assert record.state == IdempotencyRecord.State.IN_PROGRESS
    assert lease is not None
    assert len(effects("held", task_id)) == 1

    result = message.get(timeout=RESULT_WITHIN_SECONDS)

    runs = effects("held", task_id)
    assert len(runs) == 2, worker.log()
    assert runs[1].created_at >= lease
    assert result == {"effect": runs[1].pk, "order": "o-1"}
    assert records.get(key=task_id).state == IdempotencyRecord.State.COMPLETED
