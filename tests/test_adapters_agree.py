"""Rules every adapter applies the same way: each case is run through every
adapter that has it, so one adapter cannot drift from the others unnoticed."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse
from django.urls import path
from django.utils import timezone
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from idempotency_django.decorators import idempotent
from idempotency_django.drf import IdempotentMixin
from idempotency_django.models import IdempotencyRecord
from idempotency_django.store import never
from idempotency_django.tasks import claim_once, idempotent_task
from tests import records
from tests.conftest import ON_REDIS

# --- ttl_seconds=None: keep forever, as TTL_SECONDS = None; left out: the setting ------------


@idempotent(ttl_seconds=None)
def view_forever(request: HttpRequest) -> HttpResponse:
    return HttpResponse(status=201)


@idempotent
def view_by_setting(request: HttpRequest) -> HttpResponse:
    return HttpResponse(status=201)


class _DRFView(IdempotentMixin, APIView):
    authentication_classes: list[type] = []
    permission_classes = [AllowAny]

    def get_idempotency_account(self, request: Request) -> str:
        return "account"

    def post(self, request: Request) -> Response:
        return Response(status=201)


class DRFForever(_DRFView):
    idempotency_ttl_seconds = None


class DRFBySetting(_DRFView):
    pass


@idempotent_task(scope="s", key="message_id", ttl_seconds=None)
def task_forever(message_id: str) -> None: ...


@idempotent_task(scope="s", key="message_id")
def task_by_setting(message_id: str) -> None: ...


# --- max_response_bytes per view or task: over it, the outcome is kept without its body -----

BIG = "x" * 64  # over the MAX_RESPONSE_BYTES the tests set (32), under a limit of 1000


@idempotent(max_response_bytes=10)
def view_small_limit(request: HttpRequest) -> HttpResponse:
    return HttpResponse(BIG, status=201)


@idempotent(max_response_bytes=1000)
def view_large_limit(request: HttpRequest) -> HttpResponse:
    return HttpResponse(BIG, status=201)


class DRFSmallLimit(_DRFView):
    idempotency_max_response_bytes = 10

    def post(self, request: Request) -> Response:
        return Response(BIG, status=201)


class DRFLargeLimit(DRFSmallLimit):
    idempotency_max_response_bytes = 1000


urlpatterns = [
    path("view-forever/", view_forever),
    path("view-by-setting/", view_by_setting),
    path("drf-forever/", DRFForever.as_view()),
    path("drf-by-setting/", DRFBySetting.as_view()),
    path("view-small-limit/", view_small_limit),
    path("view-large-limit/", view_large_limit),
    path("drf-small-limit/", DRFSmallLimit.as_view()),
    path("drf-large-limit/", DRFLargeLimit.as_view()),
]


def _view(url: str) -> Callable[[Any], None]:
    def run(client: Any) -> None:
        response = client.post(
            url,
            data="{}",
            content_type="application/json",
            headers={"Idempotency-Key": "k1", "X-User": "alice"},
        )
        assert response.status_code == 201

    return run


def _claim_once(ttl: dict[str, Any]) -> Callable[[Any], None]:
    def run(client: Any) -> None:
        with claim_once("s", "k1", **ttl) as block:
            block.result = 1

    return run


@pytest.mark.urls("tests.test_adapters_agree")
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("run", "forever"),
    [
        (_view("/view-forever/"), True),
        (_view("/view-by-setting/"), False),
        (_view("/drf-forever/"), True),
        (_view("/drf-by-setting/"), False),
        (lambda client: task_forever("k1"), True),
        (lambda client: task_by_setting("k1"), False),
        (_claim_once({"ttl_seconds": None}), True),
        (_claim_once({}), False),
    ],
    ids=[
        "view-none",
        "view-unset",
        "drf-none",
        "drf-unset",
        "task-none",
        "task-unset",
        "claim_once-none",
        "claim_once-unset",
    ],
)
def test_ttl_seconds_none_keeps_the_key_forever_in_every_adapter(
    client: Any, alice: User, settings: Any, run: Callable[[Any], None], forever: bool
) -> None:
    settings.IDEMPOTENCY = {"TTL_SECONDS": 600}

    run(client)

    record = records.get()
    assert record.state == IdempotencyRecord.State.COMPLETED
    if forever:
        assert record.expires_at == never()
    elif ON_REDIS:  # the Redis store keeps no completed_at: its expiry counts from now
        left = record.expires_at - timezone.now()
        assert timedelta(seconds=590) < left <= timedelta(seconds=600)
    else:
        assert record.completed_at is not None
        assert record.expires_at - record.completed_at == timedelta(seconds=600)


def _posted_twice(url: str) -> Callable[[Any, User], tuple[Any, Any]]:
    def run(client: Any, user: User) -> tuple[Any, Any]:
        def post() -> Any:
            return client.post(
                url,
                data="{}",
                content_type="application/json",
                headers={"Idempotency-Key": "k1", "X-User": user.username},
            )

        return post(), post()

    return run


def _ninja_twice(limit: int, *, router: bool) -> Callable[[Any, User], tuple[Any, Any]]:
    def run(client: Any, user: User) -> tuple[Any, Any]:
        from ninja import Router
        from ninja.testing import TestClient

        from idempotency_django.ninja import IdempotentRouter
        from idempotency_django.ninja import idempotent as ninja_idempotent

        operations: Router
        if router:
            operations = IdempotentRouter(idempotency={"max_response_bytes": limit})

            @operations.post("/big/")
            def by_router(request: Any) -> HttpResponse:
                return HttpResponse(BIG, status=201)

        else:
            operations = Router()

            @operations.post("/big/")
            @ninja_idempotent(max_response_bytes=limit)
            def by_decorator(request: Any) -> HttpResponse:
                return HttpResponse(BIG, status=201)

        test_client = TestClient(operations)

        def post() -> Any:
            return test_client.post("/big/", json={}, headers={"Idempotency-Key": "k1"}, user=user)

        return post(), post()

    return run


@pytest.mark.urls("tests.test_adapters_agree")
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("run", "stored"),
    [
        (_posted_twice("/view-small-limit/"), False),
        (_posted_twice("/view-large-limit/"), True),
        (_posted_twice("/drf-small-limit/"), False),
        (_posted_twice("/drf-large-limit/"), True),
        (_ninja_twice(10, router=False), False),
        (_ninja_twice(1000, router=False), True),
        (_ninja_twice(10, router=True), False),
        (_ninja_twice(1000, router=True), True),
    ],
    ids=[
        "view-below",
        "view-above",
        "drf-below",
        "drf-above",
        "ninja-below",
        "ninja-above",
        "ninja-router-below",
        "ninja-router-above",
    ],
)
def test_a_views_max_response_bytes_overrides_the_setting_in_every_adapter(
    client: Any, alice: User, settings: Any, run: Callable[[Any, User], Any], stored: bool
) -> None:
    settings.IDEMPOTENCY = {"MAX_RESPONSE_BYTES": 32}

    first, again = run(client, alice)

    assert first.status_code == 201
    record = records.get()
    assert record.state == IdempotencyRecord.State.COMPLETED
    if stored:
        assert record.response_body is not None
        assert again.content == first.content
        assert again["Idempotent-Replayed"] == "true"
    else:
        assert record.response_body is None
        assert again.status_code == 409
        assert json.loads(again.content)["type"].endswith("response-not-stored")


@idempotent_task(scope="s", key="message_id", max_response_bytes=10)
def task_small_limit(message_id: str) -> str:
    return BIG


@idempotent_task(scope="s", key="message_id", max_response_bytes=1000)
def task_large_limit(message_id: str) -> str:
    return BIG


def _claim_once_big(limit: int) -> Callable[[], Any]:
    def run() -> Any:
        with claim_once("s", "k1", max_response_bytes=limit) as block:
            if not block.done:
                block.result = BIG
        return block.result

    return run


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("run", "stored"),
    [
        (lambda: task_small_limit("k1"), False),
        (lambda: task_large_limit("k1"), True),
        (_claim_once_big(10), False),
        (_claim_once_big(1000), True),
    ],
    ids=["task-below", "task-above", "claim_once-below", "claim_once-above"],
)
def test_a_tasks_max_response_bytes_overrides_the_setting(
    settings: Any, run: Callable[[], Any], stored: bool
) -> None:
    from idempotency_django.tasks import TaskResultNotStored

    settings.IDEMPOTENCY = {"MAX_RESPONSE_BYTES": 32}

    assert run() == BIG
    if stored:
        assert run() == BIG
        assert records.get().response_body is not None
    else:
        with pytest.raises(TaskResultNotStored):
            run()
        assert records.get().response_body is None


def test_a_bad_max_response_bytes_is_refused_where_it_is_declared() -> None:
    with pytest.raises(ImproperlyConfigured, match=r"max_response_bytes=-1: expected a number"):
        idempotent(max_response_bytes=-1)(view_by_setting)
    with pytest.raises(ImproperlyConfigured, match=r"BadLimit.*max_response_bytes='big'"):

        class BadLimit(_DRFView):
            idempotency_max_response_bytes: Any = "big"

    with pytest.raises(ImproperlyConfigured, match=r"claim_once\('s'\).*max_response_bytes"):
        claim_once("s", "k1", max_response_bytes=-1)


# --- async views and mode="atomic": refused where declared, naming the view -----------------


async def refund_async(request: Any) -> dict[str, str]:
    return {}


def refund_sync(request: Any) -> dict[str, str]:
    return {}


def _decorator(func: Callable[..., Any]) -> Any:
    from idempotency_django.decorators import idempotent

    return idempotent(mode="atomic")(func)


def _ninja_decorator(func: Callable[..., Any]) -> Any:
    from ninja import Router

    from idempotency_django.ninja import idempotent

    return Router().post("/refunds/")(idempotent(mode="atomic")(func))


def _ninja_router(func: Callable[..., Any]) -> Any:
    from idempotency_django.ninja import IdempotentRouter

    return IdempotentRouter(idempotency={"mode": "atomic"}).post("/refunds/")(func)


ADAPTERS = [_decorator, _ninja_decorator, _ninja_router]


@pytest.mark.parametrize("declare", ADAPTERS, ids=lambda adapter: adapter.__name__)
def test_an_async_view_in_atomic_mode_is_refused_when_declared(
    declare: Callable[[Callable[..., Any]], Any],
) -> None:
    with pytest.raises(ImproperlyConfigured, match=r"refund_async: mode='atomic' on an async"):
        declare(refund_async)


@pytest.mark.parametrize("declare", ADAPTERS, ids=lambda adapter: adapter.__name__)
def test_a_sync_view_in_atomic_mode_is_declared(
    declare: Callable[[Callable[..., Any]], Any],
) -> None:
    declare(refund_sync)


# --- one key rule: a key one entry point refuses, all refuse --------------------------------

KEYS = [
    ("abc", True),
    ("k" * 255, True),
    ("two words", True),  # the client sends it quoted, as an sf-string
    ('with "quotes" \\ & ~', True),
    (" padded ", True),
    ("", False),
    ("   ", False),
    ("k" * 256, False),
    ("café", False),
    ("a\nb", False),
    ("tab\there", False),
    ("a,b", False),
]


def _by_http(key: str) -> None:
    from idempotency_django.core import keys

    # What the client puts in the header, as the server reads it back.
    assert keys.parse_key(keys.header_value(key)) == key


def _by_task(key: str) -> None:
    from idempotency_django.tasks import task_key

    assert task_key(key) == key


def _by_client(key: str) -> None:
    from idempotency_django.client import check_key

    assert check_key(key) == key


@pytest.mark.parametrize("check", [_by_http, _by_task, _by_client], ids=lambda c: c.__name__)
@pytest.mark.parametrize(("key", "valid"), KEYS)
def test_every_entry_point_refuses_the_same_keys(
    check: Callable[[str], None], key: str, valid: bool
) -> None:
    from idempotency_django.exceptions import KeyMalformed

    if valid:
        check(key)
    else:
        with pytest.raises((KeyMalformed, ValueError)):
            check(key)
