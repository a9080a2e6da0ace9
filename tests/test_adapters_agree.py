"""Rules every adapter applies the same way (issue 20): each case is run through every
adapter that has it, so one adapter cannot drift from the others unnoticed."""

from __future__ import annotations

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


urlpatterns = [
    path("view-forever/", view_forever),
    path("view-by-setting/", view_by_setting),
    path("drf-forever/", DRFForever.as_view()),
    path("drf-by-setting/", DRFBySetting.as_view()),
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
    from idempotency_django import keys

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
