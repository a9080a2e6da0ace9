"""A URLconf with a DRF view protected the unsupported way, for system check E011."""

from __future__ import annotations

from typing import Any

from django.urls import path
from django.utils.decorators import method_decorator
from rest_framework.response import Response
from rest_framework.views import APIView

from idempotency_django.decorators import idempotent


class DecoratedAction(APIView):
    @method_decorator(idempotent)
    def post(self, request: Any) -> Response:
        return Response(status=201)


urlpatterns = [path("decorated/", DecoratedAction.as_view())]
