"""Views that the test kit (``idempotency_django.testing``) and the downstream-key helper are
tried against: protected and unprotected twins of a plain view and of DRF viewsets (one with
``IdempotentMixin``, one with an action wrapped in ``@idempotent``), and views protected
*wrongly*. Every run of a view body writes one ``SideEffect`` row (and calls
the fake ``provider``), so tests count runs the way a user counts charges."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from rest_framework import mixins, serializers, viewsets
from rest_framework.authentication import BaseAuthentication
from rest_framework.parsers import JSONParser
from rest_framework.permissions import IsAuthenticated
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from idempotency_django.decorators import idempotent
from idempotency_django.downstream import downstream_key_for
from idempotency_django.drf import IdempotentMixin
from tests.models import SideEffect


class ProviderUnavailable(Exception):
    """The provider could not be reached: the view answers 503 (the key is released)."""


@dataclass
class FakeProvider:
    """A card provider that records the idempotency keys it was called with."""

    calls: list[tuple[int, str | None]] = field(default_factory=list)

    def charge(self, amount: int, idempotency_key: str | None = None) -> None:
        self.calls.append((amount, idempotency_key))


provider = FakeProvider()


def _amount(request: HttpRequest) -> int:
    try:
        data = json.loads(request.body or b"{}")
    except ValueError:
        data = {}
    return int(data.get("amount", 0)) if isinstance(data, dict) else 0


def _charge(request: HttpRequest, label: str) -> HttpResponse:
    amount = _amount(request)
    try:
        provider.charge(amount)
    except ProviderUnavailable:
        return JsonResponse({"error": "provider unavailable"}, status=503)
    effect = SideEffect.objects.create(label=label)
    return JsonResponse({"id": effect.pk, "amount": amount}, status=201)


# --- plain views -----------------------------------------------------------------------------


@idempotent
def charge(request: HttpRequest) -> HttpResponse:
    return _charge(request, "kit")


def unprotected_charge(request: HttpRequest) -> HttpResponse:
    return _charge(request, "kit")


@idempotent(store_statuses=lambda status: True)
def stores_failures(request: HttpRequest) -> HttpResponse:
    """Wrong: a 503 is stored, so the key can never succeed."""
    return _charge(request, "kit")


def _constant(request: HttpRequest) -> bytes:
    return b""


@idempotent(fingerprint=_constant)
def ignores_body(request: HttpRequest) -> HttpResponse:
    """Wrong: the fingerprint ignores the body, so a changed body is replayed, not a 422."""
    return _charge(request, "kit")


seen_keys: set[str] = set()


def naive_dedupe(request: HttpRequest) -> HttpResponse:
    """Wrong: a duplicate key is answered "duplicate" instead of the first response."""
    key = request.headers.get("Idempotency-Key", "")
    if key in seen_keys:
        response = JsonResponse({"duplicate": True}, status=200)
        response["Idempotent-Replayed"] = "true"
        return response
    seen_keys.add(key)
    return _charge(request, "kit")


def validating(request: HttpRequest) -> HttpResponse:
    """Unprotected, with a validation of its own that answers 422 for large amounts."""
    if _amount(request) > 1000:
        body = {"type": "urn:kit:too-large", "title": "Too large", "status": 422}
        return HttpResponse(json.dumps(body), status=422, content_type="application/problem+json")
    return _charge(request, "kit")


@idempotent
def downstream(request: HttpRequest) -> HttpResponse:
    """Passes the provider a key derived from the incoming one, stable across retries."""
    amount = _amount(request)
    try:
        provider.charge(amount, idempotency_key=downstream_key_for(request, "provider-charge"))
    except ProviderUnavailable:
        return JsonResponse({"error": "provider unavailable"}, status=503)
    effect = SideEffect.objects.create(label="kit")
    return JsonResponse({"id": effect.pk, "amount": amount}, status=201)


# --- DRF viewsets ----------------------------------------------------------------------------

Action = Callable[..., HttpResponseBase]


def protect_action(**options: Any) -> Callable[[Action], Action]:
    """Protect one viewset action with ``@idempotent``, after DRF's authentication.

    What a project that cannot use ``IdempotentMixin`` might write (the kit must work for
    it too): the key is claimed inside the action, so that the account is DRF's
    authenticated user; DRF's exceptions become responses (a validation
    error is a stored 400, not a released key) and the response is rendered, so that
    ``@idempotent`` can store its bytes.
    """

    def decorator(action: Action) -> Action:
        def run(request: Request, view: viewsets.GenericViewSet, *args: Any, **kwargs: Any) -> Any:
            try:
                response = action(view, request, *args, **kwargs)
            except Exception as exc:
                response = view.handle_exception(exc)
            response = view.finalize_response(request, response, *args, **kwargs)
            return response.render() if isinstance(response, Response) else response

        protected = idempotent(**options)(run)

        @functools.wraps(action)
        def wrapper(
            self: viewsets.GenericViewSet, request: Request, *args: Any, **kwargs: Any
        ) -> Any:
            return protected(request, self, *args, **kwargs)

        return wrapper

    return decorator


class HeaderUserAuthentication(BaseAuthentication):
    """DRF authentication by an ``X-User: <username>`` header (tests only)."""

    def authenticate(self, request: Request) -> tuple[User, None] | None:
        username = request.META.get("HTTP_X_USER")
        user = User.objects.filter(username=username).first() if username else None
        return (user, None) if user is not None else None


class ChargeSerializer(serializers.Serializer[dict[str, Any]]):
    amount = serializers.IntegerField(min_value=1)
    currency = serializers.CharField(max_length=3, default="EUR")

    def create(self, validated_data: dict[str, Any]) -> dict[str, Any]:
        provider.charge(validated_data["amount"])
        effect = SideEffect.objects.create(label="kit-drf")
        return {"id": effect.pk, **validated_data}

    def to_representation(self, instance: dict[str, Any]) -> dict[str, Any]:
        return dict(instance)


class ChargeViewSet(mixins.CreateModelMixin, viewsets.GenericViewSet):  # type: ignore[type-arg]
    serializer_class = ChargeSerializer
    authentication_classes = [HeaderUserAuthentication]
    permission_classes = [IsAuthenticated]
    renderer_classes = [JSONRenderer]
    parser_classes = [JSONParser]

    @protect_action()
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        try:
            return super().create(request, *args, **kwargs)
        except ProviderUnavailable:
            return Response({"error": "provider unavailable"}, status=503)


class MixinChargeViewSet(IdempotentMixin, ChargeViewSet):
    """The same viewset protected by the package's DRF mixin instead."""

    idempotency_actions = {"create"}

    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        try:
            return mixins.CreateModelMixin.create(self, request, *args, **kwargs)
        except ProviderUnavailable:
            return Response({"error": "provider unavailable"}, status=503)


class UnprotectedChargeViewSet(ChargeViewSet):
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        try:
            return mixins.CreateModelMixin.create(self, request, *args, **kwargs)
        except ProviderUnavailable:
            return Response({"error": "provider unavailable"}, status=503)
