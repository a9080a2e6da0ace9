"""URLs of the live ASGI tests: the example's, plus an async view whose response renders
after it returned (``/receipts/charges/``), so that a client can go away between the work
and the recording of its outcome."""

from __future__ import annotations

import json

from django.db import connection
from django.http import HttpRequest, HttpResponse
from django.template import engines
from django.template.response import TemplateResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

from example_project.payments import service
from example_project.payments.auth import abasic_auth_required
from example_project.urls import urlpatterns as example_urlpatterns
from idempotency_django.decorators import idempotent

# The e2e test creates this table and locks it, to hold a receipt while it renders.
RENDER_GATE_TABLE = "e2e_render_gate"

_RECEIPT = engines["django"].from_string("Charge {{ charge }}: {{ note }}")


def _note() -> str:
    """A lazy value of the receipt, read when it renders (in ``@idempotent``'s capture,
    after the view returned): it waits while the test holds the gate table locked."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT COUNT(*) FROM {RENDER_GATE_TABLE}")
        cursor.fetchone()
    return "paid"


@csrf_exempt
@abasic_auth_required
@idempotent
async def receipts(request: HttpRequest) -> HttpResponse:
    """``POST``: charge a card, as ``/async/charges/``, and answer with a rendered receipt."""
    outcome = await service.acharge(request.user, json.loads(request.body))  # type: ignore[arg-type]
    if outcome.status != 201:
        return HttpResponse(json.dumps(outcome.data), status=outcome.status)
    return TemplateResponse(
        request, _RECEIPT, {"charge": outcome.data["id"], "note": _note}, status=201
    )


urlpatterns = [*example_urlpatterns, path("receipts/charges/", receipts)]
