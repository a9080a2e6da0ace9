"""Views for tests/test_scopes.py: who shares a key's scope (principals that are not users,
tenants, guests). Each execution writes a ``SideEffect`` row, so tests count runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse, JsonResponse
from rest_framework.authentication import BaseAuthentication
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from idempotency_django.decorators import idempotent
from idempotency_django.downstream import downstream_key_for
from idempotency_django.drf import IdempotentMixin
from tests.models import SideEffect


@dataclass(frozen=True)
class Merchant:
    """A principal that is not the user model, as a DRF authentication class may return:
    merchant 7 and user 7 are two callers."""

    pk: int
    is_authenticated: bool = True


class MerchantOrUserAuthentication(BaseAuthentication):
    """``X-Merchant: <pk>`` authenticates a merchant; ``X-User: <username>`` a user."""

    def authenticate(self, request: Request) -> tuple[Any, None] | None:
        merchant = request.headers.get("X-Merchant")
        if merchant is not None:
            return Merchant(int(merchant)), None
        username = request.headers.get("X-User")
        user = User.objects.filter(username=username).first() if username else None
        return (user, None) if user is not None else None


class RefundView(IdempotentMixin, APIView):
    authentication_classes = [MerchantOrUserAuthentication]

    def post(self, request: Request) -> Response:
        effect = SideEffect.objects.create(label="refund")
        return Response({"effect": effect.pk, "by": type(request.user).__name__}, status=201)


@idempotent
def payment(request: HttpRequest) -> HttpResponse:
    """A payment in whichever tenant the request is in (its host, or its X-Org header)."""
    effect = SideEffect.objects.create(label="payment")
    return JsonResponse({"effect": effect.pk, "host": request.get_host()}, status=201)


@idempotent
def guest_checkout(request: HttpRequest) -> HttpResponse:
    """Serves guests (ANONYMOUS="bypass") and passes the provider a downstream key."""
    effect = SideEffect.objects.create(label="guest-checkout")
    token = request.headers.get("X-Guest-Token")
    if token is None:
        derived = downstream_key_for(request, "provider-charge")
    else:
        derived = downstream_key_for(request, "provider-charge", account=f"guest:{token}")
    return JsonResponse({"effect": effect.pk, "downstream_key": derived}, status=201)
