"""``@idempotent`` on ``async def`` views: the same contract, with the database off the loop."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from asgiref.sync import async_to_sync, iscoroutinefunction
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.test import AsyncClient, AsyncRequestFactory
from django.test.client import FakePayload

from idempotency_django.core.heartbeat import heartbeat
from idempotency_django.decorators import idempotent
from idempotency_django.models import IdempotencyRecord
from tests import records
from tests.conftest import effects
from tests.models import SideEffect
from tests.project import views

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

    assert not records.exists()
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


async def deliver(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` as Django's ASGI handler does when the client disconnects, and let
    the loop hand it the cancellation (where it is parked now) before anything moves on."""
    task.cancel()
    for _ in range(3):
        await asyncio.sleep(0)


async def in_thread(event: threading.Event) -> None:
    """Wait on the event loop for an event set in a thread."""
    assert await asyncio.get_running_loop().run_in_executor(None, event.wait, 20)


def cancelled_at(view: Any, request: Any, where: str, *, let_the_view_finish: bool = True) -> bool:
    """Run ``view`` as a task and cancel it ``where``:

    - ``"view"``: while the view runs (parked in its body, then let go, unless not
      ``let_the_view_finish``);
    - ``"return"``: as the view returns (it cancels its own request's task there);
    - ``"render"``: after it returned, while its response renders in its thread (the
      capture of the outcome; ``async_receipt``).

    True when the task ended cancelled."""
    hold = views.async_hold

    async def scenario() -> bool:
        hold.entered, hold.release = asyncio.Event(), asyncio.Event()
        hold.rendering, hold.render_release = threading.Event(), threading.Event()
        task = asyncio.ensure_future(view(request))
        if where == "return":
            hold.on_return = task.cancel
        elif where == "view":
            await asyncio.wait_for(hold.entered.wait(), timeout=20)
            await deliver(task)
            if let_the_view_finish:
                hold.release.set()
        elif where == "render":
            await in_thread(hold.rendering)
            await deliver(task)
            hold.render_release.set()
        try:
            await asyncio.wait_for(task, timeout=20)
        except asyncio.CancelledError:
            return True
        return False

    try:
        return async_to_sync(scenario)()
    finally:
        hold.entered = hold.release = hold.on_return = None
        hold.rendering = hold.render_release = None


def held_request(user: User, path: str = "/async/", body: dict[str, Any] | None = None) -> Any:
    request = AsyncRequestFactory().post(
        path,
        data=json.dumps({"hold": True} if body is None else body),
        content_type="application/json",
        headers={"Idempotency-Key": "k1"},
    )
    request.user = user
    return request


def test_a_disconnected_request_finishes_and_its_retry_gets_the_replay(alice: User) -> None:
    """Default ON_DISCONNECT "finish": cancelling cannot call back work already started
    (a database write in a thread), so the view finishes and its outcome is stored."""
    assert cancelled_at(views.async_effect, held_request(alice), "view")

    record = records.get()
    assert record.state == IdempotencyRecord.State.COMPLETED
    retry = apost({"hold": True})
    assert retry.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert effects("async") == 1


@pytest.mark.parametrize("on_disconnect", ["finish", "release"])
def test_a_disconnect_as_the_view_returns_stores_its_outcome(
    alice: User, settings: Any, on_disconnect: str
) -> None:
    """The work is done: under either policy, its outcome is stored before the
    cancellation goes on, and the retry is a replay, not a second run."""
    settings.IDEMPOTENCY = {"ON_DISCONNECT": on_disconnect}
    assert cancelled_at(views.async_effect, held_request(alice, body={}), "return")

    assert records.get().state == IdempotencyRecord.State.COMPLETED
    retry = apost({})
    assert retry.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert effects("async") == 1


def receipt(user: str = "alice") -> Any:
    async def send() -> Any:
        return await AsyncClient().post(
            "/async-receipt/",
            data="{}",
            content_type="application/json",
            headers={"Idempotency-Key": "k1", "X-User": user},
        )

    return async_to_sync(send)()


@pytest.mark.parametrize("on_disconnect", ["finish", "release"])
def test_a_disconnect_while_the_response_renders_stores_it_and_the_retry_replays_it(
    alice: User, settings: Any, on_disconnect: str
) -> None:
    """A ``TemplateResponse`` renders after the view returned, when its outcome is
    captured (in a thread, reading a lazy value that takes its time): a cancel landing
    there must not release the key, under either policy."""
    settings.IDEMPOTENCY = {"ON_DISCONNECT": on_disconnect}
    request = held_request(alice, "/async-receipt/", body={})
    assert cancelled_at(views.async_receipt, request, "render")

    assert effects("async_receipt") == 1
    record = records.get()
    assert record.state == IdempotencyRecord.State.COMPLETED
    retry = receipt()
    assert retry.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == f"Charge {SideEffect.objects.get().pk}: paid".encode()
    assert effects("async_receipt") == 1


def test_on_disconnect_release_cancels_the_view_and_frees_the_key(
    alice: User, settings: Any
) -> None:
    settings.IDEMPOTENCY = {"ON_DISCONNECT": "release"}
    assert cancelled_at(views.async_effect, held_request(alice), "view", let_the_view_finish=False)

    assert not records.exists()
    retry = apost({"hold": True})
    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry
    assert effects("async") == 1


class ClaimHeld:
    """An execute wrapper that holds this thread's connection right after the claim's
    ``INSERT`` ran, until the test lets it go: the claim is in its thread, done or nearly."""

    def __init__(self) -> None:
        self.inserted = threading.Event()
        self.release = threading.Event()

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        try:
            return execute(sql, params, many, context)
        finally:  # a duplicate key too (MariaDB raises it)
            if "INSERT INTO" in sql.upper() and "IDEMPOTENCYRECORD" in sql.upper():
                self.inserted.set()
                self.release.wait(30)


def cancelled_while_claiming(user: User) -> bool:
    """Cancel the request while its claim is in its thread; True when it ended cancelled."""
    held = ClaimHeld()

    async def scenario() -> bool:
        task = asyncio.ensure_future(views.async_effect(held_request(user, body={})))
        await in_thread(held.inserted)
        await deliver(task)
        held.release.set()
        try:
            await asyncio.wait_for(task, timeout=20)
        except asyncio.CancelledError:
            return True
        return False

    # The claim runs in this thread (async_to_sync's executor for thread-sensitive calls).
    with connection.execute_wrapper(held):
        return async_to_sync(scenario)()


@pytest.mark.database_store("holds the claim's SQL statement to cancel mid-claim")
@pytest.mark.parametrize("on_disconnect", ["finish", "release"])
def test_a_disconnect_while_the_key_is_claimed_releases_the_claim(
    alice: User, settings: Any, on_disconnect: str
) -> None:
    """The claim commits in its thread whatever the event loop does; a request cancelled
    before its view began must not leave that claim behind (renewed by the heartbeat for
    MAX_RUN_SECONDS, every retry a 409): it is released, and the retry runs, once."""
    settings.IDEMPOTENCY = {"ON_DISCONNECT": on_disconnect}
    assert cancelled_while_claiming(alice)

    assert effects("async") == 0
    assert not records.exists()
    assert not [e for e in heartbeat._entries.values() if e.claim.scope.key == "k1"]
    retry = apost({})
    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry
    assert effects("async") == 1


@pytest.mark.database_store("holds the claim's SQL statement to cancel mid-claim")
def test_a_disconnect_while_a_completed_key_is_read_leaves_its_record(alice: User) -> None:
    first = apost({})

    assert cancelled_while_claiming(alice)

    assert records.get().state == IdempotencyRecord.State.COMPLETED
    assert apost({}).content == first.content
    assert effects("async") == 1


def test_atomic_mode_on_an_async_view_is_refused_at_import() -> None:
    async def view(request: object) -> None: ...

    with pytest.raises(ImproperlyConfigured, match="async"):
        idempotent(mode="atomic")(view)


def test_async_views_opt_out_of_atomic_requests_for_the_store() -> None:
    assert "default" in views.async_effect._non_atomic_requests  # type: ignore[attr-defined]


def test_a_refusals_receiver_may_use_the_database(alice: User) -> None:
    """A refusal before the claim (here a malformed key) is sent off the event loop, as the
    claim's own signals are: a receiver that queries the database works in an async view."""
    from idempotency_django import signals

    counted: list[int] = []

    def receiver(**kwargs: Any) -> None:
        counted.append(User.objects.count())

    signals.key_refused.connect(receiver)
    try:
        response = apost({"amount": 1}, key="")
    finally:
        signals.key_refused.disconnect(receiver)
    assert response.status_code == 400
    assert counted == [1]
