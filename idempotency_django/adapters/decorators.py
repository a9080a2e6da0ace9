"""``@idempotent``: protect a Django view so that one Idempotency-Key runs it at most once."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, overload

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponseBase

from idempotency_django.core.options import _UNSET, VIEW, Options
from idempotency_django.core.protect import aprotect, protect
from idempotency_django.core.transactions import RequestTransactions
from idempotency_django.store.base import Store

View = TypeVar("View", bound=Callable[..., Any])


@overload
def idempotent(view: View) -> View: ...


@overload
def idempotent(
    view: None = None,
    *,
    required: bool = ...,
    methods: Iterable[str] = ...,
    mode: str = ...,
    in_flight: str = ...,
    wait_seconds: float = ...,
    lease_seconds: float = ...,
    ttl_seconds: float | None = ...,
    account: Callable[[HttpRequest], str | None] | str = ...,
    endpoint: Callable[[HttpRequest], str] | str = ...,
    fingerprint_fields: Sequence[str] | None = ...,
    fingerprint: Callable[[HttpRequest], str | bytes] | str | None = ...,
    store_statuses: Callable[[int], bool] | Iterable[int] | str = ...,
    on_store_error: str = ...,
    on_disconnect: str = ...,
    max_run_seconds: float = ...,
    max_response_bytes: int = ...,
    store: str | Store = ...,
) -> Callable[[View], View]: ...


def idempotent(view: Any = None, **kwargs: Any) -> Any:
    """Decorate a function view, sync or async (or, with ``method_decorator``, a class-based
    view's ``dispatch``). Keyword arguments override the ``IDEMPOTENCY`` setting for this
    view; each is validated as its setting is, here, naming the view (``options.Options``:
    the overloads above spell the same list out for type checkers)."""
    given = {name: value for name, value in kwargs.items() if value is not _UNSET}

    def decorator(view_func: View) -> View:
        label = f"@idempotent on {_name(view_func)}"
        _refuse_unsupported(view_func, label)
        options = Options.given(given, label, VIEW)
        transactions = RequestTransactions()
        wrapper: Callable[..., Any]
        if iscoroutinefunction(view_func):
            options.refuse_async_atomic()

            @functools.wraps(view_func)
            async def async_wrapper(
                request: HttpRequest, *args: Any, **kw: Any
            ) -> HttpResponseBase:
                _require_http_request(request, label)

                async def call_view() -> HttpResponseBase:
                    return await view_func(request, *args, **kw)  # type: ignore[no-any-return]

                return await aprotect(request, call_view, options)

            markcoroutinefunction(async_wrapper)
            wrapper = async_wrapper
        else:

            @functools.wraps(view_func)
            def sync_wrapper(request: HttpRequest, *args: Any, **kw: Any) -> HttpResponseBase:
                _require_http_request(request, label)

                def call_view() -> HttpResponseBase:
                    return view_func(request, *args, **kw)  # type: ignore[no-any-return]

                reopen = transactions.to_reopen()
                return protect(request, call_view, options, request_transactions=reopen)

            wrapper = sync_wrapper
        wrapper.__dict__["_non_atomic_requests"] = transactions
        wrapper.__dict__["idempotent_view"] = label  # what system check E011 looks for
        wrapper.__dict__["idempotency_options"] = options  # and W031 (on_store_error)
        return wrapper  # type: ignore[return-value]

    if view is not None:
        return decorator(view)
    return decorator


Exempted = TypeVar("Exempted")


def idempotency_exempt(view: Exempted) -> Exempted:
    """Leave a view out of ``IdempotencyMiddleware``'s protection: a function view (sync or
    async), a class-based view's class or ``as_view()``, or a DRF view class.

    The view is returned as it is, marked, so nothing changes when the middleware is not
    installed; a view that must never be replayed (a login, a webhook receiver that
    deduplicates by its own event id) opts out here."""
    view.idempotency_exempt = True  # type: ignore[attr-defined]
    return view


def _name(view_func: Any) -> str:
    func = getattr(view_func, "func", view_func)  # method_decorator passes a partial
    return str(getattr(func, "__qualname__", None) or repr(func))


_USE_THE_MIXIN = (
    "for Django REST framework views and viewsets, use "
    "idempotency_django.drf.IdempotentMixin (first among the bases) instead"
)


def _refuse_unsupported(view_func: Any, label: str) -> None:
    """A class (a DRF view above all) is not a view function; a method decorated directly
    gets ``self`` where the request should be; a DRF action
    wrapped by ``method_decorator`` gets DRF's ``Request`` after DRF's own dispatch. Say so
    now rather than fail with an AttributeError on the first request."""
    if isinstance(view_func, type):  # would fail later, in as_view() or the URLconf
        if _is_drf_view(view_func, instance=False):
            raise TypeError(
                f"{label}: @idempotent cannot decorate a Django REST framework view class; "
                f"{_USE_THE_MIXIN}: class {view_func.__name__}(IdempotentMixin, ...)."
            )
        raise TypeError(
            f"{label}: @idempotent decorates a view function, not a class; decorate a "
            "class-based view with method_decorator(idempotent, name='dispatch')."
        )
    bound = getattr(getattr(view_func, "func", None), "__self__", None)
    if bound is not None and _is_drf_view(bound):
        raise ImproperlyConfigured(f"{label}: {_USE_THE_MIXIN}.")
    try:
        parameters = list(inspect.signature(view_func, follow_wrapped=False).parameters)
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return
    if parameters and parameters[0] == "self":
        raise ImproperlyConfigured(
            f"{label}: a method takes self before the request. Decorate a class-based view "
            f"with method_decorator(idempotent, name='dispatch'); {_USE_THE_MIXIN}."
        )


def _require_http_request(request: Any, label: str) -> None:
    # DRF's Request wraps the HttpRequest: a project that renders DRF responses itself
    # may call a decorated function with it (see the test kit).
    if not isinstance(request, HttpRequest) and not isinstance(
        getattr(request, "_request", None), HttpRequest
    ):
        raise ImproperlyConfigured(
            f"{label} was called with {type(request).__name__}, not an HttpRequest: "
            f"{_USE_THE_MIXIN}."
        )


def _is_drf_view(obj: Any, *, instance: bool = True) -> bool:
    return any(
        klass.__module__ == "rest_framework.views" and klass.__name__ == "APIView"
        for klass in (type(obj) if instance else obj).__mro__
    )
