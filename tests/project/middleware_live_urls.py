"""URLs of the live middleware tests: the example's, plus its charges through views that
are *not* decorated (``/mw/charges/``) and a DRF viewset *without* the mixin
(``/mw/api/charges/``). Whatever protection these get is ``IdempotencyMiddleware``'s."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from django.contrib.auth import authenticate
from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.urls import include, path
from django.views.decorators.csrf import csrf_exempt
from rest_framework import viewsets
from rest_framework.authentication import BasicAuthentication
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import SimpleRouter

from example_project.payments import service
from example_project.payments.auth import _credentials
from idempotency_django.decorators import idempotent

DRF_PREFIX = "/mw/api/"


class BasicAuthMiddleware:
    """Sets ``request.user`` from HTTP Basic credentials, as a project's authentication
    middleware does, for every path but the DRF viewset's: that one authenticates inside
    itself, so the middleware must claim after DRF's authentication."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        credentials = _credentials(request)
        if credentials and not request.path.startswith(DRF_PREFIX):
            user = authenticate(request, username=credentials[0], password=credentials[1])
            if user is not None:
                request.user = user
        return self.get_response(request)


def _response(outcome: service.Outcome) -> HttpResponse:
    response = HttpResponse(
        json.dumps(outcome.data), status=outcome.status, content_type=outcome.content_type
    )
    for name, value in outcome.headers.items():
        response[name] = value
    return response


@csrf_exempt
def charges(request: HttpRequest) -> HttpResponse:
    """``POST``: charge a card. No ``@idempotent``: the middleware protects it."""
    if not isinstance(request.user, User):
        return _response(service.problem(401, "unauthorized", "Authentication required"))
    return _response(service.charge(request.user, json.loads(request.body)))


class ChargeViewSet(viewsets.ViewSet):
    """The example's viewset without ``IdempotentMixin``."""

    authentication_classes = [BasicAuthentication]
    permission_classes = [IsAuthenticated]

    def create(self, request: Request) -> Response:
        assert isinstance(request.user, User)
        outcome = service.charge(request.user, request.data)
        return Response(outcome.data, status=outcome.status, headers=outcome.headers)

    def list(self, request: Request) -> Response:
        assert isinstance(request.user, User)
        return Response(service.charges_of(request.user))


def _without_wraps(view: Callable[..., Any]) -> Callable[..., Any]:
    """A project's async decorator that does not use functools.wraps: the middleware cannot
    see the ``@idempotent`` beneath it, claims the request, and meets it inside that claim."""

    async def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        return await view(request, *args, **kwargs)

    return wrapper


@csrf_exempt
@_without_wraps
@idempotent
async def async_wrapped_charges(request: HttpRequest) -> HttpResponse:
    return await _acharge(request)


@idempotent
async def _acharge(request: HttpRequest) -> HttpResponse:
    user = request.user
    if not isinstance(user, User):
        return _response(service.problem(401, "unauthorized", "Authentication required"))
    return _response(await service.acharge(user, json.loads(request.body)))


@csrf_exempt
async def async_calls_charge(request: HttpRequest) -> HttpResponse:
    """Undecorated: it calls an ``@idempotent`` function with its own request."""
    return await _acharge(request)


router = SimpleRouter()
router.register("mw/api/charges", ChargeViewSet, basename="mw-api-charges")

urlpatterns: list[Any] = [
    path("mw/charges/", charges, name="mw-charges"),
    path("mw/async/wrapped/charges/", async_wrapped_charges),
    path("mw/async/calls/charges/", async_calls_charge),
    *router.urls,
    path("", include("example_project.urls")),
]
