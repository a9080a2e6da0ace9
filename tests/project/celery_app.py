"""The Celery app and tasks of ``tests/test_celery.py``, and the worker that runs them.

The test process imports this module to send tasks (and to call them in-process); the
worker is started by the test as::

    python -m celery -A tests.project.celery_app worker --pool prefork --concurrency 2 -Q QUEUE

with ``CELERY_TEST_DATABASE`` naming the test database (on the server of ``DATABASE_URL``)
and ``CELERY_TEST_BROKER`` the Redis broker (also the result backend);
``CELERY_TEST_REDIS_STORE`` is the URL of the Redis store that ``charge_on_redis`` keeps
its keys in (the others keep them in the database). Side effects are ``SideEffect`` rows
labelled ``<task>:<key>:<pid>``, committed as they happen.
"""

from __future__ import annotations

import os
import time
from typing import Any

import django
from celery import Celery

from idempotency_django.celery import IdempotentTask

BROKER = os.environ.get("CELERY_TEST_BROKER", "redis://127.0.0.1:6379/5")
LEASE_SECONDS = 3.0
WORK_SECONDS = 0.3  # how long a charge takes, so that duplicates arrive while it runs
HELD_SECONDS = 30.0  # how long ``held``'s first run waits to be killed, at most

if os.environ.get("CELERY_TEST_DATABASE"):  # the worker process
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.project.settings")
    from django.conf import settings

    settings.DATABASES["default"]["NAME"] = os.environ["CELERY_TEST_DATABASE"]
    if os.environ.get("CELERY_TEST_REDIS_STORE"):
        settings.IDEMPOTENCY = {
            "STORE_OPTIONS": {"URL": os.environ["CELERY_TEST_REDIS_STORE"], "KEY_PREFIX": "celery"}
        }
    django.setup()

app = Celery("tests", broker=BROKER, backend=BROKER)
app.conf.update(
    task_default_queue=os.environ.get("CELERY_TEST_QUEUE", "celery"),
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)


def _effect(task: str, key: object) -> int:
    from tests.models import SideEffect

    label = f"{task}:{key}:{os.getpid()}"
    return int(SideEffect.objects.create(label=label).pk)


@app.task(
    base=IdempotentTask,
    name="tests.charge",
    idempotency={"scope": "orders", "key": "order", "lease_seconds": LEASE_SECONDS},
)
def charge(order: str, amount: int) -> dict[str, Any]:
    """One charge per order, whichever message (task id) carries it."""
    effect = _effect("charge", order)
    time.sleep(WORK_SECONDS)  # the provider's round trip
    return {"effect": effect, "amount": amount}


@app.task(
    base=IdempotentTask,
    name="tests.charge_on_redis",
    idempotency={
        "scope": "orders",
        "key": "order",
        "lease_seconds": LEASE_SECONDS,
        "store": "idempotency_django.store.redis.RedisStore",
    },
)
def charge_on_redis(order: str, amount: int) -> dict[str, Any]:
    """``charge`` with its keys in the Redis store (``CELERY_TEST_REDIS_STORE``)."""
    return {"effect": _effect("charge_on_redis", order), "amount": amount}


@app.task(
    base=IdempotentTask, bind=True, name="tests.held", idempotency={"lease_seconds": LEASE_SECONDS}
)
def held(self: IdempotentTask, order: str) -> dict[str, Any]:
    """One run per message (the default key, the task id). The first run commits its side
    effect, then waits to be killed (bounded); a later run returns at once."""
    from tests.models import SideEffect

    effect = _effect("held", self.request.id)
    if SideEffect.objects.filter(label__startswith=f"held:{self.request.id}:").count() == 1:
        deadline = time.monotonic() + HELD_SECONDS
        while time.monotonic() < deadline:
            time.sleep(0.1)  # the test SIGKILLs this process meanwhile
    return {"effect": effect, "order": order}
