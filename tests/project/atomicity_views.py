"""Views for the tests of issue-9 scenarios: DRF under transactions, commit-time failures."""

from __future__ import annotations

import json
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from idempotency_django.decorators import idempotent
from idempotency_django.drf import IdempotentMixin
from tests.models import DeferredChild, SideEffect


class AmountSerializer(serializers.Serializer[Any]):
    amount = serializers.IntegerField(min_value=1)


class AtomicChargeView(IdempotentMixin, APIView):
    """A DRF view in atomic mode: claim, work and completion in one transaction."""

    idempotency_mode = "atomic"

    def post(self, request: Request) -> Response:
        serializer = AmountSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        effect = SideEffect.objects.create(label="drf-atomic")
        return Response({"effect": effect.pk}, status=201)


class WritesThenFailsView(IdempotentMixin, APIView):
    """Writes, then fails validation: DRF's handler asks for the work to be rolled back."""

    def post(self, request: Request) -> Response:
        SideEffect.objects.create(label="drf-partial")
        AmountSerializer(data=request.data).is_valid(raise_exception=True)
        effect = SideEffect.objects.create(label="drf-partial")
        return Response({"effect": effect.pk}, status=201)


@idempotent
def orphan(request: HttpRequest) -> HttpResponse:
    """Writes a row whose foreign key PostgreSQL checks only at COMMIT (Django creates foreign
    keys DEFERRABLE INITIALLY DEFERRED there): with ``{"parent": <missing>}`` the view
    returns 201 and then its transaction fails to commit."""
    data = json.loads(request.body or b"{}")
    effect = SideEffect.objects.create(label="orphan")
    DeferredChild.objects.create(parent_id=data.get("parent", effect.pk))
    return JsonResponse({"effect": effect.pk}, status=201)


@idempotent
def orphan_in_store(request: HttpRequest) -> HttpResponse:
    """Writes its effect in ``default`` and, with ``{"parent": <missing>}``, a row in the
    store's own database whose foreign key fails that database's COMMIT (PostgreSQL): the
    work's transaction commits, then the store's fails."""
    data = json.loads(request.body or b"{}")
    effect = SideEffect.objects.create(label="orphan_in_store")
    if "parent" in data:
        DeferredChild.objects.using("store").create(parent_id=data["parent"])
    return JsonResponse({"effect": effect.pk}, status=201)
