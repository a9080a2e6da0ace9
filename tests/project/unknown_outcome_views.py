"""Views that lose their database connection after a side effect (issue 17, item 6): one
per adapter. While ``LOSING`` names an error class, each writes its ``SideEffect`` row and
then raises that error, as a view does whose connection broke after a write that may have
committed; once it is empty, each answers 201."""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path
from ninja import NinjaAPI
from ninja.responses import Status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView, exception_handler

from idempotency_django.decorators import idempotent
from idempotency_django.drf import IdempotentMixin
from idempotency_django.ninja import idempotent as ninja_idempotent
from tests.models import SideEffect

LOSING: list[type[DatabaseError]] = []
MESSAGES = {
    "InterfaceError": "connection already closed",
    "OperationalError": "server closed the connection unexpectedly",
}


def _work(label: str) -> int:
    effect = SideEffect.objects.create(label=label)
    for error in LOSING:
        raise error(MESSAGES[error.__name__])
    return effect.pk


@idempotent
def decorated(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"effect": _work("decorated")}, status=201)


@idempotent
async def decorated_async(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"effect": await sync_to_async(_work)("decorated_async")}, status=201)


def plain(request: HttpRequest) -> HttpResponse:
    """Undecorated: protected by the middleware."""
    return JsonResponse({"effect": _work("plain")}, status=201)


def answer_everything(exc: Exception, context: dict[str, Any]) -> Response:
    """A project's ``EXCEPTION_HANDLER`` that answers the errors DRF leaves unanswered
    itself, as a 500 in the project's format."""
    response = exception_handler(exc, context)
    return response or Response({"error": type(exc).__name__}, status=500)


class MixinView(IdempotentMixin, APIView):
    """DRF's own handler: an unexpected error propagates."""

    def post(self, request: Request) -> Response:
        return Response({"effect": _work("drf")}, status=201)


class HandledMixinView(MixinView):
    def get_exception_handler(self) -> Any:
        return answer_everything


class HandledPlainView(APIView):
    """A DRF view without the mixin, under the middleware, whose handler answers errors."""

    def get_exception_handler(self) -> Any:
        return answer_everything

    def post(self, request: Request) -> Response:
        return Response({"effect": _work("drf_plain")}, status=201)


api = NinjaAPI(urls_namespace="unknown-outcomes")


@api.exception_handler(Exception)
def answer_as_500(request: HttpRequest, exc: Exception) -> HttpResponse:
    """What a project's catch-all handler (or ninja's own, under DEBUG) does."""
    return HttpResponse(type(exc).__name__, status=500)


@api.post("/op/", response={201: dict[str, int]})
@ninja_idempotent
def operation(request: HttpRequest) -> Any:
    return Status(201, {"effect": _work("ninja")})


@api.post("/async-op/", response={201: dict[str, int]})
@ninja_idempotent
async def async_operation(request: HttpRequest) -> Any:
    return Status(201, {"effect": await sync_to_async(_work)("ninja_async")})


urlpatterns = [
    path("uo/decorated/", decorated),
    path("uo/decorated-async/", decorated_async),
    path("uo/plain/", plain),
    path("uo/drf/", MixinView.as_view()),
    path("uo/drf-handled/", HandledMixinView.as_view()),
    path("uo/drf-plain-handled/", HandledPlainView.as_view()),
    path("uo/ninja/", api.urls),
]
