"""``@idempotent`` on ``async def`` views: the same contract, with the database off the loop."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from asgiref.sync import async_to_sync, iscoroutinefunction
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.test import AsyncClient, AsyncRequestFactory
from django.test.client import FakePayload

from idempotency_django.decorators import idempotent
from idempotency_django.models import IdempotencyRecord
from tests import views
from tests.conftest import effects

pytestmark = pytest.mark.django_db(transaction=True)


def apost(body: dict[str, Any], key: str | None = "k1", user: str | None = "alice") -> Any:
    headers = {}
    if key is not None:
        headers["Idempotency-Key"] = key
    if user is not None:
        headers["X-User"] = user

    async def send() -> Any:
        return await AsyncClient().post(
            "/async/", data=json.dumps(body), content_type="application/json", headers=headers
        )

    return async_to_sync(send)()


def test_two_key_header_lines_are_400_and_run_nothing(alice: User) -> None:
    """Under ASGI the lines arrive apart, and Django's ASGIRequest joins them by a comma."""
    body = json.dumps({"amount": 1}).encode()
    scope = {
        "method": "POST",
        "path": "/async/",
        "query_string": "",
        "server": ("127.0.0.1", "80"),
        "scheme": "http",
        "headers": [
            (b"host", b"testserver"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-user", b"alice"),
            (b"idempotency-key", b"k1"),
            (b"idempotency-key", b"k2"),
        ],
        "_body_file": FakePayload(body),
    }
    apost({"amount": 1}, key="k1")

    response = async_to_sync(AsyncClient().request)(**scope)

    assert response.status_code == 400
    assert json.loads(response.content)["type"] == ("urn:idempotency-django:problem:key-malformed")
    assert effects() == 1


def test_the_decorated_view_is_still_a_coroutine_function() -> None:
    assert iscoroutinefunction(views.async_effect)


def test_first_request_runs_and_a_retry_replays(alice: User) -> None:
    first = apost({"amount": 1})
    retry = apost({"amount": 1})

    assert first.status_code == retry.status_code == 201
    assert retry.content == first.content
    assert retry["Idempotent-Replayed"] == "true"
    assert effects("async") == 1


def test_mismatch_missing_and_malformed_keys(alice: User) -> None:
    apost({"amount": 1})

    assert apost({"amount": 2}).status_code == 422
    assert apost({"amount": 1}, key=None).status_code == 400
    assert apost({"amount": 1}, key="").status_code == 400
    assert apost({"amount": 1}, user=None).status_code == 403
    assert effects("async") == 1


def test_an_exception_releases_the_key(alice: User) -> None:
    with pytest.raises(RuntimeError):
        apost({"raise": True})

    assert not IdempotencyRecord.objects.exists()
    with pytest.raises(RuntimeError):
        apost({"raise": True})
    assert effects("async") == 2


def test_a_5xx_releases_and_a_4xx_is_stored(alice: User) -> None:
    apost({"status": 503})
    apost({"status": 503})
    apost({"status": 402}, key="k2")
    replay = apost({"status": 402}, key="k2")

    assert replay["Idempotent-Replayed"] == "true"
    assert effects("async") == 3


def cancel_mid_flight(request: Any, let_the_view_finish: bool) -> bool:
    """Cancel the view's task while it runs, as Django's ASGI handler does when the client
    disconnects; True when the task ended cancelled."""

    async def scenario() -> bool:
        views.async_hold.entered = asyncio.Event()
        views.async_hold.release = asyncio.Event()
        task = asyncio.ensure_future(views.async_effect(request))
        await asyncio.wait_for(views.async_hold.entered.wait(), timeout=20)
        task.cancel()
        await asyncio.sleep(0)  # deliver the cancellation while the view is still parked
        if let_the_view_finish:
            views.async_hold.release.set()
        try:
            await asyncio.wait_for(task, timeout=20)
        except asyncio.CancelledError:
            return True
        return False

    try:
        return async_to_sync(scenario)()
    finally:
        views.async_hold.entered = views.async_hold.release = None


def held_request(user: User) -> Any:
    request = AsyncRequestFactory().post(
        "/async/",
        data=json.dumps({"hold": True}),
        content_type="application/json",
        headers={"Idempotency-Key": "k1"},
    )
    request.user = user
    return request


def test_a_disconnected_request_finishes_and_its_retry_gets_the_replay(alice: User) -> None:
    """Default ON_DISCONNECT "finish": cancelling cannot call back work already started
    (a database write in a thread), so the view finishes and its outcome is stored."""
    assert cancel_mid_flight(held_request(alice), let_the_view_finish=True)

    record = IdempotencyRecord.objects.get()
    assert record.state == IdempotencyRecord.State.COMPLETED
    retry = apost({"hold": True})
    assert retry.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert effects("async") == 1


def test_on_disconnect_release_cancels_the_view_and_frees_the_key(
    alice: User, settings: Any
) -> None:
    settings.IDEMPOTENCY = {"ON_DISCONNECT": "release"}
    assert cancel_mid_flight(held_request(alice), let_the_view_finish=False)

    assert not IdempotencyRecord.objects.exists()
    retry = apost({"hold": True})
    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry
    assert effects("async") == 1


def test_atomic_mode_on_an_async_view_is_refused_at_import() -> None:
    async def view(request: object) -> None: ...

    with pytest.raises(ImproperlyConfigured, match="async"):
        idempotent(mode="atomic")(view)


def test_async_views_opt_out_of_atomic_requests_for_the_store() -> None:
    assert "default" in views.async_effect._non_atomic_requests  # type: ignore[attr-defined]
