"""The example API through Django REST framework: ``/api/charges/``, the same contract.

``settings.REST_FRAMEWORK`` makes ``parsers.JSONParser`` (which reads JSON like the plain
views do) the only parser, JSON the only renderer, and ``problem_exception_handler`` (below)
the exception handler, so every error of this endpoint is ``application/problem+json`` like
the plain views' ones.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from django.contrib.auth.models import User
from django.http import HttpResponseBase
from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiResponse,
    extend_schema,
    extend_schema_serializer,
)
from rest_framework import exceptions, serializers, viewsets
from rest_framework.authentication import BasicAuthentication
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import exception_handler

from example_project.payments import service
from idempotency_django.drf import IdempotencyAPIException, IdempotentMixin
from idempotency_django.responses import problem_response


def problem_exception_handler(exc: Exception, context: dict[str, Any]) -> HttpResponseBase | None:
    """DRF's exception handler, answering ``application/problem+json``.

    The idempotency app's own errors (``IdempotencyAPIException``: key missing, in flight,
    mismatch, …) keep the app's problem types, the same as ``@idempotent`` answers them.
    DRF's errors get the example's, named after the status (``unsupported-media-type``,
    ``method-not-allowed``, …; a JSON parse error is ``invalid-json``, as on the plain
    views), with DRF's message as the detail and DRF's headers (``WWW-Authenticate``,
    ``Allow``, ``Retry-After``) kept.
    """
    if isinstance(exc, IdempotencyAPIException):
        return problem_response(exc.error)
    response = exception_handler(exc, context)
    if response is None:
        return None  # not an API error: DRF re-raises it (a 500, which releases the key)
    detail = response.data.get("detail") if isinstance(response.data, dict) else None
    if isinstance(exc, exceptions.ParseError):
        outcome = service.invalid_json(str(detail))
    else:
        title = HTTPStatus(response.status_code).phrase
        slug = title.lower().replace(" ", "-")
        extra = {"detail": str(detail)} if detail is not None else {"errors": response.data}
        outcome = service.problem(response.status_code, slug, title, **extra)
    response.data = outcome.data
    response.content_type = outcome.content_type
    return response


class ChargeIn(serializers.Serializer[Any]):
    """A charge, as ``service.validate`` reads it: published in the schema (the view itself
    validates with the service, as the plain views do, so its 400s are the same)."""

    amount = serializers.IntegerField(
        min_value=1, max_value=service.MAX_AMOUNT, help_text="In the currency's minor unit."
    )
    currency = serializers.RegexField(r"^[A-Za-z]{3}$")
    card = serializers.ChoiceField(choices=service.CARDS)


class ChargeOut(serializers.Serializer[Any]):
    """A charge: its id (as in ``Location``), amount, currency and status."""

    id = serializers.RegexField(r"^ch_[1-9][0-9]*$")
    amount = serializers.IntegerField(min_value=1)
    currency = serializers.RegexField(r"^[A-Z]{3}$")
    status = serializers.ChoiceField(choices=["succeeded"])


@extend_schema_serializer(many=False)  # the list's one object, not an array of them
class ChargesOut(serializers.Serializer[Any]):
    """The account's charges, oldest first."""

    count = serializers.IntegerField(min_value=0)
    results = ChargeOut(many=True)


class ChargeViewSet(IdempotentMixin, viewsets.ViewSet):
    authentication_classes = [BasicAuthentication]
    permission_classes = [IsAuthenticated]
    idempotency_actions = {"create"}

    @extend_schema(
        responses={
            200: OpenApiResponse(ChargesOut, description="The account's charges."),
            (401, service.PROBLEM): OpenApiResponse(
                service.PROBLEM_SCHEMA, description=service.UNAUTHORIZED
            ),
        },
        summary="The account's charges",
    )
    def list(self, request: Request) -> Response:
        assert isinstance(request.user, User)
        return Response(service.charges_of(request.user))

    @extend_schema(
        request=ChargeIn,
        examples=[OpenApiExample("A charge", value=service.CHARGE_EXAMPLE, request_only=True)],
        responses={
            201: OpenApiResponse(ChargeOut, description="Charged; Location names the charge."),
            **{
                (status, service.PROBLEM): OpenApiResponse(service.PROBLEM_SCHEMA, description=text)
                for status, text in service.PROBLEM_ANSWERS.items()
            },
        },
        summary="Charge a card, once per Idempotency-Key",
    )
    def create(self, request: Request) -> Response:
        assert isinstance(request.user, User)
        # request.data: the body through JSONParser (another media type is a 415).
        outcome = service.charge(request.user, request.data)
        return Response(
            outcome.data,
            status=outcome.status,
            content_type=outcome.content_type,
            headers=outcome.headers,
        )
