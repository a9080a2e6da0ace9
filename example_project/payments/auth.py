"""HTTP Basic authentication for the example API (no sessions, no CSRF: not a browser API)."""

from __future__ import annotations

import base64
import binascii
import functools
import json
from collections.abc import Callable, Coroutine
from typing import Any

from django.contrib.auth import aauthenticate, authenticate
from django.http import HttpRequest, HttpResponse, HttpResponseBase

from example_project.payments import service


def _unauthorized() -> HttpResponse:
    outcome = service.problem(401, "unauthorized", "Authentication required")
    response = HttpResponse(json.dumps(outcome.data), status=401, content_type=outcome.content_type)
    response["WWW-Authenticate"] = 'Basic realm="payments"'
    return response


def _credentials(request: HttpRequest) -> tuple[str, str] | None:
    scheme, _, encoded = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        username, _, password = base64.b64decode(encoded).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return username, password


def basic_auth_required(view: Callable[..., HttpResponseBase]) -> Callable[..., HttpResponseBase]:
    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        credentials = _credentials(request)
        user = credentials and authenticate(
            request, username=credentials[0], password=credentials[1]
        )
        if not user:
            return _unauthorized()
        request.user = user
        return view(request, *args, **kwargs)

    return wrapper


def abasic_auth_required(
    view: Callable[..., Coroutine[Any, Any, HttpResponseBase]],
) -> Callable[..., Coroutine[Any, Any, HttpResponseBase]]:
    @functools.wraps(view)
    async def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        credentials = _credentials(request)
        user = credentials and await aauthenticate(
            request, username=credentials[0], password=credentials[1]
        )
        if not user:
            return _unauthorized()
        request.user = user
        return await view(request, *args, **kwargs)

    return wrapper
