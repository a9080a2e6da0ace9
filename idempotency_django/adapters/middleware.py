"""``IdempotencyMiddleware``: protect every unsafe request of a project, not view by view.

It claims in ``process_view``, around the view alone (so ``request.user`` is set, as for
``@idempotent``), and always runs the callback Django resolved (decorators a URLconf wrapped
around the view included) through the same adapters as the decorator, the DRF mixin (after
DRF's own authentication) and django-ninja (after ninja's); none of the policy is decided
here. It hands the shell the ``ATOMIC_REQUESTS`` aliases Django would have wrapped. What
it protects and leaves alone, nested layers, ordering and async: ``docs/middleware.md``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asgiref.sync import async_to_sync, iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponseBase
from django.utils.module_loading import import_string

from idempotency_django.conf import conf
from idempotency_django.core.options import Options
from idempotency_django.core.protect import aprotect, protect
from idempotency_django.core.transactions import request_transactions

GetResponse = Callable[[HttpRequest], Any]
View = Callable[..., Any]

# What the middleware does with one view, decided once per view function.
_NINJA_VIEWS = "ninja.operation"  # the module of every view django-ninja routes to
_LEAVE = "leave"  # exempt, or protected by its own decorator or mixin
_PLAIN = "plain"  # a Django view: the middleware protects it
_NINJA = "ninja"  # a django-ninja view: marked here, claimed by its operation after ninja's auth
_DRF = "drf"  # a DRF view without the mixin: marked here, claimed in DRF's initial()


@dataclass(frozen=True)
class _Plan:
    action: str
    options: Options | None = None
    exempt_methods: frozenset[str] = frozenset()  # whose handler is @idempotency_exempt


_ANONYMOUS = (
    "Authenticate to use an Idempotency-Key on this endpoint. (IdempotencyMiddleware claims "
    "before the view runs, for the user of the authentication middleware listed before it; "
    "a view that authenticates inside itself needs @idempotent under its own authentication.)"
)

_plans: weakref.WeakKeyDictionary[Any, _Plan] = weakref.WeakKeyDictionary()
# The settings alone, for the "applies?" answer before a view's plan is looked up.
_SETTINGS = Options(label="IdempotencyMiddleware")


class IdempotencyMiddleware:
    """Protect requests whose method is in ``METHODS`` on every view not exempted.

    Place it after ``AuthenticationMiddleware`` and after every middleware that has a
    ``process_view`` (``CsrfViewMiddleware``): a protected view is answered from here,
    so the ``process_view`` of a middleware listed later would not run: the server
    refuses to start then (and system check E013 says so); E012 checks the first.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: GetResponse) -> None:
        _refuse_unsafe_position(type(self))
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        self.process_view: Callable[..., Any]
        if self.async_mode:
            markcoroutinefunction(self)
            self.process_view = self._aprocess_view
        else:
            self.process_view = self._process_view

    def __call__(self, request: HttpRequest) -> Any:
        return self.get_response(request)

    # -- sync (WSGI) ------------------------------------------------------------------------

    def _process_view(
        self, request: HttpRequest, view: View, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> HttpResponseBase | None:
        plan = _plan_for(request, view)
        if plan is None:
            return None
        assert plan.options is not None
        call_view = functools.partial(view, request, *args, **kwargs)
        if plan.action == _DRF:
            _mark_for_drf(request, view, plan.options)
            if iscoroutinefunction(view):
                return async_to_sync(call_view)()  # type: ignore[no-any-return]
            return call_view()  # type: ignore[no-any-return]
        if iscoroutinefunction(view):
            return async_to_sync(aprotect)(request, call_view, plan.options)
        return _protect_view(request, view, call_view, plan.options)

    # -- async (ASGI) -----------------------------------------------------------------------

    async def _aprocess_view(
        self, request: HttpRequest, view: View, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> HttpResponseBase | None:
        plan = _plan_for(request, view)
        if plan is None:
            return None
        assert plan.options is not None
        call_view = functools.partial(view, request, *args, **kwargs)
        if plan.action == _DRF:
            _mark_for_drf(request, view, plan.options)
            if iscoroutinefunction(view):
                return await call_view()  # type: ignore[no-any-return]
            return await sync_to_async(call_view, thread_sensitive=True)()  # type: ignore[no-any-return]
        if iscoroutinefunction(view):
            return await aprotect(request, call_view, plan.options)
        return await sync_to_async(_protect_view, thread_sensitive=True)(
            request, view, call_view, plan.options
        )


def _protect_view(
    request: HttpRequest, view: View, call_view: Callable[[], Any], options: Options
) -> HttpResponseBase:
    """A sync view protected, its ``ATOMIC_REQUESTS`` aliases read in its own thread."""
    return protect(request, call_view, options, request_transactions=request_transactions(view))


def _mark_for_drf(request: HttpRequest, view: View, options: Options) -> None:
    """Have the DRF view inside ``view`` claim after DRF's authentication (its ``initial``),
    in the ``ATOMIC_REQUESTS`` transactions Django would have opened around ``view``: the
    middleware calls ``view`` itself, so Django opens none around the claim."""
    from idempotency_django.adapters.drf import MiddlewareMark, mark_for_middleware

    mark_for_middleware(request, MiddlewareMark(options, request_transactions(view)))


def _mark_for_ninja(request: HttpRequest) -> None:
    from idempotency_django.adapters.ninja import UNDER_MIDDLEWARE

    request.__dict__[UNDER_MIDDLEWARE] = True


def _refuse_unsafe_position(middleware: type) -> None:
    """Refuse to start below a middleware that has a ``process_view``.

    A protected view is answered from this ``process_view``, so theirs would never run:
    listed after it, ``CsrfViewMiddleware`` lets a keyed POST without a token through.
    System checks say so, but servers do not run checks; Django builds the middleware
    chain when the server starts (from the last entry up), so this is that moment.
    """
    entries = [str(path) for path in getattr(settings, "MIDDLEWARE", None) or ()]
    position = next(
        (index for index, path in enumerate(entries) if _imported(path) is middleware), None
    )
    if position is None:  # built by hand (a test, a wrapper): nothing to compare with
        return
    later = [path for path in entries[position + 1 :] if _has_process_view(_imported(path))]
    if later:
        raise ImproperlyConfigured(
            f"{entries[position]} comes before {', '.join(later)} in MIDDLEWARE, whose "
            "process_view would never run for a view it protects (a CSRF check skipped). "
            "Put it after every middleware that has a process_view: last in MIDDLEWARE "
            "is safe."
        )


def _imported(path: str) -> Any:
    try:
        return import_string(path)
    except ImportError:  # Django reports a middleware it cannot import itself
        return None


def _has_process_view(middleware: Any) -> bool:
    return middleware is not None and callable(getattr(middleware, "process_view", None))


# -- deciding what to do with a view -------------------------------------------------------


def _plan_for(request: HttpRequest, view: View) -> _Plan | None:
    """The plan for this request, or ``None`` when the middleware leaves it to Django: not
    protected here, a django-ninja operation (marked, to claim after ninja's auth), or an
    async view under ``ATOMIC_REQUESTS`` (which Django refuses with its own error)."""
    if not _SETTINGS.protects(request.method):  # before any other work
        return None
    if _exempt_by_name(request):
        return None
    try:
        plan = _plans[view]
    except KeyError:
        plan = _plans[view] = _make_plan(view)
    except TypeError:  # pragma: no cover - a callable that cannot be weakly referenced
        plan = _make_plan(view)
    if plan.action == _LEAVE or (request.method or "").upper() in plan.exempt_methods:
        return None
    if plan.action == _NINJA:
        _mark_for_ninja(request)
        return None  # Django calls the view: ninja authenticates, the operation claims
    if plan.action == _PLAIN and iscoroutinefunction(view) and request_transactions(view):
        return None  # Django refuses ATOMIC_REQUESTS on async views: let it say so
    return plan


def _exempt_by_name(request: HttpRequest) -> bool:
    match = request.resolver_match  # set by Django before any process_view
    name = match.view_name if match is not None else ""
    for pattern in conf.EXEMPT_URL_NAMES:
        if pattern == name or (pattern.endswith(":*") and name.startswith(pattern[:-1])):
            return True
    return False


def _make_plan(view: View) -> _Plan:
    cls = getattr(view, "cls", None) or getattr(view, "view_class", None)
    if _marked(view, "idempotency_exempt") or _marked(cls, "idempotency_exempt"):
        return _Plan(_LEAVE)
    if _marked(view, "idempotent_view") or _has_protected_method(cls):
        return _Plan(_LEAVE)
    if getattr(view, "__module__", None) == _NINJA_VIEWS:
        # django-ninja authenticates inside its view, like DRF: a claim here would come
        # before that authentication. Its operations claim, after ninja's auth, the
        # requests this middleware marks (idempotency_django.ninja).
        from idempotency_django.adapters.ninja import protect_under_middleware

        if not protect_under_middleware(view):
            raise ImproperlyConfigured(
                f"IdempotencyMiddleware cannot find the django-ninja operations behind "
                f"{_name(view)} to protect them (an unsupported django-ninja version?). "
                "Protect them with idempotency_django.ninja.IdempotentRouter, or exempt the "
                "API's URL names in IDEMPOTENCY['EXEMPT_URL_NAMES']."
            )
        return _Plan(_NINJA)
    exempt = _exempt_methods(view, cls)
    label = f"IdempotencyMiddleware on {_name(view)}"
    drf = _drf_classes()
    if drf is not None and isinstance(cls, type) and issubclass(cls, drf[0]):
        if issubclass(cls, drf[1]):
            return _Plan(_LEAVE)
        # Marked, and claimed by DRF's initial() inside the callback Django resolved: never
        # a view rebuilt from ``cls``, which would skip what a URLconf wrapped around it.
        from idempotency_django.adapters.drf import ANONYMOUS_DETAIL

        options = Options(label=label, anonymous_detail=ANONYMOUS_DETAIL)
        return _Plan(_DRF, options=options, exempt_methods=exempt)
    options = Options(label=label, anonymous_detail=_ANONYMOUS)
    return _Plan(_PLAIN, options=options, exempt_methods=exempt)


def _marked(obj: Any, marker: str) -> bool:
    return obj is not None and bool(getattr(obj, marker, False))


def _exempt_methods(view: View, cls: Any) -> frozenset[str]:
    """The HTTP methods whose handler is marked ``@idempotency_exempt``: a class-based
    view's ``post``, or a viewset's action (``create``, an ``@action``) bound to a method."""
    if not isinstance(cls, type):
        return frozenset()
    actions = getattr(view, "actions", None)  # a viewset: method -> action name
    handlers = (
        actions if actions is not None else {m: m for m in getattr(cls, "http_method_names", ())}
    )
    return frozenset(
        method.upper()
        for method, handler in handlers.items()
        if _marked(getattr(cls, handler, None), "idempotency_exempt")
    )


def _has_protected_method(cls: Any) -> bool:
    """A class-based view whose ``dispatch`` or handler is decorated with
    ``method_decorator(idempotent, ...)``: it protects itself."""
    if not isinstance(cls, type):
        return False
    return any(
        "idempotent_view" in getattr(getattr(cls, name, None), "__dict__", {})
        for name in ("dispatch", *getattr(cls, "http_method_names", ()))
    )


def _drf_classes() -> tuple[type, type] | None:
    try:
        from rest_framework.views import APIView

        from idempotency_django.adapters.drf import IdempotentMixin
    except ImportError:  # pragma: no cover - DRF is optional
        return None
    return APIView, IdempotentMixin


def _name(view: Any) -> str:
    return str(getattr(view, "__qualname__", None) or repr(view))


__all__ = ["IdempotencyMiddleware"]
