"""The published contract in the generated documents: drf-spectacular's and django-ninja's
schemas document the key header (format, maximum length), the expiry policy (TTL), every
problem response the app can give, and the replay header. Both come from ``contract.py``;
these tests read what each generator produces."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from django.test import override_settings
from django.urls import path
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.openapi import AutoSchema

from tests.ninja_views import api as ninja_api

Generate = Callable[[], dict[str, Any]]


def spectacular() -> dict[str, Any]:
    schema = SchemaGenerator(urlconf="tests.drf_urls").get_schema(request=None, public=True)
    return json.loads(json.dumps(schema))  # type: ignore[no-any-return]


def ninja() -> dict[str, Any]:
    # What /openapi.json serves: JSON, where ninja's int status codes become strings.
    return json.loads(json.dumps(ninja_api.get_openapi_schema(path_prefix="/ninja/")))


PROTECTED = {spectacular: "/api/charges/", ninja: "/ninja/r/effects/"}
BOTH = pytest.mark.parametrize("generate", [spectacular, ninja], ids=["spectacular", "ninja"])


def key_header(operation: dict[str, Any], name: str = "Idempotency-Key") -> dict[str, Any] | None:
    return next(
        (p for p in operation.get("parameters", []) if p["in"] == "header" and p["name"] == name),
        None,
    )


def create(generate: Generate) -> dict[str, Any]:
    return generate()["paths"][PROTECTED[generate]]["post"]  # type: ignore[index]


@BOTH
def test_the_header_documents_its_format_and_maximum_length(generate: Generate) -> None:
    header = key_header(create(generate))

    assert header is not None
    assert header["required"] is True
    assert header["schema"] == {
        "type": "string",
        "minLength": 1,
        "maxLength": 255,
        "pattern": "^[\\x21-\\x2b\\x2d-\\x7e]+$",
    }
    assert "visible ASCII" in header["description"]
    assert "quoted-string" in header["description"]


@BOTH
def test_the_ttl_is_published(generate: Generate) -> None:
    operation = create(generate)

    assert (
        "Keys expire 86400 seconds (24 hours) after the first response is stored"
        in (
            key_header(operation)["description"]  # type: ignore[index]
        )
    )
    assert operation["x-idempotency"] == {
        "header": "Idempotency-Key",
        "maxKeyLength": 255,
        "ttlSeconds": 86400.0,
        "replayHeader": "Idempotent-Replayed",
    }


@BOTH
def test_the_published_policy_follows_the_settings(generate: Generate) -> None:
    settings = {
        "TTL_SECONDS": None,
        "HEADER": "X-Request-Key",
        "REPLAY_HEADER": "X-Replayed",
        "RETRY_AFTER_SECONDS": 3,
    }
    with override_settings(IDEMPOTENCY=settings):
        operation = create(generate)

    header = key_header(operation, "X-Request-Key")
    assert header is not None
    assert "Keys never expire" in header["description"]
    assert operation["x-idempotency"]["ttlSeconds"] is None
    assert "X-Replayed" in operation["responses"]["201"]["headers"]
    assert (
        "RETRY_AFTER_SECONDS, 3"
        in (operation["responses"]["409"]["headers"]["Retry-After"]["description"])
    )


@BOTH
def test_every_problem_the_app_can_give_is_documented(generate: Generate) -> None:
    responses = create(generate)["responses"]

    for status in ("400", "403", "409", "413", "422", "503"):
        schema = responses[status]["content"]["application/problem+json"]["schema"]
        assert schema["required"] == ["type", "title", "status"]
        assert "urn:idempotency-django:problem:key-mismatch" in schema["properties"]["type"]["enum"]
    assert "key-mismatch" in responses["422"]["description"]
    assert "in-flight" in responses["409"]["description"]
    for status in ("409", "503"):
        assert responses[status]["headers"]["Retry-After"]["schema"]["type"] == "integer"


@BOTH
def test_success_responses_carry_the_replay_header(generate: Generate) -> None:
    responses = create(generate)["responses"]

    assert responses["201"]["headers"]["Idempotent-Replayed"]["schema"] == {
        "type": "string",
        "enum": ["true"],
    }
    assert "Idempotent-Replayed" not in responses["409"].get("headers", {})
    assert "Idempotent-Replayed" not in responses["503"].get("headers", {})


def test_spectacular_leaves_unprotected_operations_untouched() -> None:
    schema = spectacular()
    listing = schema["paths"]["/api/charges/"]["get"]
    note = schema["paths"]["/api/charges/note/"]["post"]

    assert key_header(listing) is None
    assert key_header(note) is None
    assert "409" not in note["responses"]
    assert "x-idempotency" not in note


def test_spectacular_documents_a_custom_action_in_idempotency_actions() -> None:
    schema = spectacular()

    assert key_header(schema["paths"]["/api/charges/refund/"]["post"]) is not None
    assert key_header(schema["paths"]["/api/throttled/"]["post"]) is not None


def test_ninja_leaves_unprotected_operations_untouched() -> None:
    paths = ninja()["paths"]

    assert key_header(paths["/ninja/r/effects/"]["get"]) is None
    assert key_header(paths["/ninja/plain/"]["post"]) is None
    assert "409" not in paths["/ninja/plain/"]["post"]["responses"]
    assert "x-idempotency" not in paths["/ninja/plain/"]["post"]


def test_ninja_per_operation_options_and_own_extra_are_kept() -> None:
    paths = ninja()["paths"]
    optional = paths["/ninja/r/optional/"]["post"]

    assert key_header(optional)["required"] is False  # type: ignore[index]
    assert "Keys expire 60 seconds after" in key_header(optional)["description"]  # type: ignore[index]
    assert optional["x-idempotency"]["ttlSeconds"] == 60
    # The author's openapi_extra merges over the contract; ninja's own parts stay.
    assert optional["responses"]["201"]["description"] == "Created, once."
    assert "Idempotent-Replayed" in optional["responses"]["201"]["headers"]
    assert optional["requestBody"]["content"]["application/json"]
    assert key_header(paths["/ninja/r/effects/{number}"]["patch"]) is not None


def test_a_views_own_problem_status_keeps_its_description_and_is_replayable() -> None:
    responses = create(ninja)["responses"]

    # create_effect declares its own 400 (EffectOut): stored, so replayed, like a 201.
    assert responses["400"]["description"] == "Bad Request"
    assert set(responses["400"]["content"]) == {"application/json", "application/problem+json"}
    assert "Idempotent-Replayed" in responses["400"]["headers"]


def test_an_actions_own_extend_schema_keeps_the_contract() -> None:
    """``@extend_schema`` on an action gives it a schema class of its own, which
    drf-spectacular uses in place of the view's: the contract is added through it too."""
    from drf_spectacular.types import OpenApiTypes
    from drf_spectacular.utils import extend_schema
    from rest_framework import viewsets
    from rest_framework.decorators import action
    from rest_framework.response import Response
    from rest_framework.routers import SimpleRouter
    from rest_framework.views import APIView

    from idempotency_django.drf import IdempotentMixin

    class Tagged(AutoSchema):  # an action's own schema instance, not a class
        def get_tags(self) -> list[str]:
            return ["tagged"]

    class Extended(IdempotentMixin, viewsets.ViewSet):
        idempotency_actions = {"create", "refund", "hidden", "tagged"}

        @extend_schema(request=OpenApiTypes.OBJECT, responses={201: OpenApiTypes.OBJECT})
        def create(self, request: Any) -> Response:
            return Response(status=201)

        @extend_schema(responses={200: OpenApiTypes.OBJECT}, summary="Refund it")
        @action(detail=False, methods=["post"])
        def refund(self, request: Any) -> Response:
            return Response()

        @extend_schema(responses={200: OpenApiTypes.OBJECT})
        def list(self, request: Any) -> Response:
            return Response()

        @extend_schema(exclude=True)
        @action(detail=False, methods=["post"])
        def hidden(self, request: Any) -> Response:
            return Response()

        @action(detail=False, methods=["post"], schema=Tagged())
        def tagged(self, request: Any) -> Response:
            return Response()

    class OwnSchema(IdempotentMixin, APIView):  # the view's own schema class is kept
        schema = Tagged()

        def post(self, request: Any) -> Response:
            return Response(status=201)

    router = SimpleRouter()
    router.register("extended", Extended, basename="extended")
    patterns = [*router.urls, path("own/", OwnSchema.as_view())]
    schema = json.loads(
        json.dumps(SchemaGenerator(patterns=patterns).get_schema(request=None, public=True))
    )
    paths = schema["paths"]

    assert key_header(paths["/extended/"]["post"]) is not None
    assert "Idempotent-Replayed" in paths["/extended/"]["post"]["responses"]["201"]["headers"]
    assert key_header(paths["/extended/refund/"]["post"]) is not None
    assert paths["/extended/refund/"]["post"]["summary"] == "Refund it"
    assert key_header(paths["/extended/"]["get"]) is None
    assert "/extended/hidden/" not in paths
    assert paths["/extended/tagged/"]["post"]["tags"] == ["tagged"]
    assert key_header(paths["/extended/tagged/"]["post"]) is not None
    assert paths["/own/"]["post"]["tags"] == ["tagged"]
    assert key_header(paths["/own/"]["post"]) is not None


@BOTH
def test_switched_off_the_contract_is_not_published(generate: Generate) -> None:
    with override_settings(IDEMPOTENCY={"ENABLED": False}):
        operation = create(generate)

    assert key_header(operation) is None
    assert "x-idempotency" not in operation
    assert "409" not in operation["responses"]


def test_every_problem_of_the_package_is_published() -> None:
    """Each ``IdempotencyError`` the package defines is in ``contract.PROBLEMS`` under its
    status, so that a new problem cannot go unpublished."""
    import importlib
    import pkgutil

    import idempotency_django
    from idempotency_django.contract import PROBLEMS
    from idempotency_django.exceptions import IdempotencyError

    # Not HTTP: the task API's errors are raised to the caller, not answered.
    not_http = ("idempotency_django.tasks",)
    for module in pkgutil.iter_modules(idempotency_django.__path__):
        if module.name not in ("openapi", "drf", "ninja"):  # adapters: no errors of their own
            importlib.import_module(f"idempotency_django.{module.name}")

    def every(klass: type[IdempotencyError]) -> list[type[IdempotencyError]]:
        return [klass] + [sub for child in klass.__subclasses__() for sub in every(child)]

    defined = {
        klass
        for klass in every(IdempotencyError)[1:]
        if klass.__module__.startswith("idempotency_django.") and klass.__module__ not in not_http
    }
    assert defined
    for klass in defined:
        assert klass in PROBLEMS[klass.status], klass
