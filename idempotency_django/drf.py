"""Django REST framework integration: ``IdempotentMixin`` for ``APIView``s and viewsets.

The claim happens after DRF's authentication, permissions and throttles (so the account is
the DRF-authenticated user, and a request that is refused never claims a key), and the
stored response is the *rendered* DRF response, so a replay is byte-identical.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

from django.http import HttpRequest, HttpResponseBase
from django.template.response import SimpleTemplateResponse
from rest_framework import exceptions, views
from rest_framework.request import Request
from rest_framework.viewsets import ModelViewSet

from idempotency_django.conf import conf, resolve_callable
from idempotency_django.exceptions import IdempotencyError
from idempotency_django.protect import ViewOptions, protect
from idempotency_django.responses import problem_response


class IdempotencyAPIException(exceptions.APIException):
    """The app's own errors (400, 403, 409, 413, 422, 503) as a DRF exception, so a project
    that customises DRF's ``EXCEPTION_HANDLER`` sees them in its own format."""

    def __init__(self, error: IdempotencyError) -> None:
        self.status_code = error.status
        self.default_code = error.slug
        self.error = error
        super().__init__(detail=error.detail, code=error.slug)


# Class attribute → ``@idempotent`` argument. ``None`` on the class means "use the setting".
_OPTION_ATTRIBUTES = {
    "idempotency_required": "required",
    "idempotency_methods": "methods",
    "idempotency_mode": "mode",
    "idempotency_in_flight": "in_flight",
    "idempotency_wait_seconds": "wait_seconds",
    "idempotency_lease_seconds": "lease_seconds",
    "idempotency_ttl_seconds": "ttl_seconds",
    "idempotency_fingerprint_fields": "fingerprint_fields",
    "idempotency_store_statuses": "store_statuses",
    "idempotency_on_store_error": "on_store_error",
}


class IdempotentMixin:
    """Make unsafe requests to an ``APIView`` or viewset idempotent.

    Class attributes mirror ``@idempotent``'s arguments (``idempotency_mode``,
    ``idempotency_in_flight``, …); ``idempotency_actions`` limits protection to some
    viewset actions (e.g. ``{"create", "refund"}``). Override a ``get_idempotency_*``
    hook to change one piece, like DRF's ``perform_create``.
    """

    idempotency_actions: Collection[str] | None = None
    idempotency_required: bool | None = None
    idempotency_methods: Iterable[str] | None = None
    idempotency_mode: str | None = None
    idempotency_in_flight: str | None = None
    idempotency_wait_seconds: float | None = None
    idempotency_lease_seconds: float | None = None
    idempotency_ttl_seconds: float | None = None
    idempotency_fingerprint_fields: Iterable[str] | None = None
    idempotency_store_statuses: Callable[[int], bool] | Iterable[int] | str | None = None
    idempotency_on_store_error: str | None = None

    # -- hooks ------------------------------------------------------------------------------

    def get_idempotency_key(self, request: Request) -> str | None:
        """The raw key (parsed and validated afterwards)."""
        return request.headers.get(conf.HEADER)

    def get_idempotency_account(self, request: Request) -> str | None:
        """The account a key belongs to: by default the DRF-authenticated user."""
        return resolve_callable(conf.get("ACCOUNT"), "ACCOUNT")(request)  # type: ignore[no-any-return]

    def get_idempotency_endpoint(self, request: Request) -> str:
        return resolve_callable(conf.get("ENDPOINT"), "ENDPOINT")(request)  # type: ignore[no-any-return]

    def get_idempotency_fingerprint(self, request: Request) -> str | bytes | None:
        """What makes this request *this* request, in place of the body; ``None`` (the
        default) fingerprints the canonical body (or ``idempotency_fingerprint_fields``)."""
        return None

    def get_idempotency_options(self) -> ViewOptions:
        """The options for the current request; override to vary them per action."""
        values: dict[str, Any] = {
            argument: getattr(self, attribute)
            for attribute, argument in _OPTION_ATTRIBUTES.items()
            if getattr(self, attribute) is not None
        }
        if "fingerprint_fields" in values:
            values["fingerprint_fields"] = list(values["fingerprint_fields"])
        if (
            type(self).get_idempotency_fingerprint
            is not IdempotentMixin.get_idempotency_fingerprint
        ):
            values["fingerprint"] = self.get_idempotency_fingerprint
        return ViewOptions(
            account=self.get_idempotency_account,
            endpoint=self.get_idempotency_endpoint,
            key=self.get_idempotency_key,
            **values,
        )

    def idempotency_applies(self, request: Request, options: ViewOptions) -> bool:
        if not options.protects(request.method):
            return False
        if self.idempotency_actions is None:
            return True
        return getattr(self, "action", None) in self.idempotency_actions

    def idempotency_error_response(self, error: IdempotencyError) -> HttpResponseBase:
        """The response for one of the app's own errors.

        With DRF's default exception handler: ``application/problem+json`` (RFC 9457), the
        same body as ``@idempotent`` views. With a custom ``EXCEPTION_HANDLER``: whatever it
        makes of an ``IdempotencyAPIException``, so error bodies keep the project's format.
        """
        handler = self.get_exception_handler()  # type: ignore[attr-defined]
        if handler is views.exception_handler:
            return problem_response(error)
        response: HttpResponseBase = self.handle_exception(IdempotencyAPIException(error))  # type: ignore[attr-defined]
        if error.retry_after is not None:
            response["Retry-After"] = str(error.retry_after)
        return response

    # -- flow -------------------------------------------------------------------------------

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        """DRF's ``APIView.dispatch``, with the claim between ``initial()`` (authentication,
        permissions, throttles) and the handler."""
        view: Any = self
        view.args = args
        view.kwargs = kwargs
        drf_request = view.initialize_request(request, *args, **kwargs)
        view.request = drf_request
        view.headers = view.default_response_headers
        try:
            view.initial(drf_request, *args, **kwargs)
            method = (drf_request.method or "").lower()
            if method in view.http_method_names:
                handler = getattr(view, method, view.http_method_not_allowed)
            else:
                handler = view.http_method_not_allowed
            options = self.get_idempotency_options()
            if self.idempotency_applies(drf_request, options):

                def call_view() -> HttpResponseBase:
                    return self._rendered(handler, drf_request, args, kwargs)

                response = protect(drf_request, call_view, options, self.idempotency_error_response)
            else:
                response = handler(drf_request, *args, **kwargs)
        except Exception as exc:
            response = view.handle_exception(exc)
        view.response = view.finalize_response(drf_request, response, *args, **kwargs)
        return view.response  # type: ignore[no-any-return]

    def _rendered(
        self, handler: Callable[..., Any], request: Request, args: Any, kwargs: Any
    ) -> HttpResponseBase:
        """Run the handler the way DRF would, down to the rendered bytes that get stored.

        DRF exceptions become responses here (a ``ValidationError`` is a stored 400, an
        ``APIException`` with a 5xx status releases the key); anything else propagates, and
        releases the key.
        """
        view: Any = self
        try:
            response = handler(request, *args, **kwargs)
        except Exception as exc:
            response = view.handle_exception(exc)
        response = view.finalize_response(request, response, *args, **kwargs)
        if isinstance(response, SimpleTemplateResponse):
            response.render()
        return response  # type: ignore[no-any-return]


class IdempotentModelViewSet(IdempotentMixin, ModelViewSet):  # type: ignore[type-arg]
    """A ``ModelViewSet`` whose ``create`` (POST) and ``partial_update`` (PATCH) are
    idempotent; set ``idempotency_actions`` to choose others."""

    idempotency_actions = ("create", "partial_update")


__all__ = [
    "IdempotencyAPIException",
    "IdempotentMixin",
    "IdempotentModelViewSet",
]
