"""django-ninja operations for the adapter's tests (``tests/project/ninja_urls.py`` mounts them).

Each execution of an operation's body writes one ``SideEffect``: what "exactly once" is
counted in. ``gate`` holds a body until a test lets it go (see ``tests.project.views.gate``).
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse
from ninja import NinjaAPI, Schema
from ninja.errors import HttpError
from ninja.responses import Status
from ninja.security import HttpBearer

from idempotency_django.decorators import idempotency_exempt
from idempotency_django.ninja import IdempotentRouter, idempotent
from tests.models import SideEffect
from tests.project.views import async_hold, gate


class UserBearer(HttpBearer):
    """``Authorization: Bearer <username>``: ninja's authenticated caller is that user."""

    def authenticate(self, request: HttpRequest, token: str) -> User | None:
        return User.objects.filter(username=token).first()


class TokenBearer(HttpBearer):
    """Returns the token itself, as many API-key authenticators do."""

    def authenticate(self, request: HttpRequest, token: str) -> str | None:
        return token if token.startswith("tok_") else None


class EffectIn(Schema):
    amount: int
    status: int = 201
    gate: bool = False
    fail: str | None = None  # "raise": an unhandled exception; "http-404": HttpError(404)


class EffectOut(Schema):
    effect: int
    amount: int


class Problem(Schema):
    detail: str


def _effect(label: str, payload: EffectIn, response: HttpResponse | None = None) -> Any:
    if payload.gate:
        gate.pass_through()
    effect = SideEffect.objects.create(label=label)
    if payload.fail == "raise":
        raise RuntimeError("the operation failed")
    if payload.fail == "http-404":
        raise HttpError(404, "no such thing")
    if response is not None:
        response["Location"] = f"/effects/{effect.pk}"
        response.set_cookie("session-ish", "first-caller-only")
    return Status(payload.status, {"effect": effect.pk, "amount": payload.amount})


api = NinjaAPI(urls_namespace="tests-ninja", title="tests")
router = IdempotentRouter(auth=UserBearer())


@router.post("/effects/", response={201: EffectOut, 200: EffectOut, 400: EffectOut})
def create_effect(request: HttpRequest, payload: EffectIn, response: HttpResponse) -> Any:
    return _effect("ninja-router", payload, response)


@router.patch("/effects/{number}", response={200: EffectOut, 201: EffectOut})
def patch_effect(request: HttpRequest, number: int, payload: EffectIn) -> Any:
    return _effect(f"ninja-patch-{number}", payload)


@router.get("/effects/", response={200: list[EffectOut]})
def list_effects(request: HttpRequest) -> Any:
    return []


@router.post(
    "/optional/",
    response={201: EffectOut},
    openapi_extra={"responses": {201: {"description": "Created, once."}}},
)
@idempotent(required=False, ttl_seconds=60)
def optional_effect(request: HttpRequest, payload: EffectIn) -> Any:
    return _effect("ninja-optional", payload)


@router.post("/async/", response={201: EffectOut})
async def async_effect(request: HttpRequest, payload: EffectIn) -> Any:
    from asgiref.sync import sync_to_async

    result = await sync_to_async(_effect)("ninja-async", payload)
    async_hold.returning()
    return result


@router.post("/stream/", response={201: EffectOut}, include_in_schema=False)
def not_protected_by_method(request: HttpRequest) -> Any:
    return Status(201, {"effect": 0, "amount": 0})


@api.post("/token/", auth=TokenBearer(), response={201: EffectOut})
@idempotent
def token_effect(request: HttpRequest, payload: EffectIn) -> Any:
    return _effect("ninja-token", payload)


def team_account(request: HttpRequest) -> str | None:
    """One operation's own account: the team in ``X-Team``, whoever of it authenticates."""
    return request.headers.get("X-Team")


@api.post("/team/", auth=UserBearer(), response={201: EffectOut})
@idempotent(account=team_account)
def team_effect(request: HttpRequest, payload: EffectIn) -> Any:
    return _effect("ninja-team", payload)


@api.post("/session/", response={201: EffectOut})
@idempotent
def session_effect(request: HttpRequest, payload: EffectIn) -> Any:
    """No ninja auth: the account is ``request.user`` (tests' ``X-User`` middleware)."""
    return _effect("ninja-session", payload)


@api.post("/plain/", response={201: EffectOut})
def plain_effect(request: HttpRequest, payload: EffectIn) -> Any:
    """Not protected: no router option, no decorator."""
    return _effect("ninja-plain", payload)


# Plain operations: only IdempotencyMiddleware protects them (in the tests that install it).


@api.post("/mw/plain/", auth=UserBearer(), response={201: EffectOut})
def middleware_plain(request: HttpRequest, payload: EffectIn) -> Any:
    return _effect("ninja-mw-plain", payload)


@api.post("/mw/async/", auth=UserBearer(), response={201: EffectOut})
async def middleware_async(request: HttpRequest, payload: EffectIn) -> Any:
    from asgiref.sync import sync_to_async

    return await sync_to_async(_effect)("ninja-mw-async", payload)


@api.post("/mw/exempt/", auth=UserBearer(), response={201: EffectOut})
@idempotency_exempt
def middleware_exempt(request: HttpRequest, payload: EffectIn) -> Any:
    return _effect("ninja-mw-exempt", payload)


api.add_router("/r", router)
