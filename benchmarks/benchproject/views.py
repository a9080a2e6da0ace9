"""The benchmark's views: one charge (one ``INSERT``), bare and behind ``@idempotent``.

All three run the example's charge service (validation, the fake provider with its delay
set to 0 by the benchmark, one ``INSERT`` of a ``Charge``) and answer the same ``201``;
they differ only in the decorator.
"""

from __future__ import annotations

import json

from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from example_project.payments import service
from idempotency_django.decorators import idempotent


def _charge(request: HttpRequest) -> HttpResponse:
    account = request.user
    if not isinstance(account, User):
        return HttpResponse(status=401)
    outcome = service.charge(account, request.body)
    response = HttpResponse(
        json.dumps(outcome.data), status=outcome.status, content_type=outcome.content_type
    )
    for name, value in outcome.headers.items():
        response[name] = value
    return response


NULL_BODY = json.dumps({"id": "ch_0", "amount": 1000, "currency": "EUR", "status": "succeeded"})


def _null(request: HttpRequest) -> HttpResponse:
    """No database at all: what HTTP, gunicorn and Django cost before any view work."""
    return HttpResponse(NULL_BODY, status=201, content_type="application/json")


null = csrf_exempt(require_POST(_null))
bare = csrf_exempt(require_POST(_charge))
commit = csrf_exempt(require_POST(idempotent(_charge)))
atomic = csrf_exempt(require_POST(idempotent(mode="atomic")(_charge)))


@require_GET
def ping(request: HttpRequest) -> HttpResponse:
    """Readiness: answers once the worker has booted (and touches the database)."""
    return HttpResponse(str(User.objects.count()), content_type="text/plain")
