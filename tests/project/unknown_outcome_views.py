"""Views that lose their database connection after a side effect: one
per adapter. While ``LOSING`` names an error class, each writes its ``SideEffect`` row and
then raises that error, as a view does whose connection broke after a write that may have
committed; once it is empty, each answers 201."""

from __future__ import annotations

import threading
from typing import Any

from asgiref.sync import sync_to_async
from django.db import DatabaseError, connection, transaction
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


# -- work that the database rolls back: a lock timeout, a deadlock ---------------------------


class Contention:
    """What the contended views meet while ``kind`` is set. ``"lock-timeout"``: the row
    ``contended``, which a test holds, is locked with a short lock timeout. ``"deadlock"``:
    the row ``row-a`` is locked, then (once the test holds ``row-b`` and says so) ``row-b``,
    while the test asks for ``row-a``: the database picks this transaction as the victim
    (on PostgreSQL its ``deadlock_timeout`` runs out first; on MariaDB it wrote fewer rows).
    Either way the work's transaction is rolled back, its ``SideEffect`` row with it."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.kind: str | None = None
        self.holding_a = threading.Event()
        self.helper_holds_b = threading.Event()


CONTENTION = Contention()


def lock_row(label: str, *, lock_timeout: bool = False, deadlock_victim: bool = False) -> None:
    """``SELECT … FOR UPDATE`` the ``SideEffect`` row ``label`` in the open transaction, by
    its primary key: a locking read by another column would also wait on every row it
    scans (other transactions' uncommitted rows on InnoDB), not only on ``label``'s."""
    table = SideEffect._meta.db_table
    pk = SideEffect.objects.filter(label=label).values_list("pk", flat=True).get()
    select = f"SELECT id FROM {table} WHERE id = %s FOR UPDATE"
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            if lock_timeout:
                cursor.execute("SET LOCAL lock_timeout = '200ms'")
            if deadlock_victim:
                cursor.execute("SET LOCAL deadlock_timeout = '3s'")
        elif lock_timeout:  # MariaDB: a whole second is its least lock wait timeout
            select = f"SET STATEMENT innodb_lock_wait_timeout = 1 FOR {select}"
        cursor.execute(select, [pk])


def _contended_work(label: str) -> int:
    with transaction.atomic():
        effect = SideEffect.objects.create(label=label)
        if CONTENTION.kind == "lock-timeout":
            lock_row("locked-row", lock_timeout=True)
        elif CONTENTION.kind == "deadlock":
            lock_row("row-a")
            CONTENTION.holding_a.set()
            CONTENTION.helper_holds_b.wait(30)
            lock_row("row-b", deadlock_victim=True)
        return effect.pk


@idempotent
def contended(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"effect": _contended_work("contended")}, status=201)


class ContendedHandledView(HandledMixinView):
    """The mixin, with a handler that answers every error (the ``answered`` path)."""

    def post(self, request: Request) -> Response:
        return Response({"effect": _contended_work("contended_drf")}, status=201)


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
    path("uo/contended/", contended),
    path("uo/contended-drf-handled/", ContendedHandledView.as_view()),
]
