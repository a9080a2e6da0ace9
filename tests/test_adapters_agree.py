"""Rules every adapter applies the same way (issue 20): each case is run through every
adapter that has it, so one adapter cannot drift from the others unnoticed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

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
