"""Single flight on ninja operations under real concurrency: threads with their own
database connections, released together by a barrier, against PostgreSQL and MariaDB."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User

from tests.conftest import effects, post_from_thread
from tests.project.views import gate
from tools.threads import start_together

pytestmark = [
    pytest.mark.concurrency,
    pytest.mark.django_db(transaction=True),
    pytest.mark.urls("tests.project.ninja_urls"),
]

THREADS = 8


def send(path: str, body: dict[str, Any]) -> Any:
    return post_from_thread(
        f"/ninja{path}", body, {"Idempotency-Key": "k1", "Authorization": "Bearer alice"}
    )


@pytest.mark.parametrize("path", ["/r/effects/", "/r/async/"])
def test_identical_requests_at_once_run_the_operation_once(path: str, alice: User) -> None:
    """One thread wins the claim and is held inside the operation; every other one is told
    409 with Retry-After at once; after the winner finishes, a retry replays its answer."""
    body = {"amount": 10, "gate": True}
    results, threads = start_together(THREADS, lambda: send(path, body))
    try:
        assert gate.entered.wait(timeout=20)
        refused = [results.get(timeout=20) for _ in range(THREADS - 1)]
    finally:
        gate.release.set()
        for thread in threads:
            thread.join(timeout=30)
    winner = results.get(timeout=20)
    retry = send(path, body)

    assert [r.status_code for r in refused] == [409] * (THREADS - 1)
    assert all(r["Content-Type"] == "application/problem+json" for r in refused)
    assert all(r["Retry-After"] == "1" for r in refused)
    assert all(r.json()["type"] == "urn:idempotency-django:problem:in-flight" for r in refused)
    assert winner.status_code == 201
    assert retry.status_code == 201
    assert retry.content == winner.content
    assert retry["Idempotent-Replayed"] == "true"
    assert effects() == 1
