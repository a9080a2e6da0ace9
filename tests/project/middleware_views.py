"""Views for the middleware tests: none of them is decorated unless its name says so, so
the only protection they get is ``IdempotencyMiddleware``'s. Each execution writes one
``SideEffect`` row."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views import View
from rest_framework import serializers, viewsets
from rest_framework.authentication import TokenAuthentication
from rest_framework.decorators import action, api_view, authentication_classes, permission_classes
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from idempotency_django.decorators import idempotency_exempt, idempotent
from idempotency_django.drf import IdempotentMixin
from tests.models import SideEffect
from tests.project.views import _body, _effect, async_hold, gate

ViewFunc = Callable[..., Any]

# Called inside ``plain`` while it holds its claim (tests set it).
DURING: list[Callable[[], object]] = []


def plain(request: HttpRequest) -> HttpResponse:
    for call in DURING:
        call()
    return _effect(request, "mw_plain")


@idempotency_exempt
def exempt(request: HttpRequest) -> HttpResponse:
    return _effect(request, "mw_exempt")


def named(request: HttpRequest) -> HttpResponse:
    """Exempted by URL name in the tests that list it in EXEMPT_URL_NAMES."""
    return _effect(request, "mw_named")


async def async_plain(request: HttpRequest) -> HttpResponse:
    data = _body(request)
    if data.get("hold") and async_hold.entered is not None and async_hold.release is not None:
        async_hold.entered.set()
        await async_hold.release.wait()
    effect = await SideEffect.objects.acreate(label="mw_async")
    if data.get("raise"):
        raise RuntimeError("the view failed")
    async_hold.returning()
    return JsonResponse({"effect": effect.pk, "echo": data}, status=201)


class PlainClassView(View):
    def post(self, request: HttpRequest) -> HttpResponse:
        return _effect(request, "mw_class")

    @idempotency_exempt
    def patch(self, request: HttpRequest) -> HttpResponse:
        return _effect(request, "mw_class_exempt_patch")


@idempotency_exempt
class ExemptClassView(View):
    def post(self, request: HttpRequest) -> HttpResponse:
        return _effect(request, "mw_exempt_class")


class WhoAmI(serializers.Serializer[Any]):
    amount = serializers.IntegerField()
    gate = serializers.BooleanField(required=False)


class TokenChargeView(APIView):
    """A DRF view *without* the mixin: it authenticates inside itself, by token only."""

    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated]

    def post(self, request: Request) -> Response:
        serializer = WhoAmI(data=request.data)
        serializer.is_valid(raise_exception=True)
        if request.data.get("gate"):
            gate.pass_through()
        effect = SideEffect.objects.create(label="mw_drf")
        return Response(
            {"effect": effect.pk, "user": request.user.username, **serializer.validated_data},
            status=201,
        )


class ChargeViewSet(viewsets.ViewSet):
    """A viewset without the mixin, routed by a router (its actions bound by ``as_view``)."""

    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated]

    def create(self, request: Request) -> Response:
        effect = SideEffect.objects.create(label="mw_viewset")
        if request.data.get("crash"):
            raise RuntimeError("the view failed")
        return Response({"effect": effect.pk, "user": request.user.username}, status=201)

    def list(self, request: Request) -> Response:
        return Response({"effects": SideEffect.objects.filter(label="mw_viewset").count()})

    @idempotency_exempt
    @action(detail=False, methods=["post"])
    def ping(self, request: Request) -> Response:
        effect = SideEffect.objects.create(label="mw_viewset_ping")
        return Response({"effect": effect.pk}, status=201)


class MixinChargeView(IdempotentMixin, APIView):
    """Already protected by the mixin: the middleware leaves it to it."""

    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated]

    def post(self, request: Request) -> Response:
        effect = SideEffect.objects.create(label="mw_mixin")
        return Response({"effect": effect.pk}, status=201)


@api_view(["POST"])
@authentication_classes([TokenAuthentication])
@permission_classes([IsAuthenticated])
def api_function(request: Request) -> Response:
    """DRF's function views are ``APIView`` classes too: claimed after DRF's auth."""
    effect = SideEffect.objects.create(label="mw_api_function")
    return Response({"effect": effect.pk, "user": request.user.username}, status=201)


@idempotency_exempt
class ExemptAPIView(APIView):
    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated]

    def post(self, request: Request) -> Response:
        effect = SideEffect.objects.create(label="mw_exempt_drf")
        return Response({"effect": effect.pk}, status=201)


@transaction.non_atomic_requests
def non_atomic(request: HttpRequest) -> HttpResponse:
    """Opted out of ATOMIC_REQUESTS by its author: the middleware keeps it out."""
    effect = SideEffect.objects.create(label="mw_non_atomic")
    return JsonResponse({"effect": effect.pk, "in_atomic": connection.in_atomic_block}, status=201)


# --- nested layers: claimed by the middleware, then met again inside the view ------------------


def without_wraps(view: ViewFunc) -> ViewFunc:
    """A project's decorator that does not use functools.wraps: the view's ``@idempotent``
    marker is lost, so the middleware claims, and the decorator is met inside that claim."""

    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        return view(request, *args, **kwargs)

    return wrapper


def async_without_wraps(view: ViewFunc) -> ViewFunc:
    async def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        return await view(request, *args, **kwargs)

    return wrapper


@without_wraps
@idempotent
def wrapped(request: HttpRequest) -> HttpResponse:
    for call in DURING:
        call()
    return _effect(request, "mw_wrapped")


@idempotent
def charge(request: HttpRequest) -> HttpResponse:
    for call in DURING:
        call()
    return _effect(request, "mw_charge")


def calls_charge(request: HttpRequest) -> HttpResponse:
    """Undecorated: it calls an ``@idempotent`` function with its own request."""
    return charge(request)


@without_wraps
@idempotent
def wrapped_calls_charge(request: HttpRequest) -> HttpResponse:
    """Three layers of one scope: the middleware, the view's hidden @idempotent, charge's."""
    return charge(request)


def calls_charge_twice(request: HttpRequest) -> HttpResponse:
    first = charge(request)
    second = charge(request)
    return JsonResponse({"first": first.status_code, "second": second.status_code}, status=201)


@idempotent(endpoint=lambda request: "charge-of-its-own")
def charge_of_its_own(request: HttpRequest) -> HttpResponse:
    return _effect(request, "mw_own_scope")


def calls_another_scope(request: HttpRequest) -> HttpResponse:
    """Its inner function scopes its key apart (its own endpoint): two claims, two records."""
    inner = charge_of_its_own(request)
    SideEffect.objects.create(label="mw_outer")
    if "X-Outer-Status" in request.headers:  # not in the fingerprint: the retry is the same
        return HttpResponse(status=int(request.headers["X-Outer-Status"]))
    return inner


async def _held_async_effect(request: HttpRequest, label: str) -> HttpResponse:
    data = _body(request)
    if data.get("hold") and async_hold.entered is not None and async_hold.release is not None:
        async_hold.entered.set()
        await async_hold.release.wait()
    effect = await SideEffect.objects.acreate(label=label)
    return JsonResponse({"effect": effect.pk, "echo": data}, status=201)


@async_without_wraps
@idempotent
async def async_wrapped(request: HttpRequest) -> HttpResponse:
    return await _held_async_effect(request, "mw_async_wrapped")


@idempotent
async def async_charge(request: HttpRequest) -> HttpResponse:
    return await _held_async_effect(request, "mw_async_charge")


async def async_calls_charge(request: HttpRequest) -> HttpResponse:
    return await async_charge(request)


# --- decorators a URLconf wraps around views: the middleware must run them ------------------


def counted(view: ViewFunc) -> ViewFunc:
    """A URLconf decorator (``functools.wraps``, as Django's own) that counts its runs in a
    ``SideEffect`` of its own and marks the response, so a test sees that it ran."""

    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        SideEffect.objects.create(label="mw_wrapper")
        response = view(request, *args, **kwargs)
        response["X-Wrapper"] = "ran"
        return response

    return wrapper


def forbidding(view: ViewFunc) -> ViewFunc:
    """A URLconf decorator that refuses every request, as an IP allow-list or a feature flag
    that is off would: the view behind it must never run."""

    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        return HttpResponse("forbidden by the URLconf", status=403)

    return wrapper


def async_forbidding(view: ViewFunc) -> ViewFunc:
    """``forbidding`` as an async decorator (a view Django calls with ``await``)."""

    async def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        return HttpResponse("forbidden by the URLconf", status=403)

    functools.update_wrapper(wrapper, view)
    return wrapper


def hiding(view: ViewFunc) -> ViewFunc:
    """A decorator that keeps ``__wrapped__`` but not the view's attributes: to the
    middleware a plain view, which system check E027 reports when a DRF view is behind."""

    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        return view(request, *args, **kwargs)

    wrapper.__wrapped__ = view  # type: ignore[attr-defined]
    return wrapper


async def async_calls_charge_twice(request: HttpRequest) -> HttpResponse:
    first = await async_charge(request)
    second = await async_charge(request)
    return JsonResponse({"first": first.status_code, "second": second.status_code}, status=201)
