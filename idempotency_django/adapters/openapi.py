"""drf-spectacular support: protected operations document the ``Idempotency-Key`` header
(format, maximum length, expiry policy), every problem response the app can give and the
replay header, from the texts and schemas in ``contract.py`` (which django-ninja's schema
shares).

Loaded by the app when drf-spectacular is installed; nothing to configure. What the
documents say: docs/http-contract.md.
"""

from __future__ import annotations

import functools
from typing import Any

from drf_spectacular.extensions import OpenApiViewExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import get_doc
from drf_spectacular.settings import spectacular_settings
from rest_framework.settings import api_settings

from idempotency_django.conf import status_predicate
from idempotency_django.core import contract


def document(view: Any, method: str, operation: dict[str, Any]) -> dict[str, Any]:
    """Add the contract (``contract.document``) to a protected action's ``operation``."""
    options = view.get_idempotency_options()
    if not options.protects(method):
        return operation
    actions = view.idempotency_actions
    if actions is not None and getattr(view, "action", None) not in actions:
        return operation
    ttl = options.pick("ttl_seconds")
    return contract.document(
        operation,
        required=bool(options.pick("required")),
        ttl=None if ttl is None else float(ttl),
        stored=status_predicate(options.pick("store_statuses")),
    )


def _documenting(base: type[AutoSchema]) -> type[AutoSchema]:
    """``base``, adding the contract to the operations it generates."""

    class IdempotentSchema(base):  # type: ignore[misc,valid-type]
        def get_operation(self, *args: Any, **kwargs: Any) -> Any:
            operation = super().get_operation(*args, **kwargs)
            if operation is None:
                return None
            return document(self.view, self.method, operation)

        def get_description(self) -> str:
            description: str = super().get_description()
            if description and description == get_doc(self.view.__class__):
                return _view_doc(self.view.__class__)
            return description

    return IdempotentSchema


def _view_doc(view_class: type) -> str:
    """The view's docstring as drf-spectacular finds it, but not the library's.

    drf-spectacular takes the first docstring in the view's MRO (up to DRF's own classes),
    so a view without one would be described by ``IdempotentMixin``'s docstring, on every
    operation: that text is for the mixin's users, not the API's.
    """
    mro = view_class.__mro__
    barrier = min(
        (mro.index(klass) for klass in spectacular_settings.GET_LIB_DOC_EXCLUDES() if klass in mro),
        default=len(mro),
    )
    for klass in mro[:barrier]:
        if klass.__module__.startswith("idempotency_django.") or not klass.__doc__:
            continue
        return get_doc(klass)
    return ""


def _with_schema(handler: Any, schema: type[AutoSchema]) -> Any:
    """A handler like ``handler`` (same attributes: ``@action``'s mapping, url_path, …)
    whose ``@extend_schema`` class is ``schema``."""

    @functools.wraps(handler)
    def wrapper(*args: Any, **kwargs: Any) -> Any:  # pragma: no cover - never served
        return handler(*args, **kwargs)

    wrapper.kwargs = {**handler.kwargs, "schema": schema}  # type: ignore[attr-defined]
    return wrapper


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
        attributes: dict[str, Any] = {"schema": _documenting(base)()}
        # An action's own @extend_schema gives it a schema class of its own, which
        # drf-spectacular uses in place of the view's: document through that one too.
        for name in dir(self.target):
            handler = getattr(self.target, name, None)
            extended = getattr(handler, "kwargs", None)
            if callable(handler) and isinstance(extended, dict) and "schema" in extended:
                action_schema = extended["schema"]
                if not isinstance(action_schema, type):
                    action_schema = type(action_schema)
                attributes[name] = _with_schema(handler, _documenting(action_schema))
        return type(self.target.__name__, (self.target,), attributes)
