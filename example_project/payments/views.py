"""The plain and async front doors of the example API, and the project's error pages.

Every error the example answers is ``application/problem+json`` (RFC 9457): the views'
own, a method they don't take (405), and what Django answers for them before a view runs or
when one fails (``handler400`` and ``handler500`` in ``urls.py``: a multipart body Django
cannot parse, too many form fields, a view that raised).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from http import HTTPStatus
from inspect import iscoroutinefunction
from typing import Any, TypeVar, cast

from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from example_project.payments import jsonbody, service
from example_project.payments.auth import abasic_auth_required, basic_auth_required
from idempotency_django.decorators import idempotent
from idempotency_django.downstream import downstream_key_for

View = TypeVar("View", bound=Callable[..., Any])


def _response(outcome: service.Outcome) -> HttpResponse:
    response = HttpResponse(
        json.dumps(outcome.data), status=outcome.status, content_type=outcome.content_type
    )
    for name, value in outcome.headers.items():
        response[name] = value
    return response


def _problem(status: int, detail: str) -> HttpResponse:
    """A problem whose type is named after its HTTP status (``not-found``, …)."""
    title = HTTPStatus(status).phrase
    slug = title.lower().replace(" ", "-")
    return _response(service.problem(status, slug, title, detail=detail))


def allow_methods(*methods: str) -> Callable[[View], View]:
    """``require_http_methods``, answering other methods with a 405 problem (and ``Allow``),
    for sync and async views. Outermost, so that a method the view doesn't take is a 405
    before authentication and before ``@idempotent`` asks for a key."""

    def refuse(request: HttpRequest) -> HttpResponse:
        response = _problem(405, f"{request.method} is not allowed here.")
        response["Allow"] = ", ".join(methods)
        return response

    def decorator(view: View) -> View:
        if iscoroutinefunction(view):

            @functools.wraps(view)
            async def async_wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
                if request.method not in methods:
                    return refuse(request)
                return await view(request, *args, **kwargs)

            return cast(View, async_wrapper)

        @functools.wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            if request.method not in methods:
                return refuse(request)
            return view(request, *args, **kwargs)

        return cast(View, wrapper)

    return decorator


def _charge_body(request: HttpRequest) -> tuple[Any, service.Outcome | None]:
    """The parsed JSON body, or the problem to answer instead.

    The media type is checked first: for a form or multipart body, ``@idempotent`` has
    already parsed ``request.POST`` (to fingerprint it), and ``request.body`` would raise.
    """
    if request.content_type != "application/json":
        return None, service.unsupported_media_type()
    try:
        return jsonbody.loads(request.body), None
    except jsonbody.InvalidJSON as error:
        return None, service.invalid_json(str(error))


def _provider_key(request: HttpRequest) -> str:
    """The card provider's idempotency key for this request's charge: derived from its
    Idempotency-Key and scope, the same on every run of the view for that key (a retry
    after a 5xx, a run after a lapsed lease), so a provider that deduplicates charges once
    (docs/client.md, docs/reliability.md)."""
    return downstream_key_for(request, "card-charge")


@csrf_exempt
@allow_methods("GET", "POST")
@basic_auth_required
@idempotent
def charges(request: HttpRequest) -> HttpResponse:
    """``GET``: the account's charges. ``POST``: charge a card, once per Idempotency-Key."""
    account = request.user
    assert isinstance(account, User)  # basic_auth_required answered 401 otherwise
    if request.method == "GET":
        return JsonResponse(service.charges_of(account))
    body, invalid = _charge_body(request)
    return _response(invalid or service.charge(account, body, _provider_key(request)))


@csrf_exempt
@allow_methods("GET", "POST")
@abasic_auth_required
@idempotent
async def async_charges(request: HttpRequest) -> HttpResponse:
    """The same contract as ``charges``, as an async view (serve it with an ASGI server)."""
    account = request.user
    assert isinstance(account, User)
    if request.method == "GET":
        return JsonResponse(await _acharges_of(account))
    body, invalid = _charge_body(request)
    return _response(invalid or await service.acharge(account, body, _provider_key(request)))


@csrf_exempt
@allow_methods("GET")
@basic_auth_required
def charge_detail(request: HttpRequest, charge_id: str) -> HttpResponse:
    """``GET``: one charge of the account, where ``Location`` points (``/charges/ch_<n>``);
    another account's charge is a 404, like an unknown id."""
    account = request.user
    assert isinstance(account, User)
    return _response(service.charge_of(account, charge_id))


async def _acharges_of(account: User) -> dict[str, object]:
    from asgiref.sync import sync_to_async

    return await sync_to_async(service.charges_of)(account)


# -- the project's error pages (urls.py), used when DEBUG is off --------------------------------


def bad_request(request: HttpRequest, exception: Exception) -> HttpResponseBase:
    return _problem(400, "The request could not be read (a malformed or oversized body).")


def server_error(request: HttpRequest) -> HttpResponseBase:
    return _problem(500, "The server failed to answer this request; retry it.")
