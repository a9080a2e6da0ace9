from __future__ import annotations

import json

from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods

from example_project.payments import service
from example_project.payments.auth import abasic_auth_required, basic_auth_required
from idempotency_django.decorators import idempotent


def _response(outcome: service.Outcome) -> HttpResponse:
    response = HttpResponse(
        json.dumps(outcome.data), status=outcome.status, content_type=outcome.content_type
    )
    for name, value in outcome.headers.items():
        response[name] = value
    return response


@csrf_exempt
@require_http_methods(["GET", "POST"])
@basic_auth_required
@idempotent
def charges(request: HttpRequest) -> HttpResponse:
    """``GET``: the account's charges. ``POST``: charge a card, once per Idempotency-Key."""
    account = request.user
    assert isinstance(account, User)  # basic_auth_required answered 401 otherwise
    if request.method == "GET":
        return JsonResponse(service.charges_of(account))
    return _response(service.charge(account, request.body))


@csrf_exempt
@require_http_methods(["GET", "POST"])
@abasic_auth_required
@idempotent
async def async_charges(request: HttpRequest) -> HttpResponse:
    """The same contract as ``charges``, as an async view (serve it with an ASGI server)."""
    account = request.user
    assert isinstance(account, User)
    if request.method == "GET":
        return JsonResponse(await _acharges_of(account))
    return _response(await service.acharge(account, request.body))


async def _acharges_of(account: User) -> dict[str, object]:
    from asgiref.sync import sync_to_async

    return await sync_to_async(service.charges_of)(account)
