"""The example API through django-ninja: ``/ninja/charges/``, the same contract as
``/charges/``.

The same service (``service.charge``), the same HTTP Basic authentication (``auth.py``'s
parsing, through ninja's auth so that ``request.auth`` is the user the key belongs to), the
same JSON reading (``jsonbody.loads``: a 400 ``invalid-json``, a 415 for another media type)
and every error ``application/problem+json``: ninja's own (401, 405, 422 for a bad path
parameter) through this module's handlers. ninja's schema is served at
``/ninja/openapi.json``, with the Idempotency-Key contract on the POST.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from django.contrib.auth import authenticate
from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.security import HttpBasicAuth

from example_project.payments import jsonbody, service
from example_project.payments.auth import _credentials
from idempotency_django.ninja import idempotent


class BasicAuth(HttpBasicAuth):
    """HTTP Basic, parsed as the plain views parse it; ninja sets ``request.auth``."""

    def __call__(self, request: HttpRequest) -> User | None:
        credentials = _credentials(request)
        if credentials is None:
            return None
        return self.authenticate(request, *credentials)

    def authenticate(self, request: HttpRequest, username: str, password: str) -> User | None:
        user = authenticate(request, username=username, password=password)
        return user if isinstance(user, User) else None


api = NinjaAPI(
    title="Payments (django-ninja)",
    version="1",
    urls_namespace="payments-ninja",
    auth=BasicAuth(),
    docs_url=None,
)


def _user(request: HttpRequest) -> User:
    user = getattr(request, "auth", None)  # set by ninja's auth
    assert isinstance(user, User)  # BasicAuth answered 401 otherwise
    return user


def _response(outcome: service.Outcome) -> HttpResponse:
    response = HttpResponse(
        json.dumps(outcome.data), status=outcome.status, content_type=outcome.content_type
    )
    for name, value in outcome.headers.items():
        response[name] = value
    return response


def _problem(status: int, **extra: Any) -> HttpResponse:
    title = HTTPStatus(status).phrase
    return _response(service.problem(status, title.lower().replace(" ", "-"), title, **extra))


@api.exception_handler(AuthenticationError)
def unauthorized(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    response = _response(service.problem(401, "unauthorized", "Authentication required"))
    response["WWW-Authenticate"] = 'Basic realm="payments"'
    return response


@api.exception_handler(ValidationError)
def invalid(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    return _problem(422, errors=json.loads(json.dumps(exc.errors, default=str)))


@api.exception_handler(HttpError)
def http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    return _problem(exc.status_code, detail=str(exc))


CHARGE_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["amount", "currency", "card"],
                    "properties": {
                        "amount": {
                            "type": "integer",
                            "minimum": 1,
                            "maximum": service.MAX_AMOUNT,
                            "description": "In the currency's minor unit.",
                        },
                        "currency": {"type": "string", "pattern": "^[A-Za-z]{3}$"},
                        "card": {"type": "string", "enum": list(service.CARDS)},
                    },
                },
                "example": service.CHARGE_EXAMPLE,
            }
        },
    },
    "responses": {
        201: {
            "description": "Charged; Location names the charge.",
            "content": {"application/json": {"schema": service.CHARGE_SCHEMA}},
        },
        **{
            status: {
                "description": text,
                "content": {service.PROBLEM: {"schema": service.PROBLEM_SCHEMA}},
            }
            for status, text in service.PROBLEM_ANSWERS.items()
        },
    },
}


LIST = {
    "responses": {
        200: {
            "description": "The account's charges.",
            "content": {"application/json": {"schema": service.CHARGES_SCHEMA}},
        },
        401: {
            "description": service.UNAUTHORIZED,
            "content": {service.PROBLEM: {"schema": service.PROBLEM_SCHEMA}},
        },
    },
}


@api.get(
    "/charges/",
    summary="The account's charges",
    response={200: None, 401: None},
    openapi_extra=LIST,
)
def charges(request: HttpRequest) -> HttpResponse:
    return _response(service.Outcome(200, service.charges_of(_user(request))))


# ``response`` names the statuses the view sends (else ninja documents a 200 it never
# sends); their content is in CHARGE_BODY, as the view builds its responses itself.
@api.post(
    "/charges/",
    summary="Charge a card, once per Idempotency-Key",
    response={201: None, 402: None},
    openapi_extra=CHARGE_BODY,
)
@idempotent
def charge(request: HttpRequest) -> HttpResponse:
    """The body is read as the plain view reads it (not as a ninja ``Schema``), so a bad one
    is the same 400 or 415 problem, stored under its key like any definitive answer."""
    if request.content_type != "application/json":
        return _response(service.unsupported_media_type())
    try:
        body = jsonbody.loads(request.body)
    except jsonbody.InvalidJSON as error:
        return _response(service.invalid_json(str(error)))
    return _response(service.charge(_user(request), body))


@api.api_operation(
    ["PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "TRACE"],
    "/charges/",
    auth=None,
    include_in_schema=False,
)
def not_allowed(request: HttpRequest) -> HttpResponse:
    """Other methods: a 405 problem (ninja's own 405 is plain text), before authentication
    and before any claim, as on ``/charges/``."""
    response = _problem(405, detail=f"{request.method} is not allowed here.")
    response["Allow"] = "GET, POST"
    return response
