"""Django REST framework integration: ``IdempotentMixin`` for ``APIView``s and viewsets.

The claim happens after DRF's authentication, permissions and throttles (so the account is
the DRF-authenticated user, and a request that is refused never claims a key), and the
stored response is the *rendered* DRF response, so a replay is byte-identical.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponseBase
from django.template.response import SimpleTemplateResponse
from rest_framework import exceptions, views
from rest_framework.request import Request
from rest_framework.viewsets import ModelViewSet, ViewSetMixin

from idempotency_django.conf import conf, resolve_callable
from idempotency_django.core.options import _UNSET, DRF, OPTIONS, Options
from idempotency_django.core.protect import answered, protect
from idempotency_django.core.responses import problem_response
from idempotency_django.core.transactions import (
    RequestTransactions,
    request_transactions,
    unprotected,
)
from idempotency_django.exceptions import IdempotencyError
from idempotency_django.store.base import Store


class IdempotencyAPIException(exceptions.APIException):
    """The app's own errors (400, 403, 409, 413, 422, 503) as a DRF exception, so a project
    that customises DRF's ``EXCEPTION_HANDLER`` sees them in its own format."""

    def __init__(self, error: IdempotencyError) -> None:
        self.status_code = error.status
        self.default_code = error.slug
        self.error = error
        super().__init__(detail=error.detail, code=error.slug)


# Class attribute → option (``options.Options``). ``None`` on the class means "use the setting".
_OPTION_ATTRIBUTES = {option.attribute: option.name for option in OPTIONS if DRF in option.where}

# Every other ``idempotency_*`` or ``get_idempotency_*`` name on a view is a misspelling, which
# would leave the view on defaults (or protect nothing, for idempotency_actions) without a word.
_KNOWN_ATTRIBUTES = frozenset(
    {
        *_OPTION_ATTRIBUTES,
        "idempotency_actions",
        "idempotency_applies",
        "idempotency_error_response",
        "idempotency_exempt",  # set by @idempotency_exempt
        "get_idempotency_key",
        "get_idempotency_account",
        "get_idempotency_endpoint",
        "get_idempotency_fingerprint",
        "get_idempotency_options",
    }
)
ANONYMOUS_DETAIL = (
    "Authenticate to use an Idempotency-Key on this endpoint. (The key belongs to the user "
    "that the view's authentication_classes authenticate, and none did: require "
    "authentication in permission_classes, or override get_idempotency_account.)"
)
_STANDARD_ACTIONS = ("list", "create", "retrieve", "update", "partial_update", "destroy")


def _view_hook(name: str) -> Callable[[Request], Any]:
    """The ``name`` hook of the view serving ``request``: DRF's ``parser_context["view"]``,
    the instance ``dispatch`` made for this one request. So one ``Options`` per class serves
    every request, instead of one built (and validated) per request around bound methods."""

    def hook(request: Request) -> Any:
        return getattr(request.parser_context["view"], name)(request)

    hook.__name__ = hook.__qualname__ = name
    return hook


_HOOKS = {
    "account": _view_hook("get_idempotency_account"),
    "endpoint": _view_hook("get_idempotency_endpoint"),
    "key": _view_hook("get_idempotency_key"),
}
_FINGERPRINT_HOOK = _view_hook("get_idempotency_fingerprint")


def unknown_attributes(cls: type) -> list[str]:
    """The ``idempotency_*`` / ``get_idempotency_*`` names on ``cls`` that nothing reads."""
    return sorted(
        name
        for name in dir(cls)
        if name.startswith(("idempotency_", "get_idempotency_")) and name not in _KNOWN_ATTRIBUTES
    )


def viewset_actions(cls: type) -> set[str]:
    """The action names a viewset class can serve (``self.action`` for its requests): the
    standard ones it defines, its ``@action``s and their extra method mappings."""
    names = {name for name in _STANDARD_ACTIONS if callable(getattr(cls, name, None))}
    for extra in getattr(cls, "get_extra_actions", lambda: [])():
        names.add(extra.__name__)
        names.update(getattr(extra, "mapping", {}).values())
    return names


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
    idempotency_ttl_seconds: float | None = _UNSET  # None keeps keys forever, as TTL_SECONDS
    idempotency_max_run_seconds: float | None = None
    idempotency_max_response_bytes: int | None = None
    idempotency_fingerprint_fields: Iterable[str] | None = None
    idempotency_store_statuses: Callable[[int], bool] | Iterable[int] | str | None = None
    idempotency_on_store_error: str | None = None
    idempotency_store: str | Store | None = None  # a dotted path to a store class, or a store
    # Set by as_view (an initkwarg): the view's own _non_atomic_requests, author's opt-outs in.
    _idempotency_transactions: RequestTransactions | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse, at class creation, what would silently protect nothing or fail later: the
        mixin after ``APIView`` in the bases (DRF's flow runs first and never reaches the
        claim), and a class attribute that its setting would refuse."""
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if views.APIView in mro and mro.index(views.APIView) < mro.index(IdempotentMixin):
            raise ImproperlyConfigured(
                f"{cls.__module__}.{cls.__qualname__}: IdempotentMixin must come before "
                "the DRF view class in the bases, e.g. "
                "class View(IdempotentMixin, viewsets.ModelViewSet); after it, "
                "no request is protected."
            )
        cls._idempotency_options(f"{cls.__qualname__} (IdempotentMixin)")
        name = f"{cls.__module__}.{cls.__qualname__}"
        unknown = unknown_attributes(cls)
        if unknown:
            raise ImproperlyConfigured(
                f"{name}: unknown attribute {unknown[0]!r}; IdempotentMixin reads "
                f"{', '.join(sorted(a for a in _KNOWN_ATTRIBUTES if a.startswith('idem')))} "
                "and the get_idempotency_* hooks (key, account, endpoint, fingerprint, options)."
            )
        actions = cls.idempotency_actions
        if actions is None:
            return
        if (
            isinstance(actions, (str, bytes))
            or not isinstance(actions, Collection)
            or not all(isinstance(action, str) for action in actions)
        ):
            raise ImproperlyConfigured(
                f"{name}: idempotency_actions is {actions!r}; give a set of action names, "
                'e.g. {"create", "refund"}.'
            )
        if views.APIView in mro and not issubclass(cls, ViewSetMixin):
            raise ImproperlyConfigured(
                f"{name}: idempotency_actions names viewset actions, and an APIView has none: "
                "no request would be protected. Remove it (idempotency_methods chooses the "
                "methods)."
            )

    @classmethod
    def as_view(cls, *args: Any, **kwargs: Any) -> Any:
        """DRF's ``as_view``, opted out of ``ATOMIC_REQUESTS``: the shell opens those
        transactions again around the handler, after the claim has committed."""
        # Opt-outs already made on dispatch (copied onto the view by as_view), and those made
        # later on the view itself (non_atomic_requests(View.as_view())), reach the instances.
        transactions = RequestTransactions(
            getattr(getattr(cls, "dispatch", None), "_non_atomic_requests", ())
        )
        kwargs["_idempotency_transactions"] = transactions
        view = super().as_view(*args, **kwargs)  # type: ignore[misc]
        view._non_atomic_requests = transactions
        return view

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

    @classmethod
    def _idempotency_values(cls) -> dict[str, Any]:
        return {name: getattr(cls, attribute) for attribute, name in _OPTION_ATTRIBUTES.items()}

    @classmethod
    def _idempotency_options(cls, label: str, **extra: Any) -> Options:
        values = cls._idempotency_values()
        if values["fingerprint_fields"] is not None:
            values["fingerprint_fields"] = list(values["fingerprint_fields"])
        return Options.given(values, label, DRF, **extra, anonymous_detail=ANONYMOUS_DETAIL)

    def get_idempotency_options(self) -> Options:
        """The options for the current request; override to vary them per action.

        By default one ``Options`` per class, whose hooks call the serving view's
        ``get_idempotency_*``: built again only when a class attribute has changed, so a
        request neither validates the options again nor resolves the settings again
        (``Options.resolved`` keeps them until a setting changes)."""
        cls = type(self)
        custom = cls.get_idempotency_fingerprint is not IdempotentMixin.get_idempotency_fingerprint
        # Compared by value with copies, so that a list changed in place is seen too.
        values = {
            name: copy.copy(value) if isinstance(value, (list, set, dict)) else value
            for name, value in cls._idempotency_values().items()
        }
        cached = cls.__dict__.get("_idempotency_cached")
        if cached is not None and cached[0] == custom and cached[1] == values:
            return cached[2]  # type: ignore[no-any-return]
        options = cls._idempotency_options(
            f"{cls.__qualname__} (IdempotentMixin)",
            **_HOOKS,
            **({"fingerprint": _FINGERPRINT_HOOK} if custom else {}),
        )
        cls._idempotency_cached = (custom, values, options)  # type: ignore[attr-defined]
        return options

    def idempotency_applies(self, request: Request, options: Options) -> bool:
        """Whether to protect this request: decided before the handler is put in place,
        with the one answer every adapter gives (``Options.protects``), then the actions."""
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
        return _error_response(self, error)

    # -- flow -------------------------------------------------------------------------------

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        """After DRF's authentication, permissions and throttles, put the protected handler
        in place of the one DRF's ``dispatch`` is about to call (the way viewsets bind their
        actions, on the instance that serves this one request)."""
        super().initial(request, *args, **kwargs)  # type: ignore[misc]
        if _handler(self, request) is None:
            return
        options = self.get_idempotency_options()
        transactions = self._idempotency_transactions
        reopen = request_transactions(None) if transactions is None else transactions.to_reopen()
        _put_handler(
            self,
            request,
            options,
            self.idempotency_error_response,
            reopen,
            protected=self.idempotency_applies(request, options),
        )


def _handler(view: Any, request: Request) -> Callable[..., Any] | None:
    """The handler DRF's ``dispatch`` is about to call for ``request``, if it has one."""
    method = (request.method or "").lower()
    if method not in view.http_method_names:
        return None
    return getattr(view, method, None)


def _put_handler(
    view: Any,
    request: Request,
    options: Options,
    error_response: Callable[[IdempotencyError], HttpResponseBase],
    reopen: Sequence[str],
    *,
    protected: bool,
) -> None:
    """Replace the handler of ``request``'s method, on this one view instance, with one that
    runs it protected (``protected``), or in the request transactions it was opted out of."""
    handler = _handler(view, request)
    assert handler is not None
    method = (request.method or "").lower()
    if protected:

        def protected_handler(request: Request, *args: Any, **kwargs: Any) -> HttpResponseBase:
            def call_view() -> HttpResponseBase:
                return _rendered(view, handler, request, args, kwargs)

            return protect(request, call_view, options, error_response, reopen)

        setattr(view, method, protected_handler)
    elif reopen:

        def in_request_transactions(request: Request, *args: Any, **kwargs: Any) -> Any:
            return unprotected(reopen, lambda: handler(request, *args, **kwargs))

        setattr(view, method, in_request_transactions)


def _rendered(
    view: Any, handler: Callable[..., Any], request: Request, args: Any, kwargs: Any
) -> HttpResponseBase:
    """Run the handler the way DRF would, down to the rendered bytes that get stored.

    DRF exceptions become responses here (a ``ValidationError`` is a stored 400, an
    ``APIException`` with a 5xx status releases the key); anything else propagates, and
    releases the key. DRF's handler marks the request transactions for rollback when it
    answers an exception: the work rolls back, and the shell stores the answer.
    """
    try:
        response = handler(request, *args, **kwargs)
    except Exception as exc:
        response = answered(exc, view.handle_exception(exc))
    response = view.finalize_response(request, response, *args, **kwargs)
    if isinstance(response, SimpleTemplateResponse):
        response.render()
    return response  # type: ignore[no-any-return]


def _error_response(view: Any, error: IdempotencyError) -> HttpResponseBase:
    """``IdempotentMixin.idempotency_error_response`` for ``view``, with or without the mixin:
    problem+json under DRF's default exception handler, else whatever the project's handler
    makes of an ``IdempotencyAPIException``."""
    if view.get_exception_handler() is views.exception_handler:
        return problem_response(error)
    response: HttpResponseBase = view.handle_exception(IdempotencyAPIException(error))
    if error.retry_after is not None:
        response["Retry-After"] = str(error.retry_after)
    return response


# -- DRF views that IdempotencyMiddleware protects --------------------------------------------
#
# The middleware must run the callback Django resolved (a URLconf may wrap the view in
# ``staff_member_required``, a rate limit, ``sensitive_post_parameters``…), and the claim must
# come after DRF's own authentication, which runs inside that callback. So the middleware
# marks the request and calls the callback; ``APIView.initial``, hooked once, finds the mark
# after DRF's authentication, permissions and throttles, and puts the protected handler in
# place, as the mixin does. A view with the mixin protects itself and ignores the mark.

_MARK = "_idempotency_middleware_drf"
_HOOKED = "_idempotency_hooked"


@dataclass(frozen=True)
class MiddlewareMark:
    """What the middleware asks of the DRF view that serves one request."""

    options: Options
    reopen: Sequence[str]  # the ATOMIC_REQUESTS aliases to open around the work


def mark_for_middleware(request: HttpRequest, mark: MiddlewareMark) -> None:
    """Have the DRF view that serves ``request`` claim it with ``mark``'s options."""
    hook_initial()
    request.__dict__[_MARK] = mark


def hook_initial() -> None:
    """Make ``APIView.initial`` protect a request the middleware marked (once per process)."""
    original = views.APIView.initial
    if getattr(original, _HOOKED, False):
        return

    @functools.wraps(original)
    def initial(self: views.APIView, request: Request, *args: Any, **kwargs: Any) -> None:
        original(self, request, *args, **kwargs)
        mark = request._request.__dict__.pop(_MARK, None)  # one view claims, once
        if mark is None or isinstance(self, IdempotentMixin) or _handler(self, request) is None:
            return
        _put_handler(
            self,
            request,
            mark.options,
            functools.partial(_error_response, self),
            mark.reopen,
            protected=mark.options.protects(request.method),
        )

    setattr(initial, _HOOKED, True)
    views.APIView.initial = initial  # type: ignore[method-assign]


class IdempotentModelViewSet(IdempotentMixin, ModelViewSet):  # type: ignore[type-arg]
    """A ``ModelViewSet`` whose ``create`` (POST) and ``partial_update`` (PATCH) are
    idempotent; set ``idempotency_actions`` to choose others."""

    idempotency_actions = ("create", "partial_update")


__all__ = [
    "IdempotencyAPIException",
    "IdempotentMixin",
    "IdempotentModelViewSet",
]
