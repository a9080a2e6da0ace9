"""Views the tests protect. Each execution of a view body writes one ``SideEffect`` row,
so tests count executions the way a user counts charges."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any

from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.template import engines
from django.template.response import TemplateResponse
from django.utils.decorators import method_decorator
from django.views import View

from idempotency_django.decorators import idempotent
from idempotency_django.responses import is_definitive
from tests.models import SideEffect


class Gate:
    """Holds a view inside its body until a test lets it go: concurrency without sleeps."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def reset(self) -> None:
        self.entered.clear()
        self.release.clear()

    def pass_through(self, timeout: float = 30) -> None:
        self.entered.set()
        self.release.wait(timeout)


gate = Gate()


def _body(request: HttpRequest) -> dict[str, Any]:
    try:
        data = json.loads(request.body or b"{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _effect(request: HttpRequest, label: str) -> HttpResponse:
    data = _body(request)
    if data.get("gate"):
        gate.pass_through()
    effect = SideEffect.objects.create(label=label)
    if data.get("raise"):
        raise RuntimeError("the view failed")
    status = int(data.get("status", 201))
    response = JsonResponse({"effect": effect.pk, "echo": data}, status=status)
    response["Location"] = f"/effects/{effect.pk}"
    response["X-Request-Id"] = f"req-{effect.pk}"
    response.set_cookie("session", "secret")
    return response


@idempotent
def effect(request: HttpRequest, number: int | None = None) -> HttpResponse:
    return _effect(request, "effect")


@idempotent
def slash_twin(request: HttpRequest) -> HttpResponse:
    """At ``/apart/``, while ``effect`` is at ``/apart``: two routes a slash apart."""
    return _effect(request, "slash-twin")


@idempotent
def keyed_effect(request: HttpRequest) -> HttpResponse:
    """``effect``, its executions counted per key: its ``SideEffect`` is labelled
    ``key:<Idempotency-Key>``."""
    return _effect(request, f"key:{request.headers['Idempotency-Key']}")


@idempotent(required=False)
def optional(request: HttpRequest) -> HttpResponse:
    return _effect(request, "optional")


@idempotent(mode="atomic")
def atomic(request: HttpRequest) -> HttpResponse:
    return _effect(request, "atomic")


@idempotent(mode="atomic", in_flight="wait", wait_seconds=20)
def atomic_waiting(request: HttpRequest) -> HttpResponse:
    """Atomic mode under "wait": a duplicate waits on the first transaction's row."""
    return _effect(request, "atomic")


@idempotent(mode="atomic", in_flight="wait", wait_seconds=1)
def atomic_short_wait(request: HttpRequest) -> HttpResponse:
    return _effect(request, "atomic")


@transaction.atomic
@idempotent
def inside_atomic(request: HttpRequest) -> HttpResponse:
    return _effect(request, "inside_atomic")


@idempotent(in_flight="wait", wait_seconds=20)
def waiting(request: HttpRequest) -> HttpResponse:
    return _effect(request, "waiting")


@idempotent(in_flight="wait", wait_seconds=0.2)
def short_wait(request: HttpRequest) -> HttpResponse:
    return _effect(request, "short_wait")


@idempotent(fingerprint_fields=["amount"])
def fields(request: HttpRequest) -> HttpResponse:
    return _effect(request, "fields")


def _amount_only(request: HttpRequest) -> str:
    return str(_body(request).get("amount"))


@idempotent(fingerprint=_amount_only)
def custom_fingerprint(request: HttpRequest) -> HttpResponse:
    return _effect(request, "custom_fingerprint")


@idempotent(store_statuses=[201])
def only_201(request: HttpRequest) -> HttpResponse:
    return _effect(request, "only_201")


@idempotent(methods=["POST", "PUT"])
def with_put(request: HttpRequest) -> HttpResponse:
    return _effect(request, "with_put")


@idempotent
def stream(request: HttpRequest) -> StreamingHttpResponse:
    SideEffect.objects.create(label="stream")
    return StreamingHttpResponse(iter([b"chunk-1,", b"chunk-2"]), status=201)


@method_decorator(idempotent, name="dispatch")
class EffectView(View):
    def post(self, request: HttpRequest) -> HttpResponse:
        return _effect(request, "class_based")


class AsyncHold:
    """Parks an async view until the test lets it go (or cancels it).

    ``on_return``: called by the async views as they return (a test cancels the request's
    task there). ``rendering``/``render_release``: hold ``async_receipt``'s response while
    it renders, in its ``sync_to_async`` thread."""

    entered: asyncio.Event | None = None
    release: asyncio.Event | None = None
    on_return: Callable[[], object] | None = None
    rendering: threading.Event | None = None
    render_release: threading.Event | None = None

    def returning(self) -> None:
        if self.on_return is not None:
            self.on_return()

    def slow_value(self) -> str:
        """What the receipt's template reads: a lazy value that takes its time."""
        if self.rendering is not None and self.render_release is not None:
            self.rendering.set()
            self.render_release.wait(30)
        return "paid"


async_hold = AsyncHold()


@idempotent
async def async_effect(request: HttpRequest) -> HttpResponse:
    data = _body(request)
    if data.get("hold") and async_hold.entered is not None and async_hold.release is not None:
        async_hold.entered.set()
        await async_hold.release.wait()
    effect = await SideEffect.objects.acreate(label="async")
    if data.get("raise"):
        raise RuntimeError("the view failed")
    async_hold.returning()
    return JsonResponse({"effect": effect.pk, "echo": data}, status=int(data.get("status", 201)))


_RECEIPT = engines["django"].from_string("Charge {{ effect }}: {{ status }}")


@idempotent
async def async_receipt(request: HttpRequest) -> TemplateResponse:
    """Its response renders after it returned, when ``@idempotent`` captures it."""
    effect = await SideEffect.objects.acreate(label="async_receipt")
    return TemplateResponse(
        request, _RECEIPT, {"effect": effect.pk, "status": async_hold.slow_value}, status=201
    )


def terminate_backend(alias: str = "default") -> None:
    """Kill this thread's database connection from another one, as an operator (or a
    failover) would: the server really closes it."""
    from django.db import connections

    own = connections[alias]
    own.ensure_connection()
    other = connections.create_connection(alias)
    try:
        with other.cursor() as cursor:
            if own.vendor == "postgresql":
                cursor.execute("SELECT pg_terminate_backend(%s)", [own.connection.info.backend_pid])
            else:
                cursor.execute(f"KILL {int(own.connection.thread_id())}")
    finally:
        other.close()


@idempotent
def loses_its_connection(request: HttpRequest) -> HttpResponse:
    """Does its work, then loses the store's connection before the completion."""
    effect = SideEffect.objects.create(label="loses_its_connection")
    terminate_backend()
    return JsonResponse({"effect": effect.pk}, status=201)


@idempotent
def forgets_prepared_statements(request: HttpRequest) -> HttpResponse:
    """Does its work, then the server forgets the connection's prepared statements behind
    psycopg's back, as a transaction-mode pooler does when the next transaction lands on
    another server connection: the completion's prepared statement no longer exists."""
    from django.db import connection

    effect = SideEffect.objects.create(label="forgets_prepared_statements")
    connection.connection.pgconn.exec_(b"DEALLOCATE ALL")  # unseen by psycopg
    return JsonResponse({"effect": effect.pk}, status=201)


@idempotent
def dies_mid_write(request: HttpRequest) -> HttpResponse:
    """Writes, then its connection dies before the view hears back: the outcome is unknown."""
    SideEffect.objects.create(label="dies_mid_write")
    terminate_backend()
    SideEffect.objects.count()  # raises: the server closed the connection
    return JsonResponse({}, status=201)  # pragma: no cover


def not_validation_failures(status: int) -> bool:
    """A ``STORE_STATUSES`` that leaves validation failures (400, 422) out: Stripe's rule."""
    return is_definitive(status) and status not in (400, 422)
