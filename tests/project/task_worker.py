"""A queue consumer in its own OS process, driven line by line by ``tests/test_tasks.py``.

    python -m tests.project.task_worker MESSAGE_ID LEASE_SECONDS

It sets Django up on the test database named in ``TASK_WORKER_DATABASE`` (the same server
as ``DATABASE_URL``), connects, and prints ``ready``. Each ``deliver`` line on stdin is one
delivery of the message to ``handle``; the outcome is printed as one line:

- ``ran <json>``: this delivery ran the handler, whose result is ``<json>``;
- ``replayed <json>``: an earlier delivery ran it; ``<json>`` is the stored result;
- ``in_flight <retry_after>``: another delivery is running it.

Inside the handler, after its side effect (a ``SideEffect`` row, committed), the worker
prints ``entered`` and waits for a ``finish`` line before it returns: the test holds it
there to make the others see it in flight, or kills it there to simulate a crash.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import django


def setup() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.project.settings")
    from django.conf import settings

    settings.DATABASES["default"]["NAME"] = os.environ["TASK_WORKER_DATABASE"]
    django.setup()
    if os.environ.get("IDEMPOTENCY_TEST_STORE") == "redis":  # as tests/conftest.py does
        from idempotency_django.conf import DEFAULTS

        DEFAULTS["STORE"] = "idempotency_django.store.redis.RedisStore"
        DEFAULTS["STORE_OPTIONS"] = {
            "URL": os.environ.get("IDEMPOTENCY_TEST_REDIS_URL", "redis://127.0.0.1:6379/3"),
            "KEY_PREFIX": "idemtest",
        }


def command() -> str:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit(0)  # the test closed our stdin: stop
    return line.strip()


def say(*words: str) -> None:
    print(*words, flush=True)


def main(message_id: str, lease_seconds: float) -> None:
    setup()
    from django.db import connection

    from idempotency_django.tasks import TaskInFlight, idempotent_task
    from tests.models import SideEffect

    executed: list[bool] = []

    @idempotent_task(scope="redelivery", key="message_id", lease_seconds=lease_seconds)
    def handle(message_id: str, amount: int) -> dict[str, Any]:
        executed.append(True)
        effect = SideEffect.objects.create(label=message_id)
        say("entered")
        if command() != "finish":
            raise RuntimeError("expected 'finish'")
        return {"effect": effect.pk, "pid": os.getpid(), "amount": amount}

    connection.ensure_connection()
    say("ready")
    while True:
        if command() != "deliver":
            raise RuntimeError("expected 'deliver'")
        executed.clear()
        try:
            result = handle(message_id, amount=100)
        except TaskInFlight as exc:
            say("in_flight", str(exc.retry_after))
            continue
        outcome = "ran" if executed else "replayed"
        say(outcome, json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
