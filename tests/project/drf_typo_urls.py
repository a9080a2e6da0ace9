"""A URLconf with DRF views whose idempotency configuration names nothing, for system
check E018 (and one configured right, which passes)."""

from __future__ import annotations

from typing import Any

from django.urls import include, path
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.routers import SimpleRouter
from rest_framework.viewsets import ViewSet

from idempotency_django.drf import IdempotentMixin


class PlainChargeViewSet(ViewSet):
    """No mixin (``IdempotencyMiddleware`` would add it): nothing refused it at creation."""

    idempotency_actions = {"craete"}
    idempotency_mod = "atomic"

    def create(self, request: Any) -> Response:
        return Response(status=201)


class RefundViewSet(IdempotentMixin, ViewSet):
    idempotency_actions = {"create", "refnud"}

    def create(self, request: Any) -> Response:
        return Response(status=201)

    @action(detail=True, methods=["post"])
    def refund(self, request: Any, pk: str) -> Response:
        return Response(status=201)


class RightViewSet(IdempotentMixin, ViewSet):
    idempotency_actions = {"create", "refund", "cancel_refund"}

    def create(self, request: Any) -> Response:
        return Response(status=201)

    @action(detail=True, methods=["post"])
    def refund(self, request: Any, pk: str) -> Response:
        return Response(status=201)

    @refund.mapping.delete
    def cancel_refund(self, request: Any, pk: str) -> Response:
        return Response(status=204)


router = SimpleRouter()
router.register("plain", PlainChargeViewSet, basename="plain")
router.register("refunds", RefundViewSet, basename="refunds")
router.register("right", RightViewSet, basename="right")
urlpatterns = [path("", include(router.urls))]
