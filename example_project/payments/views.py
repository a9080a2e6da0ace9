from __future__ import annotations

import json
import re
from typing import Any

from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods

from example_project.payments import provider
from example_project.payments.auth import basic_auth_required
from example_project.payments.models import Charge
from example_project.payments.problems import problem
from idempotency_django.decorators import idempotent

CARDS = ("tok_visa", "tok_declined", "tok_timeout")


@csrf_exempt
@require_http_methods(["GET", "POST"])
@basic_auth_required
@idempotent
def charges(request: HttpRequest) -> HttpResponse:
    """``GET``: the account's charges. ``POST``: charge a card, once per Idempotency-Key."""
    account = request.user
    assert isinstance(account, User)  # basic_auth_required answered 401 otherwise
    if request.method == "GET":
        results = [c.as_json() for c in Charge.objects.filter(account=account).order_by("pk")]
        return JsonResponse({"count": len(results), "results": results})
    data, errors = _validate(request.body)
    if errors:
        return problem(400, "invalid-charge", "Invalid charge", errors=errors)
    try:
        provider.charge(data["card"], data["amount"], data["currency"])
    except provider.CardDeclined:
        return problem(402, "card-declined", "Your card was declined")
    except provider.ProviderTimeout:
        return problem(504, "provider-timeout", "The card provider did not answer in time")
    charge = Charge.objects.create(account=account, **data)
    response = JsonResponse(charge.as_json(), status=201)
    response["Location"] = f"/charges/{charge.public_id}"
    return response


def _validate(body: bytes) -> tuple[dict[str, Any], dict[str, str]]:
    try:
        data = json.loads(body)
    except ValueError:
        return {}, {"body": "must be a JSON object"}
    if not isinstance(data, dict):
        return {}, {"body": "must be a JSON object"}
    errors = {}
    amount = data.get("amount")
    if not isinstance(amount, int) or isinstance(amount, bool) or amount <= 0:
        errors["amount"] = "must be an integer greater than 0"
    currency = data.get("currency")
    if not isinstance(currency, str) or not re.fullmatch(r"[A-Za-z]{3}", currency):
        errors["currency"] = "must be 3 letters"
    if data.get("card") not in CARDS:
        errors["card"] = f"must be one of {', '.join(CARDS)}"
    if errors or not isinstance(currency, str):
        return {}, errors
    return {"amount": amount, "currency": currency.upper(), "card": data["card"]}, {}
