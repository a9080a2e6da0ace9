"""``@idempotent``: protect a Django view so that one Idempotency-Key runs it at most once."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar, overload

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.http import HttpRequest, HttpResponseBase

from idempotency_django import engine
from idempotency_django.protect import _UNSET, ViewOptions, aprotect, protect

View = TypeVar("View", bound=Callable[..., Any])


class _StoreAliasIfCommitMode:
    """Django's ``_non_atomic_requests`` for a protected view, resolved per request.

    In ``commit`` mode the claim must commit before the view runs, which
    ``ATOMIC_REQUESTS`` would prevent; so the view opts out for the store's database and
    ``protect`` re-opens a transaction around the view and its completion itself.
    """

    def __init__(self, options: ViewOptions, *, is_async: bool) -> None:
        self._options = options
        self._is_async = is_async  # async views always run in commit mode
        self._added: set[str] = set()

    def add(self, alias: str) -> None:  # what @transaction.non_atomic_requests calls
        self._added.add(alias)

    def __contains__(self, alias: object) -> bool:
        if alias in self._added:
            return True
        commit = self._is_async or self._options.mode_for() == "commit"
        return commit and alias == engine.store_alias()

    def __iter__(self) -> Iterator[str]:
        aliases = set(self._added)
        aliases.update(alias for alias in connections if alias in self)
        return iter(aliases)


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
    ttl_seconds: float = ...,
    account: Callable[[HttpRequest], str | None] | str = ...,
    endpoint: Callable[[HttpRequest], str] | str = ...,
    fingerprint_fields: Sequence[str] | None = ...,
    fingerprint: Callable[[HttpRequest], str | bytes] | str | None = ...,
    store_statuses: Callable[[int], bool] | Iterable[int] | str = ...,
    on_store_error: str = ...,
    on_disconnect: str = ...,
) -> Callable[[View], View]: ...


def idempotent(view: Any = None, **kwargs: Any) -> Any:
    """Decorate a function view, sync or async (or, with ``method_decorator``, a class-based
    view's ``dispatch``). Keyword arguments override the ``IDEMPOTENCY`` setting for this
    view."""
    options = ViewOptions(**{name: value for name, value in kwargs.items() if value is not _UNSET})

    def decorator(view_func: View) -> View:
        wrapper: Callable[..., Any]
        if iscoroutinefunction(view_func):
            if kwargs.get("mode") == "atomic":
                raise ImproperlyConfigured(
                    f"@idempotent(mode='atomic') on async view {view_func.__qualname__}: "
                    "Django has no async transactions; async views run in 'commit' mode."
                )

            @functools.wraps(view_func)
            async def async_wrapper(
                request: HttpRequest, *args: Any, **kw: Any
            ) -> HttpResponseBase:
                async def call_view() -> HttpResponseBase:
                    return await view_func(request, *args, **kw)  # type: ignore[no-any-return]

                if not options.protects(request.method):
                    return await call_view()
                return await aprotect(request, call_view, options)

            markcoroutinefunction(async_wrapper)
            wrapper = async_wrapper
        else:

            @functools.wraps(view_func)
            def sync_wrapper(request: HttpRequest, *args: Any, **kw: Any) -> HttpResponseBase:
                def call_view() -> HttpResponseBase:
                    return view_func(request, *args, **kw)  # type: ignore[no-any-return]

                if not options.protects(request.method):
                    return call_view()
                return protect(request, call_view, options)

            wrapper = sync_wrapper
        wrapper.__dict__["_non_atomic_requests"] = _StoreAliasIfCommitMode(
            options, is_async=iscoroutinefunction(view_func)
        )
        return wrapper  # type: ignore[return-value]

    if view is not None:
        return decorator(view)
    return decorator
