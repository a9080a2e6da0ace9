"""Charging a card, shared by the plain, async and DRF front doors of the example API."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from django.contrib.auth.models import User

from example_project.payments import provider
from example_project.payments.models import Charge

CARDS = ("tok_visa", "tok_declined", "tok_timeout")
PROBLEM = "application/problem+json"
# What ``problem`` answers, for the published schemas (RFC 9457 problem details).
PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
    },
    "required": ["type", "title", "status"],
}
# A charge, as ``Charge.as_json`` writes it (201, and each of the list's results), and the
# account's charges (``GET``), for the published schemas.
CHARGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^ch_[1-9][0-9]*$"},
        "amount": {"type": "integer", "minimum": 1},
        "currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "status": {"type": "string", "enum": ["succeeded"]},
    },
    "required": ["id", "amount", "currency", "status"],
}
CHARGES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "count": {"type": "integer", "minimum": 0},
        "results": {"type": "array", "items": CHARGE_SCHEMA},
    },
    "required": ["count", "results"],
}
# A charge to send, as the published schemas' example (Schemathesis sends it too).
CHARGE_EXAMPLE = {"amount": 1000, "currency": "EUR", "card": "tok_visa"}
UNAUTHORIZED = "Authentication required (HTTP Basic)."
# The answers of the charging endpoints that are the example's own (the idempotency app
# documents its own), as each is sent: a declined card, a provider timeout, and the
# refusals before the charge (no credentials, a body that is not JSON).
PROBLEM_ANSWERS = {
    401: UNAUTHORIZED,
    402: "The card was declined (stored: a retry is declined too).",
    415: "The body is not application/json (stored, like any definitive answer).",
    504: "The card provider did not answer in time: not stored, retry with the same key.",
}
# The largest amount every supported database stores in ``Charge.amount`` (a
# PositiveIntegerField: PostgreSQL's integer; MariaDB's unsigned integer and SQLite go
# higher). Checked here, so that a larger one is a 400 and not a database error (a 500).
MAX_AMOUNT = 2_147_483_647
# ``ch_<pk>``, as ``Charge.public_id`` writes it, with a pk that fits a BigAutoField: any
# other id names no charge (a 404, never a database error).
PUBLIC_ID = re.compile(r"ch_([1-9][0-9]{0,18})")
MAX_PK = 2**63 - 1


@dataclass(frozen=True)
class Outcome:
    status: int
    data: dict[str, Any]
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


def problem(status: int, slug: str, title: str, **extra: Any) -> Outcome:
    body = {"type": f"urn:example-payments:{slug}", "title": title, "status": status, **extra}
    return Outcome(status, body, PROBLEM)


def invalid_json(detail: str) -> Outcome:
    """A body that ``jsonbody.loads`` refused: 400, and why."""
    return problem(400, "invalid-json", "Invalid JSON", detail=detail)


def unsupported_media_type() -> Outcome:
    """A body that is not ``application/json`` (a form, multipart, text, none at all): 415."""
    return problem(
        415,
        "unsupported-media-type",
        "Unsupported Media Type",
        detail="Send the charge as application/json.",
    )


def validate(data: Any) -> tuple[dict[str, Any], Outcome | None]:
    """The charge in ``data`` (a request body parsed by ``jsonbody.loads``), or a 400."""
    if not isinstance(data, dict):
        return {}, problem(
            400, "invalid-charge", "Invalid charge", errors={"body": "must be a JSON object"}
        )
    errors = {}
    amount = _amount(data.get("amount"))
    if amount is None:
        errors["amount"] = (
            f"must be a whole number from 1 to {MAX_AMOUNT} (in the currency's minor unit)"
        )
    currency = data.get("currency")
    if not isinstance(currency, str) or not re.fullmatch(r"[A-Za-z]{3}", currency):
        errors["currency"] = "must be 3 letters"
    card = data.get("card")
    if not isinstance(card, str) or card not in CARDS:
        errors["card"] = f"must be one of {', '.join(CARDS)}"
    if errors or amount is None or not isinstance(currency, str):
        return {}, problem(400, "invalid-charge", "Invalid charge", errors=errors)
    return {"amount": amount, "currency": currency.upper(), "card": card}, None


def _amount(value: object) -> int | None:
    """``value`` as an amount: a JSON number with no fractional part (``1000``, ``1000.0`` and
    ``1e3`` are one amount, as they are one number in the idempotency fingerprint) within
    the column's range. A bool, a string, ``null``, a fraction or a number out of range is
    not an amount."""
    if isinstance(value, bool) or not isinstance(value, (int, Decimal)):
        return None
    number = Decimal(value)
    if not number.is_finite() or not 1 <= number <= MAX_AMOUNT:
        return None
    if number != number.to_integral_value():
        return None
    return int(number)


def _declined_or_timeout(error: Exception) -> Outcome:
    if isinstance(error, provider.CardDeclined):
        return problem(402, "card-declined", "Your card was declined")
    return problem(504, "provider-timeout", "The card provider did not answer in time")


def _created(charge: Charge) -> Outcome:
    return Outcome(201, charge.as_json(), headers={"Location": f"/charges/{charge.public_id}"})


def charge(account: User, body: Any, idempotency_key: str | None = None) -> Outcome:
    """Charge the card in ``body`` (the parsed request body) once; ``idempotency_key`` is
    the provider's (``downstream_key_for``): a run of the view after a lapsed lease sends
    the same one, and a provider that deduplicates charges once."""
    data, invalid = validate(body)
    if invalid is not None:
        return invalid
    try:
        provider.charge(data["card"], data["amount"], data["currency"], idempotency_key)
    except (provider.CardDeclined, provider.ProviderTimeout) as error:
        return _declined_or_timeout(error)
    return _created(Charge.objects.create(account=account, **data))


async def acharge(account: User, body: Any, idempotency_key: str | None = None) -> Outcome:
    data, invalid = validate(body)
    if invalid is not None:
        return invalid
    try:
        await provider.acharge(data["card"], data["amount"], data["currency"], idempotency_key)
    except (provider.CardDeclined, provider.ProviderTimeout) as error:
        return _declined_or_timeout(error)
    return _created(await Charge.objects.acreate(account=account, **data))


def charge_of(account: User, public_id: str) -> Outcome:
    """The charge ``public_id`` (``ch_<n>``, as in ``Location``) of ``account``, or a 404: an
    unknown id and another account's charge are the same answer."""
    match = PUBLIC_ID.fullmatch(public_id)
    found = None
    if match is not None and int(match[1]) <= MAX_PK:
        found = Charge.objects.filter(account=account, pk=int(match[1])).first()
    if found is None:
        return problem(404, "not-found", "Not Found", detail=f"No charge {public_id!r}.")
    return Outcome(200, found.as_json())


def charges_of(account: User) -> dict[str, Any]:
    results = [c.as_json() for c in Charge.objects.filter(account=account).order_by("pk")]
    return {"count": len(results), "results": results}
