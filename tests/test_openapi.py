"""The OpenAPI schema drf-spectacular generates documents protected operations."""

from __future__ import annotations

from typing import Any

import pytest
from drf_spectacular.generators import SchemaGenerator


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return SchemaGenerator(urlconf="tests.drf_urls").get_schema(request=None, public=True)  # type: ignore[no-any-return]


def header(operation: dict[str, Any]) -> dict[str, Any] | None:
    return next(
        (
            p
            for p in operation.get("parameters", [])
            if p["in"] == "header" and p["name"] == "Idempotency-Key"
        ),
        None,
    )


def test_a_protected_action_documents_the_key_and_the_problems(schema: dict[str, Any]) -> None:
    create = schema["paths"]["/api/charges/"]["post"]

    assert header(create) == {
        "in": "header",
        "name": "Idempotency-Key",
        "required": True,
        "schema": {"type": "string", "minLength": 1, "maxLength": 255},
        "description": header(create)["description"],  # type: ignore[index]
    }
    for status in ("400", "409", "422"):
        assert "application/problem+json" in create["responses"][status]["content"]
    assert "Idempotent-Replayed" in create["responses"]["201"]["headers"]


def test_unprotected_operations_are_untouched(schema: dict[str, Any]) -> None:
    listing = schema["paths"]["/api/charges/"]["get"]
    note = schema["paths"]["/api/charges/note/"]["post"]

    assert header(listing) is None
    assert header(note) is None
    assert "409" not in note["responses"]


def test_a_custom_action_in_idempotency_actions_is_documented(schema: dict[str, Any]) -> None:
    assert header(schema["paths"]["/api/charges/refund/"]["post"]) is not None
    assert header(schema["paths"]["/api/throttled/"]["post"]) is not None
