"""The benchmark's views: one charge (one ``INSERT``), and what HTTP alone costs.

``bare`` parses the JSON body as the example does and runs its charge service (validation,
the fake provider with its delay set to 0 by the benchmark, one ``INSERT`` of a ``Charge``)
and answers ``201``. It imports nothing of idempotency_django, so the peers' servers
(``settings_dik``, ``settings_drf``) serve this very view behind their own middleware;
ours wraps it in ``protected.py``.
"""

from __future__ import annotations

import json
from typing import Any

from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from example_project.payments import jsonbody, service


def charge(request: HttpRequest) -> HttpResponse:
    account = request.user
    if not isinstance(account, User):
        return HttpResponse(status=401)
    try:
        body = jsonbody.loads(request.body)
    except jsonbody.InvalidJSON as error:
        outcome = service.invalid_json(str(error))
    else:
        outcome = service.charge(account, body)
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
bare = csrf_exempt(require_POST(charge))


@require_GET
def ping(request: HttpRequest) -> HttpResponse:
    """Readiness: answers once the worker has booted (and touches the database)."""
    return HttpResponse(str(User.objects.count()), content_type="text/plain")


def __getattr__(name: str) -> Any:
    """``views.commit`` and ``views.atomic`` (``components.py`` uses them), imported from
    ``protected`` only when asked for, so that the peers' servers never import our app."""
    if name in ("commit", "atomic"):
        from benchmarks.benchproject import protected

        return getattr(protected, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
