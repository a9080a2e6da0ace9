"""The example API through Django REST framework: ``/api/charges/``, the same contract."""

from __future__ import annotations

from django.contrib.auth.models import User
from rest_framework import viewsets
from rest_framework.authentication import BasicAuthentication
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response

from example_project.payments import service
from idempotency_django.drf import IdempotentMixin


class ChargeViewSet(IdempotentMixin, viewsets.ViewSet):
    authentication_classes = [BasicAuthentication]
    permission_classes = [IsAuthenticated]
    idempotency_actions = {"create"}

    def list(self, request: Request) -> Response:
        assert isinstance(request.user, User)
        return Response(service.charges_of(request.user))

    def create(self, request: Request) -> Response:
        assert isinstance(request.user, User)
        outcome = service.charge(request.user, request.body)
        return Response(
            outcome.data,
            status=outcome.status,
            content_type=outcome.content_type,
            headers=outcome.headers,
        )
