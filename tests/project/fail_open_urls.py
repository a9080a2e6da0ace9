"""A URLconf whose views fail open on their own (``on_store_error="open"``), next to one
that keeps the default, for system check W031."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.urls import path
from rest_framework.response import Response
from rest_framework.views import APIView

from idempotency_django.decorators import idempotent
from idempotency_django.drf import IdempotentMixin


@idempotent(on_store_error="open")
def opens(request: HttpRequest) -> HttpResponse:
    return HttpResponse(status=201)


@idempotent
def closed(request: HttpRequest) -> HttpResponse:
    return HttpResponse(status=201)


class OpenView(IdempotentMixin, APIView):
    idempotency_on_store_error = "open"

    def post(self, request: Any) -> Response:
        return Response(status=201)


urlpatterns = [
    path("opens/", opens),
    path("opens-again/", opens),
    path("closed/", closed),
    path("drf-opens/", OpenView.as_view()),
]
