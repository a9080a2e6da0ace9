"""drf-spectacular support: protected operations document the ``Idempotency-Key`` header,
the app's 400/409/422 problem responses and the replay header.

Loaded by the app when drf-spectacular is installed; nothing to configure.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiViewExtension
from drf_spectacular.openapi import AutoSchema
from rest_framework.settings import api_settings

from idempotency_django.conf import conf

PROBLEM_SCHEMA = {
    "type": "object",
    "properties": {
        "type": {"type": "string", "format": "uri"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
    },
    "required": ["type", "title", "status"],
}
PROBLEMS = {
    "400": "Idempotency-Key is missing or malformed.",
    "409": "A request with this Idempotency-Key is still being processed; retry after "
    "Retry-After seconds.",
    "422": "This Idempotency-Key was already used with a different request.",
}


def document(view: Any, method: str, operation: dict[str, Any]) -> dict[str, Any]:
    """Add the key header, the replay header and the problem responses to ``operation``."""
    options = view.get_idempotency_options()
    if not options.protects(method):
        return operation
    actions = view.idempotency_actions
    if actions is not None and getattr(view, "action", None) not in actions:
        return operation
    required = bool(options.pick("required", "REQUIRED"))
    operation.setdefault("parameters", []).append(
        {
            "in": "header",
            "name": conf.HEADER,
            "required": required,
            "schema": {"type": "string", "minLength": 1, "maxLength": 255},
            "description": "Names one logical operation: send the same key on every retry. "
            "A completed key replays its first response.",
        }
    )
    responses = operation.setdefault("responses", {})
    for status, description in PROBLEMS.items():
        responses.setdefault(
            status,
            {
                "description": description,
                "content": {"application/problem+json": {"schema": PROBLEM_SCHEMA}},
            },
        )
    for status, response in responses.items():
        if status.startswith(("2", "3", "4")) and status not in PROBLEMS:
            response.setdefault("headers", {})[conf.REPLAY_HEADER] = {
                "schema": {"type": "boolean"},
                "description": "Present and true when this is the stored response of an "
                "earlier request with the same Idempotency-Key.",
            }
    return operation


class IdempotentViewExtension(OpenApiViewExtension):  # type: ignore[no-untyped-call]
    target_class = "idempotency_django.drf.IdempotentMixin"
    match_subclasses = True

    def view_replacement(self) -> Any:
        # Keep the schema class the view would have had: its own, or the project's default.
        schema = next(
            (
                klass.__dict__["schema"]
                for klass in self.target.__mro__
                if "schema" in klass.__dict__
            ),
            None,
        )
        base: type[AutoSchema] = AutoSchema
        if isinstance(schema, AutoSchema):
            base = type(schema)
        elif isinstance(api_settings.DEFAULT_SCHEMA_CLASS, type) and issubclass(
            api_settings.DEFAULT_SCHEMA_CLASS, AutoSchema
        ):
            base = api_settings.DEFAULT_SCHEMA_CLASS

        class IdempotentSchema(base):  # type: ignore[misc,valid-type]
            def get_operation(self, *args: Any, **kwargs: Any) -> Any:
                operation = super().get_operation(*args, **kwargs)
                if operation is None:
                    return None
                return document(self.view, self.method, operation)

        return type(self.target.__name__, (self.target,), {"schema": IdempotentSchema()})
