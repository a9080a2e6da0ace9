"""A cheap authentication for benchmarks: the ``X-Bench-User`` header names the user.

The user is read from the database once per process and cached, so every scenario (the
bare view included) pays the same few microseconds for authentication, and nothing else.
Never use this outside a benchmark: it trusts a header.
"""

from __future__ import annotations

from collections.abc import Callable

from django.contrib.auth.models import AnonymousUser, User
from django.http import HttpRequest, HttpResponseBase

_users: dict[str, User | None] = {}


def _user(name: str) -> User | None:
    if name not in _users:
        _users[name] = User.objects.filter(username=name).first()
    return _users[name]


class BenchUserMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        name = request.headers.get("X-Bench-User")
        user = _user(name) if name else None
        request.user = user if user is not None else AnonymousUser()
        return self.get_response(request)
