"""DRF views the tests protect; each execution writes a ``SideEffect`` row."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import APIException
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import UserRateThrottle
from rest_framework.views import APIView

from idempotency_django.drf import IdempotentMixin
from tests.models import SideEffect
from tests.project.views import gate


class ChargeSerializer(serializers.Serializer[Any]):
    amount = serializers.IntegerField(min_value=1)
    note = serializers.CharField(required=False)


class CsvRenderer(BaseRenderer):
    media_type = "text/csv"
    format = "csv"

    def render(
        self, data: Any, accepted_media_type: Any = None, renderer_context: Any = None
    ) -> bytes:
        return ",".join(f"{k}={v}" for k, v in sorted(data.items())).encode()


class Unavailable(APIException):
    status_code = 503
    default_detail = "Provider unavailable."


class ChargeViewSet(IdempotentMixin, viewsets.ViewSet):
    idempotency_actions = {"create", "refund"}
    renderer_classes = [JSONRenderer, CsvRenderer]

    def create(self, request: Request) -> Response:
        serializer = ChargeSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        if request.data.get("gate"):
            gate.pass_through()
        if request.data.get("unavailable"):
            SideEffect.objects.create(label="drf")
            raise Unavailable
        if request.data.get("crash"):
            SideEffect.objects.create(label="drf")
            raise RuntimeError("the view failed")
        effect = SideEffect.objects.create(label="drf")
        response = Response({"effect": effect.pk, "amount": serializer.data["amount"]}, status=201)
        response["Location"] = f"/api/charges/{effect.pk}/"
        return response

    def list(self, request: Request) -> Response:
        return Response({"count": SideEffect.objects.filter(label="drf").count()})

    @action(detail=False, methods=["post"])
    def refund(self, request: Request) -> Response:
        effect = SideEffect.objects.create(label="drf-refund")
        return Response({"effect": effect.pk}, status=201)

    @action(detail=False, methods=["post"])
    def note(self, request: Request) -> Response:
        effect = SideEffect.objects.create(label="drf-note")
        return Response({"effect": effect.pk}, status=201)


class OneRequestPerMinute(UserRateThrottle):
    rate = "1/min"


class ThrottledView(IdempotentMixin, APIView):
    throttle_classes = [OneRequestPerMinute]

    def post(self, request: Request) -> Response:
        effect = SideEffect.objects.create(label="drf-throttled")
        return Response({"effect": effect.pk}, status=status.HTTP_201_CREATED)


class TenantView(IdempotentMixin, APIView):
    """Keys scoped by a tenant header instead of the user: one hook overridden."""

    idempotency_in_flight = "wait"

    def get_idempotency_account(self, request: Request) -> str | None:
        return request.headers.get("X-Tenant")

    def post(self, request: Request) -> Response:
        effect = SideEffect.objects.create(label="drf-tenant")
        return Response({"effect": effect.pk}, status=201)


def custom_exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    from rest_framework.views import exception_handler

    response = exception_handler(exc, context)
    if response is not None:
        code = exc.get_codes() if isinstance(exc, APIException) else "error"
        response.data = {"error": {"code": code, "body": response.data}}
    return response
