"""HTTP Basic authentication for the example API (no sessions, no CSRF: not a browser API)."""

from __future__ import annotations

import base64
import binascii
import functools
from collections.abc import Callable
from typing import Any

from django.contrib.auth import authenticate
from django.http import HttpRequest, HttpResponseBase

from example_project.payments.problems import problem


def basic_auth_required(view: Callable[..., HttpResponseBase]) -> Callable[..., HttpResponseBase]:
    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        user = _authenticate(request)
        if user is None:
            response = problem(401, "unauthorized", "Authentication required")
            response["WWW-Authenticate"] = 'Basic realm="payments"'
            return response
        request.user = user
        return view(request, *args, **kwargs)

    return wrapper


def _authenticate(request: HttpRequest) -> Any:
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        username, _, password = base64.b64decode(credentials).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return authenticate(request, username=username, password=password)
