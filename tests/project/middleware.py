from __future__ import annotations

from collections.abc import Callable

from django.contrib.auth.models import AnonymousUser, User
from django.http import HttpRequest, HttpResponseBase


class HeaderUserMiddleware:
    """Authenticate tests cheaply: ``X-User: <username>`` (no sessions, no password hashing)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        username = request.headers.get("X-User")
        user = User.objects.filter(username=username).first() if username else None
        request.user = user or AnonymousUser()
        return self.get_response(request)
