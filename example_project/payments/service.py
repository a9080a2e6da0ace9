"""Charging a card, shared by the plain, async and DRF front doors of the example API."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from django.contrib.auth.models import User

from example_project.payments import provider
from example_project.payments.models import Charge

CARDS = ("tok_visa", "tok_declined", "tok_timeout")
PROBLEM = "application/problem+json"


@dataclass(frozen=True)
class Outcome:
    status: int
    data: dict[str, Any]
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


def problem(status: int, slug: str, title: str, **extra: Any) -> Outcome:
    body = {"type": f"urn:example-payments:{slug}", "title": title, "status": status, **extra}
    return Outcome(status, body, PROBLEM)


def validate(body: bytes) -> tuple[dict[str, Any], Outcome | None]:
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        return {}, problem(
            400, "invalid-charge", "Invalid charge", errors={"body": "must be a JSON object"}
        )
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
        return {}, problem(400, "invalid-charge", "Invalid charge", errors=errors)
    return {"amount": amount, "currency": currency.upper(), "card": data["card"]}, None


def _declined_or_timeout(error: Exception) -> Outcome:
    if isinstance(error, provider.CardDeclined):
        return problem(402, "card-declined", "Your card was declined")
    return problem(504, "provider-timeout", "The card provider did not answer in time")


def _created(charge: Charge) -> Outcome:
    return Outcome(201, charge.as_json(), headers={"Location": f"/charges/{charge.public_id}"})


def charge(account: User, body: bytes) -> Outcome:
    data, invalid = validate(body)
    if invalid is not None:
        return invalid
    try:
        provider.charge(data["card"], data["amount"], data["currency"])
    except (provider.CardDeclined, provider.ProviderTimeout) as error:
        return _declined_or_timeout(error)
    return _created(Charge.objects.create(account=account, **data))


async def acharge(account: User, body: bytes) -> Outcome:
    data, invalid = validate(body)
    if invalid is not None:
        return invalid
    try:
        await provider.acharge(data["card"], data["amount"], data["currency"])
    except (provider.CardDeclined, provider.ProviderTimeout) as error:
        return _declined_or_timeout(error)
    return _created(await Charge.objects.acreate(account=account, **data))


def charges_of(account: User) -> dict[str, Any]:
    results = [c.as_json() for c in Charge.objects.filter(account=account).order_by("pk")]
    return {"count": len(results), "results": results}
