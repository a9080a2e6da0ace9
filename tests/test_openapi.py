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

from tests.project.ninja_views import api as ninja_api

Generate = Callable[[], dict[str, Any]]


def spectacular() -> dict[str, Any]:
    schema = SchemaGenerator(urlconf="tests.project.drf_urls").get_schema(request=None, public=True)
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


def valid(schema: dict[str, Any], instance: Any, document: dict[str, Any] | None = None) -> bool:
    """Whether ``instance`` validates against ``schema`` as a client generated from the
    document would check it (``$ref``s resolved in ``document``'s components)."""
    from openapi_schema_validator import OAS30Validator

    root = {**schema, "components": (document or {}).get("components", {})}
    return OAS30Validator(root).is_valid(instance)  # type: ignore[no-any-return]


@BOTH
def test_the_header_documents_its_format_and_maximum_length(generate: Generate) -> None:
    header = key_header(create(generate))

    assert header is not None
    assert header["required"] is True
    assert header["schema"]["type"] == "string"
    assert header["schema"]["minLength"] == 1
    assert valid(header["schema"], "k" * 255)
    assert not valid(header["schema"], "k" * 256)
    assert "visible ASCII" in header["description"]
    assert "quoted-string" in header["description"]


@BOTH
@pytest.mark.parametrize(
    "value",
    [
        '"abc',  # the parser reads an unterminated quoted string: 400
        '"a b"',  # a space inside quotes: 201
        '"' + "k" * 255 + '"',  # 257 characters, a 255-character key: 201
        '"' + '\\"' * 255 + '"',  # 512 characters, a 255-character key: 201
        '"' + "k" * 256 + '"',
        '"   "',
        '""',
        '"a,b"',
        "a b",
        'a"b',
        '"a\\nb"',
    ],
)
def test_the_published_key_schema_accepts_what_the_server_accepts(
    generate: Generate, value: str
) -> None:
    """A client validating its header against the schema is never refused (400) a key the
    schema allows, nor kept from sending one the server takes, in the quoted form too."""
    from idempotency_django.exceptions import KeyMalformed
    from idempotency_django.keys import parse_key

    schema = key_header(create(generate))["schema"]  # type: ignore[index]
    try:
        parse_key(value)
        accepted = True
    except KeyMalformed:
        accepted = False
    assert valid(schema, value) is accepted


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
        assert (
            "urn:idempotency-django:problem:key-mismatch"
            in schema["properties"]["type"]["description"]
        )
        assert valid(
            schema,
            {"type": "urn:idempotency-django:problem:in-flight", "title": "x", "status": 409},
        )
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
    from idempotency_django.core.contract import PROBLEMS
    from idempotency_django.exceptions import IdempotencyError

    # Not HTTP: the task API's errors are raised to the caller, not answered.
    not_http = ("idempotency_django.adapters.tasks",)
    adapters = ("openapi", "drf", "ninja")  # no errors of their own
    for module in pkgutil.walk_packages(idempotency_django.__path__, "idempotency_django."):
        skipped = (".store.", ".metrics.", ".migrations", ".management")
        if module.name.rsplit(".", 1)[1] not in adapters and not any(
            s in module.name for s in skipped
        ):
            importlib.import_module(module.name)

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


@BOTH
def test_the_documents_are_valid_openapi(generate: Generate) -> None:
    from openapi_spec_validator import validate

    validate(generate())  # type: ignore[arg-type]


@BOTH
def test_a_views_own_problem_types_validate(generate: Generate) -> None:
    """The app's problem statuses are the view's too: a view's own 400 or 422 problem,
    with a type of its own, is not refused by the schema the app publishes for them."""
    responses = create(generate)["responses"]
    own = {"type": "https://example.com/problems/out-of-credit", "title": "No", "status": 422}

    for status in ("400", "403", "409", "413", "422", "503"):
        schema = responses[status]["content"]["application/problem+json"]["schema"]
        assert valid(schema, {**own, "status": int(status)}), status
        assert valid(schema, {**own, "type": "about:blank", "status": int(status)}), status


# A view's own problem schema: RFC 9457 makes every member optional, so this one's bodies
# (no title) validate only against it, not against the app's.
VALIDATION_PROBLEM = {
    "type": "object",
    "properties": {
        "type": {"type": "string"},
        "status": {"type": "integer"},
        "errors": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["errors"],
}
VALIDATION_BODY = {"type": "https://example.com/problems/invalid", "status": 400, "errors": ["x"]}


def spectacular_with_own_problem() -> dict[str, Any]:
    from drf_spectacular.types import OpenApiTypes
    from drf_spectacular.utils import extend_schema
    from rest_framework.response import Response
    from rest_framework.views import APIView

    from idempotency_django.drf import IdempotentMixin

    class OwnProblem(IdempotentMixin, APIView):
        @extend_schema(
            request=OpenApiTypes.OBJECT,
            responses={
                201: OpenApiTypes.OBJECT,
                (400, "application/problem+json"): VALIDATION_PROBLEM,
                415: OpenApiTypes.OBJECT,
            },
        )
        def post(self, request: Any) -> Response:
            return Response(status=201)

    patterns = [path("own-problem/", OwnProblem.as_view())]
    schema = SchemaGenerator(patterns=patterns).get_schema(request=None, public=True)
    return json.loads(json.dumps(schema))  # type: ignore[no-any-return]


def ninja_with_own_problem() -> dict[str, Any]:
    from ninja import NinjaAPI

    from idempotency_django.ninja import IdempotentRouter
    from tests.project.ninja_views import EffectOut

    api = NinjaAPI(urls_namespace="tests-ninja-own-problem")
    router = IdempotentRouter()
    problem = {"content": {"application/problem+json": {"schema": VALIDATION_PROBLEM}}}

    @router.post(
        "/own-problem/",
        response={201: EffectOut, 415: EffectOut},
        openapi_extra={"responses": {400: {"description": "Invalid.", **problem}}},
    )
    def own_problem(request: Any) -> Any:  # pragma: no cover - never served
        return 201, {}

    api.add_router("/", router)
    return json.loads(json.dumps(api.get_openapi_schema(path_prefix="/")))


OWN_PROBLEM = pytest.mark.parametrize(
    "generate", [spectacular_with_own_problem, ninja_with_own_problem], ids=["spectacular", "ninja"]
)


@OWN_PROBLEM
def test_a_views_own_problem_schema_is_kept_beside_the_apps(generate: Generate) -> None:
    """The view's own problem+json schema for a status the app uses too is merged, not
    replaced: the view's bodies validate, and so do the app's."""
    from openapi_spec_validator import validate

    document = generate()
    validate(document)  # type: ignore[arg-type]
    operation = next(iter(document["paths"].values()))["post"]
    schema = operation["responses"]["400"]["content"]["application/problem+json"]["schema"]

    assert valid(schema, VALIDATION_BODY, document)
    key_malformed = {
        "type": "urn:idempotency-django:problem:key-malformed",
        "title": "Malformed",
        "status": 400,
    }
    assert valid(schema, key_malformed, document)
    assert not valid(schema, {"status": 400}, document)


@OWN_PROBLEM
def test_every_stored_status_documents_the_replay_header(generate: Generate) -> None:
    """A view's own 400, 415 and 422 are stored (STORE_STATUSES) and replayed with the
    replay header, whether the view documented them or shares the status with the app."""
    responses = next(iter(generate()["paths"].values()))["post"]["responses"]

    for status in ("201", "400", "403", "413", "415", "422"):
        assert "Idempotent-Replayed" in responses[status]["headers"], status
    for status in ("409", "500", "503"):  # never stored by default: transient or 5xx
        assert "Idempotent-Replayed" not in responses[status].get("headers", {}), status


@OWN_PROBLEM
def test_the_replay_header_follows_store_statuses(generate: Generate) -> None:
    with override_settings(IDEMPOTENCY={"STORE_STATUSES": [201, 409]}):
        responses = next(iter(generate()["paths"].values()))["post"]["responses"]

    assert "Idempotent-Replayed" in responses["201"]["headers"]
    assert "Idempotent-Replayed" in responses["409"]["headers"]
    for status in ("400", "415", "422"):
        assert "Idempotent-Replayed" not in responses[status].get("headers", {}), status


def test_the_mixins_docstring_describes_no_operation() -> None:
    """drf-spectacular describes an operation by the first docstring in its view's MRO: a
    view without one is not described by ``IdempotentMixin``'s, meant for its users."""
    from drf_spectacular.types import OpenApiTypes
    from drf_spectacular.utils import extend_schema
    from rest_framework.response import Response
    from rest_framework.views import APIView

    from idempotency_django.drf import IdempotentMixin

    class Undocumented(IdempotentMixin, APIView):
        @extend_schema(request=OpenApiTypes.OBJECT, responses={201: OpenApiTypes.OBJECT})
        def post(self, request: Any) -> Response:
            return Response(status=201)

    class Base(APIView):
        """Charges, from a documented base."""

    class Inherited(IdempotentMixin, Base):
        def post(self, request: Any) -> Response:
            return Response(status=201)

    class Documented(IdempotentMixin, APIView):
        """Charges, documented."""

        def post(self, request: Any) -> Response:
            """Create a charge."""
            return Response(status=201)

    patterns = [
        path("undocumented/", Undocumented.as_view()),
        path("inherited/", Inherited.as_view()),
        path("documented/", Documented.as_view()),
    ]
    paths = SchemaGenerator(patterns=patterns).get_schema(request=None, public=True)["paths"]

    assert "description" not in paths["/undocumented/"]["post"]
    assert paths["/inherited/"]["post"]["description"] == "Charges, from a documented base."
    assert paths["/documented/"]["post"]["description"] == "Create a charge."
    assert key_header(paths["/undocumented/"]["post"]) is not None
