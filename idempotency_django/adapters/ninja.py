"""django-ninja integration: the ``@idempotent`` contract on ninja operations.

Two ways in, with the same options as ``@idempotent``: ``IdempotentRouter`` (every POST and
PATCH operation of the router) and ``@idempotent`` under an operation's route. The claim
happens inside ninja's ``Operation.run``, after ninja's authentication and throttles, around
its input validation, the operation's function and the rendering of its result: the key
belongs to ninja's caller, and a replay is byte for byte what ninja rendered. What is
claimed, stored and replayed, and why validation is inside the claim: ``docs/ninja.md`` and
``docs/http-contract.md`` ("Validation failures, every adapter alike").
"""

from __future__ import annotations

import copy
import functools
import hashlib
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from asgiref.sync import iscoroutinefunction
from django.core.exceptions import ImproperlyConfigured
from django.db.models import Model
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from ninja import Router
from ninja.operation import Operation, PathView
from ninja.utils import contribute_operation_callback

from idempotency_django.conf import DEFAULTS, conf, status_predicate
from idempotency_django.core import contract, keys
from idempotency_django.core.options import _UNSET, VIEW, Options
from idempotency_django.core.protect import answered, aprotect, protect
from idempotency_django.core.responses import problem_response
from idempotency_django.exceptions import IdempotencyError

Func = TypeVar("Func", bound=Callable[..., Any])

_MARK = "_idempotency_options"
_ANONYMOUS = (
    "Authenticate to use an Idempotency-Key on this endpoint. (The key belongs to the caller "
    "that the operation's auth= authenticates, and none did: give the operation auth=, or "
    "the account= option.)"
)


def auth_account(request: HttpRequest) -> str | None:
    """The account a key belongs to: ninja's authenticated caller, ``request.auth``.

    - a user (what ``django_auth`` and most authenticators return): its primary key, the
      account ``@idempotent`` uses for the same user;
    - another model instance (an API client, a tenant): ``app_label.model:pk``;
    - a string, bytes or number (an ``HttpBearer`` that returns the token): a SHA-256 of
      it, so a credential is never stored in plain text, and only its holder shares it. A
      refreshed token is a new account, so a retry sent with it runs again: authenticators
      should return the principal, not the token (docs/security.md, "ninja tokens");
    - nothing (an operation without ninja auth): the project's ``ACCOUNT`` (by default the
      ``request.user`` of Django's session authentication, as ``@idempotent``).

    Anything else (``True``, a dict) names nobody: the request is anonymous (403), and the
    ``account=`` option says who it is.
    """
    auth = getattr(request, "auth", None)
    if auth is None:
        return keys.default_account(request)
    if isinstance(auth, Model):
        from django.contrib.auth import get_user_model

        if isinstance(auth, get_user_model()):
            return str(auth.pk)
        return f"{auth._meta.label_lower}:{auth.pk}"
    if isinstance(auth, (str, bytes, int)) and not isinstance(auth, bool):
        raw = auth if isinstance(auth, bytes) else str(auth).encode("utf-8", "surrogatepass")
        return f"auth:{hashlib.sha256(raw).hexdigest()}"
    return None


def _account(request: HttpRequest) -> str | None:
    """``auth_account``, unless the project set its own ``ACCOUNT`` (which then sees
    ``request.auth`` too): decided per request, as settings are."""
    if conf.raw().get("ACCOUNT", DEFAULTS["ACCOUNT"]) == DEFAULTS["ACCOUNT"]:
        return auth_account(request)
    return conf.ACCOUNT(request)  # type: ignore[no-any-return]


def _options(given: Mapping[str, Any], label: str) -> Options:
    """``@idempotent``'s options, validated as its are; the account defaults to ``_account``."""
    values = dict(given)
    if values.get("account") in (None, _UNSET):
        values["account"] = _account
    return Options.given(values, label, VIEW, anonymous_detail=_ANONYMOUS)


def idempotent(view: Func | None = None, **given: Any) -> Any:
    """Protect one ninja operation; put it below the route decorator (``@api.post``).

    Takes ``@idempotent``'s keyword arguments (``required``, ``in_flight``, ``ttl_seconds``,
    ``account``, ``fingerprint_fields``, …), validated here, naming the operation. The
    operation's methods decide nothing: ``methods`` (``METHODS``) does, as for a view.
    """

    def decorator(func: Func) -> Func:
        label = f"ninja @idempotent on {getattr(func, '__qualname__', repr(func))}"
        options = _options(given, label)  # a bad argument fails at import, naming the operation
        if iscoroutinefunction(func):
            options.refuse_async_atomic()
        func.__dict__[_MARK] = (given, label)
        contribute_operation_callback(func, _install)
        return func

    if view is not None:
        return decorator(view)
    return decorator


class IdempotentRouter(Router):
    """A ninja ``Router`` whose operations are protected as if each had ``@idempotent``
    (with ``idempotency=``'s options); only the methods in ``methods`` (``METHODS``: POST
    and PATCH, as set when the operation is added) are protected, and other operations are
    left as ninja made them. An operation's own ``@idempotent`` takes precedence."""

    def __init__(self, *, idempotency: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.idempotency = dict(idempotency or {})
        _options(self.idempotency, "IdempotentRouter")

    def add_api_operation(self, path: str, methods: list[str], view_func: Any, **kw: Any) -> None:
        super().add_api_operation(path, methods, view_func, **kw)
        operation = self.path_operations[_ninja_path(path)].operations[-1]
        # Operations of other methods (GET, a streamed listing) are left as ninja made them.
        # Decided on import: a METHODS setting that cannot be read must not stop the URLconf
        # from importing, or `manage.py check` crashes instead of reporting it.
        given = self.idempotency.get("methods")
        protected = conf.methods_at_import() if given is None else {m.upper() for m in given}
        if _MARK not in view_func.__dict__ and protected & {m.upper() for m in methods}:
            label = f"IdempotentRouter operation {getattr(view_func, '__qualname__', path)}"
            if iscoroutinefunction(view_func):
                _options(self.idempotency, label).refuse_async_atomic()
            view_func.__dict__[_MARK] = (self.idempotency, label)
            _install(operation)


def _ninja_path(path: str) -> str:
    # what Router.add_api_operation files the operation under
    return re.sub(r"\{uuid:(\w+)\}", r"{uuidstr:\1}", path, flags=re.IGNORECASE)


def _install(operation: Operation) -> None:
    """On the template operation: register a ``_Bind`` to run on every clone of it.

    ninja clones each operation for every API that mounts its router and re-applies the
    operation's ``_run_decorators`` to each clone; ours is one of them, so each clone is
    protected, and renders with its own API (renderer, exception handlers)."""
    if not hasattr(Operation, "clone"):  # before 1.7, nothing would apply it: say so
        raise ImproperlyConfigured("idempotency_django.ninja needs django-ninja 1.7 or later.")
    if operation.stream_format is not None:
        raise ImproperlyConfigured(
            f"{operation.view_func.__qualname__}: a streaming operation cannot be idempotent "
            "(its response is not known until it has been sent)."
        )
    bind = _Bind(operation.view_func, operation.openapi_extra)
    decorators = operation.__dict__.setdefault("_run_decorators", [])
    decorators.append(bind)


class _Bind:
    """A "run decorator" that leaves ``run`` as it is and protects the clone's function.

    It finds the clone it decorates and puts the protected function in place of the clone's
    ``view_func``. The schema is added the same way, through the clone's ``openapi_extra``,
    built from ``contract.py`` when the schema is generated (so ``override_settings`` shows
    in it)."""

    def __init__(self, func: Callable[..., Any], extra: dict[str, Any] | None) -> None:
        self.func = func
        self.extra = extra
        given, label = func.__dict__[_MARK]
        self.given: dict[str, Any] = given
        self.label: str = label

    def __call__(self, run: Callable[..., Any]) -> Callable[..., Any]:
        operation = _operation_of(run)
        if operation is None:
            raise ImproperlyConfigured(
                f"{self.label}: cannot find the ninja operation under its run decorators; "
                "use functools.wraps in the decorators given to decorate_view."
            )
        operation.view_func = _protected(operation, self.func, self.given, self.label)
        operation._get_values = _deferred(operation._get_values)  # type: ignore[method-assign]
        # A Mapping, not a dict: ninja only iterates and indexes it (deep_dict_update).
        operation.openapi_extra = _SchemaExtra(  # type: ignore[assignment]
            operation, self.given, self.label, self.extra
        )
        return run


def _operation_of(run: Any) -> Operation | None:
    while run is not None:
        owner = getattr(run, "__self__", None)
        if isinstance(owner, Operation):
            return owner
        run = getattr(run, "__wrapped__", None)
    return None


# The keyword under which ``_deferred`` hands ninja's input validation to ``_protected``.
_DEFERRED = "_idempotency_deferred_values"


def _deferred(get_values: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """The clone's ``_get_values`` (ninja's input validation), put off until the protected
    function runs it, inside the claim: its 422 is then stored like any other answer."""

    def defer(request: HttpRequest, path_params: Any, temporal: HttpResponse) -> dict[str, Any]:
        return {_DEFERRED: functools.partial(get_values, request, path_params, temporal)}

    return defer


def _protected(
    operation: Operation, func: Callable[..., Any], given: dict[str, Any], label: str
) -> Callable[..., Any]:
    """``func`` claimed, validated, run and rendered by ``operation``, its response stored."""
    options = _options(given, label)

    def validated(values: dict[str, Any]) -> dict[str, Any]:
        resolve = values.get(_DEFERRED)
        return resolve() if resolve is not None else values

    def render(request: HttpRequest, values: dict[str, Any], result: Any) -> HttpResponseBase:
        response_arg = operation.signature.response_arg
        temporal: HttpResponse = (
            values[response_arg]
            if response_arg
            else operation.api.create_temporal_response(request)
        )
        return operation._result_to_response(request, result, temporal)

    if iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_view(request: HttpRequest, **values: Any) -> HttpResponseBase:

            async def call_view() -> HttpResponseBase:
                try:
                    inputs = validated(values)
                    return render(request, inputs, await func(request, **inputs))
                except Exception as exc:  # ninja's handlers answer it, or it propagates
                    return answered(exc, operation.api.on_exception(request, exc))

            errors = functools.partial(error_response, operation, request)
            return await aprotect(request, call_view, options, errors)

        return async_view

    @functools.wraps(func)
    def view(request: HttpRequest, **values: Any) -> HttpResponseBase:

        def call_view() -> HttpResponseBase:
            try:
                inputs = validated(values)
                return render(request, inputs, func(request, **inputs))
            except Exception as exc:  # ninja's handlers answer it, or it propagates
                return answered(exc, operation.api.on_exception(request, exc))

        return protect(
            request, call_view, options, functools.partial(error_response, operation, request)
        )

    return view


# -- under IdempotencyMiddleware -------------------------------------------------------------

# Set on a request by the middleware: protect it in the operation, after ninja's auth.
UNDER_MIDDLEWARE = "_idempotency_under_middleware"
_hooking = threading.Lock()


def protect_under_middleware(view: Callable[..., Any]) -> bool:
    """Make the operations behind one ninja URL view protect the requests that
    ``IdempotencyMiddleware`` hands them; ``False`` when ``view`` is not one we can read.

    django-ninja authenticates inside its view, so a claim in the middleware would come
    before that authentication (every caller anonymous). Instead each operation's function
    is wrapped, once, as ``@idempotent`` would wrap it, and protects a request only when the
    middleware marked it (``UNDER_MIDDLEWARE``): the middleware still decides per request
    (``METHODS``, ``EXEMPT_URL_NAMES``, ``ENABLED``), and without it nothing changes.
    Operations that protect themselves (``@idempotent``, ``IdempotentRouter``), are
    ``@idempotency_exempt``, or stream their response are left as they are.
    """
    path_view = None
    for cell in getattr(view, "__closure__", None) or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # pragma: no cover - an empty cell
            continue
        if isinstance(contents, PathView):
            path_view = contents
    if path_view is None:
        return False
    with _hooking:
        for operation in path_view.operations:
            func = operation.view_func
            if (
                operation.__dict__.get(UNDER_MIDDLEWARE)
                or _MARK in getattr(func, "__dict__", {})
                or getattr(func, "idempotency_exempt", False)
                or operation.stream_format is not None
            ):
                continue
            operation.view_func = _when_marked(operation, func)
            operation.__dict__[UNDER_MIDDLEWARE] = True
    return True


def _when_marked(operation: Operation, func: Callable[..., Any]) -> Callable[..., Any]:
    label = f"IdempotencyMiddleware on ninja operation {getattr(func, '__qualname__', func)}"
    protected = _protected(operation, func, {}, label)

    if iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_view(request: HttpRequest, **values: Any) -> Any:
            if request.__dict__.get(UNDER_MIDDLEWARE):
                return await protected(request, **values)
            return await func(request, **values)

        return async_view

    @functools.wraps(func)
    def view(request: HttpRequest, **values: Any) -> Any:
        if request.__dict__.get(UNDER_MIDDLEWARE):
            return protected(request, **values)
        return func(request, **values)

    return view


def error_response(
    operation: Operation, request: HttpRequest, error: IdempotencyError
) -> HttpResponseBase:
    """The response for one of the app's own errors (400, 403, 409, 413, 422, 503).

    ``application/problem+json`` (RFC 9457), the same body as ``@idempotent`` views, unless
    the API has an exception handler of its own for the error's class (or for
    ``IdempotencyError``): then the project's format, as a custom ``EXCEPTION_HANDLER`` does
    with the DRF mixin, with ``Retry-After`` kept.
    """
    handlers = getattr(operation.api, "_exception_handlers", {})
    mro = type(error).__mro__
    for klass in mro[: mro.index(IdempotencyError) + 1]:  # not ninja's handler of Exception
        if klass in handlers:
            response: HttpResponseBase = handlers[klass](request, error)
            if error.retry_after is not None:
                response["Retry-After"] = str(error.retry_after)
            return response
    return problem_response(error)


class _SchemaExtra(Mapping[str, Any]):
    """The operation's ``openapi_extra``: the contract, built when the schema is generated,
    with the author's own ``openapi_extra`` merged over it."""

    def __init__(
        self,
        operation: Operation,
        given: dict[str, Any],
        label: str,
        own: Mapping[str, Any] | None,
    ) -> None:
        self.operation = operation
        self.given = given
        self.label = label
        self.own = dict(own or {})

    def _build(self) -> dict[str, Any]:
        options = _options(self.given, self.label)
        if not any(options.protects(method) for method in self.operation.methods):
            return dict(self.own)
        ttl = options.pick("ttl_seconds")
        declared = [s for s in self.operation.response_models if isinstance(s, int)]
        # The author's openapi_extra first, so that its responses get the contract too.
        extra = copy.deepcopy(self.own)
        responses = extra.setdefault("responses", {})
        for status in declared:
            responses.setdefault(status, {})
        return contract.document(
            extra,
            required=bool(options.pick("required")),
            ttl=None if ttl is None else float(ttl),
            stored=status_predicate(options.pick("store_statuses")),
        )

    def __getitem__(self, name: str) -> Any:
        return self._build()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._build())

    def __len__(self) -> int:
        return len(self._build())


__all__ = ["IdempotentRouter", "auth_account", "idempotent", "protect_under_middleware"]
