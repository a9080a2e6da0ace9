"""System checks: a misconfigured ``IDEMPOTENCY`` setting, view, middleware or codec is
reported at startup, not at the first duplicate request in production. Every check id, its
meaning and its fix: docs/checks.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils.module_loading import import_string

from idempotency_django.conf import (
    CHOICES,
    DEFAULTS,
    DURATIONS,
    HTTP_METHODS,
    MAX_DURATION_SECONDS,
    MAX_WAIT_SECONDS,
    MINIMUMS,
    NULLABLE,
    SAFE_METHODS,
    SWITCHES,
    conf,
    is_list_of_names,
    is_number,
    not_status_codes,
    problem,
    resolve_callable,
    status_predicate,
    too_long,
)
from idempotency_django.core import codecs
from idempotency_django.core.responses import BODY_LENGTH_HEADERS, NEVER_STORED_HEADERS

NUMBERS = tuple(MINIMUMS)
CALLABLES = ("ACCOUNT", "ENDPOINT", "FINGERPRINT")
LISTS_OF_NAMES = {
    "METHODS": '["POST", "PATCH"]',
    "STORED_HEADERS": '["X-Request-Id"]',
    "EXEMPT_URL_NAMES": '["admin:*", "login"]',
}


def register() -> None:
    checks.register(check_settings, "idempotency_django")
    checks.register(check_drf_views, checks.Tags.urls)
    checks.register(check_middleware, "idempotency_django")
    checks.register(check_hidden_drf_views, checks.Tags.urls)
    checks.register(check_drf_view_attributes, checks.Tags.urls)
    checks.register(check_codec_settings, "idempotency_django")
    checks.register(check_fail_open, "idempotency_django", checks.Tags.urls)
    checks.register(check_store_eviction, "idempotency_django")
    checks.register(check_metrics, "idempotency_django")


def check_settings(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    user = getattr(settings, "IDEMPOTENCY", {})
    if not isinstance(user, dict):
        return [
            checks.Error(
                "IDEMPOTENCY must be a dict.",
                hint="Set IDEMPOTENCY = {...} with the keys listed in docs/settings.md.",
                id="idempotency_django.E001",
            )
        ]
    values = {**DEFAULTS, **user}
    errors: list[checks.CheckMessage] = [
        checks.Warning(
            f"IDEMPOTENCY has an unknown key {name!r}; it is ignored.",
            hint=f"Known keys: {', '.join(sorted(DEFAULTS))}.",
            id="idempotency_django.W001",
        )
        for name in sorted(set(user) - set(DEFAULTS))
    ]
    for name, allowed in CHOICES.items():
        if values[name] not in allowed:
            errors.append(
                checks.Error(
                    f"IDEMPOTENCY[{name!r}] is {values[name]!r}.",
                    hint=f"Use one of: {', '.join(allowed)}.",
                    id="idempotency_django.E002",
                )
            )
    bad_numbers = [
        name
        for name in NUMBERS
        if not _is_duration(values[name]) and not (name in NULLABLE and values[name] is None)
    ]
    for name in bad_numbers:
        errors.append(
            checks.Error(
                f"IDEMPOTENCY[{name!r}] is {values[name]!r}, not a number of zero or more.",
                hint="Give a number (seconds, or bytes for MAX_RESPONSE_BYTES).",
                id="idempotency_django.E003",
            )
        )
    for name in DURATIONS:
        if too_long(name, values[name]):
            errors.append(
                checks.Error(
                    f"IDEMPOTENCY[{name!r}] is {values[name]!r}, longer than 100 years "
                    f"({MAX_DURATION_SECONDS} s): it cannot be added to the current time on "
                    "every store.",
                    hint="Give at most 100 years"
                    + (", or None to keep keys forever." if name == "TTL_SECONDS" else "."),
                    id="idempotency_django.E028",
                )
            )
    if not {"LEASE_SECONDS", "TTL_SECONDS", "MAX_RUN_SECONDS"} & set(bad_numbers):
        errors.extend(_check_durations(values))
    errors.extend(_check_exhaustion(values, bad_numbers))
    for name in CALLABLES:
        errors.extend(_check_callable(name, resolve_callable, values[name]))
    if values["TENANT"] is not None:
        errors.extend(_check_callable("TENANT", resolve_callable, values["TENANT"]))
    errors.extend(_check_scopes(values))
    errors.extend(_check_store_statuses(values["STORE_STATUSES"]))
    for name, example in LISTS_OF_NAMES.items():
        if not is_list_of_names(values[name]):
            errors.append(
                checks.Error(
                    f"IDEMPOTENCY[{name!r}] is {values[name]!r}, not a list of names.",
                    hint=f"Give a list or tuple of strings, e.g. {example}.",
                    id="idempotency_django.E010",
                )
            )
    errors.extend(_check_switches_and_names(values))
    stored = values["STORED_HEADERS"] if is_list_of_names(values["STORED_HEADERS"]) else ()
    forbidden = [name for name in stored if name.lower() in NEVER_STORED_HEADERS]
    if forbidden:
        errors.append(
            checks.Error(
                f"IDEMPOTENCY['STORED_HEADERS'] names {', '.join(forbidden)}.",
                hint="Cookies and credentials belong to one exchange and are never replayed.",
                id="idempotency_django.E007",
            )
        )
    lengths = [name for name in stored if name.lower() in BODY_LENGTH_HEADERS]
    if lengths:
        errors.append(
            checks.Warning(
                f"IDEMPOTENCY['STORED_HEADERS'] names {', '.join(lengths)}, which is never "
                "stored: a replay's length is that of the body it sends.",
                hint="Remove it: a redacted body is shorter than the first one, and the "
                "server counts the bytes a replay sends.",
                id="idempotency_django.W041",
            )
        )
    if values["DATABASE"] is not None and values["DATABASE"] not in connections:
        errors.append(
            checks.Error(
                f"IDEMPOTENCY['DATABASE'] is {values['DATABASE']!r}, which is not in DATABASES.",
                hint="Name a database alias, or None to follow the database routers.",
                id="idempotency_django.E008",
            )
        )
    errors.extend(_check_store(values))
    return errors


def _check_store(values: dict[str, Any]) -> list[checks.CheckMessage]:
    """E019: a ``STORE`` that cannot be loaded; E025: ``MODE`` atomic with a store outside
    the database; then the store's own checks of ``STORE_OPTIONS`` (``check_options``)."""
    from idempotency_django.store.base import CountsInUse, get_store

    try:
        store = get_store(values["STORE"]) if isinstance(values["STORE"], str) else None
    except Exception as exc:  # an import error, or a store that refuses its options
        store, problem_text = None, str(exc)
    else:
        problem_text = "" if store is not None else "not a dotted path"
    if store is None:
        return [
            checks.Error(
                f"IDEMPOTENCY['STORE'] is {values['STORE']!r}: {problem_text}.",
                hint=(
                    "Give the dotted path of a store class: "
                    "'idempotency_django.store.database.DatabaseStore' (the default) or "
                    "'idempotency_django.store.redis.RedisStore' (pip install "
                    "'idempotency-django[redis]')."
                ),
                id="idempotency_django.E019",
            )
        ]
    errors: list[checks.CheckMessage] = []
    if values["MODE"] == "atomic" and not store.transactional:
        errors.append(
            checks.Error(
                f"IDEMPOTENCY['MODE'] is 'atomic' with {type(store).__name__}: no transaction "
                "spans that store and the database.",
                hint="Use MODE 'commit' with this store, or the database store for atomic mode.",
                id="idempotency_django.E025",
            )
        )
    if values["MAX_IN_FLIGHT_PER_ACCOUNT"] is not None and not isinstance(store, CountsInUse):
        errors.append(
            checks.Error(
                f"IDEMPOTENCY['MAX_IN_FLIGHT_PER_ACCOUNT'] is set, but {type(store).__name__} "
                "cannot count an account's requests in progress.",
                hint="Use the database store for the quota, or set it to None.",
                id="idempotency_django.E042",
            )
        )
    check_options = getattr(store, "check_options", None)
    if check_options is not None:
        errors.extend(check_options(values["STORE_OPTIONS"]))
    return errors


def _check_scopes(values: dict[str, Any]) -> list[checks.CheckMessage]:
    """E030: a ``NAMESPACE_PRINCIPALS`` that is not a bool; W030: a project that looks
    multi-tenant (docs/security.md, "Who shares a scope") with keys scoped as if it were not."""
    errors: list[checks.CheckMessage] = []
    if not isinstance(values["NAMESPACE_PRINCIPALS"], bool):
        errors.append(
            checks.Error(
                f"IDEMPOTENCY['NAMESPACE_PRINCIPALS'] is {values['NAMESPACE_PRINCIPALS']!r}, "
                "not True or False.",
                hint="Until it is a bool, principals are not namespaced (only True turns it on).",
                id="idempotency_django.E030",
            )
        )
    scoped_by_default = (
        values["TENANT"] is None
        and values["ACCOUNT"] == DEFAULTS["ACCOUNT"]
        and values["ENDPOINT"] == DEFAULTS["ENDPOINT"]
    )
    signs = _tenancy_signs() if scoped_by_default else []
    if signs:
        errors.append(
            checks.Warning(
                f"This project looks multi-tenant ({'; '.join(signs)}), but Idempotency-Keys "
                "are scoped by account and endpoint only: a user in two tenants is replayed "
                "one tenant's answer for the other's request with the same key.",
                hint="Set IDEMPOTENCY['TENANT'] (e.g. 'idempotency_django.keys.request_host', "
                "or a callable returning request.tenant's id), or silence "
                "idempotency_django.W030 if one host serves one tenant.",
                id="idempotency_django.W030",
            )
        )
    return errors


def _check_exhaustion(values: dict[str, Any], bad_numbers: list[str]) -> list[checks.CheckMessage]:
    """E040: a wait longer than ``MAX_WAIT_SECONDS``; E041: a quota that is not a whole
    number of at least 1."""
    errors: list[checks.CheckMessage] = []
    if "WAIT_SECONDS" not in bad_numbers and values["WAIT_SECONDS"] > MAX_WAIT_SECONDS:
        errors.append(
            checks.Error(
                f"IDEMPOTENCY['WAIT_SECONDS'] is {values['WAIT_SECONDS']!r}, over "
                f"{MAX_WAIT_SECONDS:g} s.",
                hint="A waiting request holds a worker thread and its connections, and its "
                "client has given up long before: wait a few seconds, then answer 409.",
                id="idempotency_django.E040",
            )
        )
    quota = values["MAX_IN_FLIGHT_PER_ACCOUNT"]
    if problem("MAX_IN_FLIGHT_PER_ACCOUNT", quota) is not None:
        errors.append(
            checks.Error(
                f"IDEMPOTENCY['MAX_IN_FLIGHT_PER_ACCOUNT'] is {quota!r}.",
                hint="Give None (no bound) or a whole number of at least 1, e.g. 20.",
                id="idempotency_django.E041",
            )
        )
    return errors


def _tenancy_signs() -> list[str]:
    """What makes a project look multi-tenant: an installed app or a middleware named for
    tenants (django-tenants, django-tenant-schemas, a project's own), or ``ALLOWED_HOSTS``
    taking every subdomain of a domain."""
    signs = [
        f"INSTALLED_APPS has {name}"
        for name in getattr(settings, "INSTALLED_APPS", ())
        if "tenant" in str(name).lower()
    ]
    signs += [
        f"MIDDLEWARE has {path}"
        for path in getattr(settings, "MIDDLEWARE", None) or ()
        if "tenant" in str(path).lower()
    ]
    signs += [
        f"ALLOWED_HOSTS has {host!r}"
        for host in getattr(settings, "ALLOWED_HOSTS", ())
        if isinstance(host, str) and host.startswith(".")
    ]
    return signs


def check_store_eviction(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """W040: a Redis store whose server may evict records (``maxmemory-policy`` other than
    ``noeviction``). Silent where the server does not tell (``eviction_policy``)."""
    from idempotency_django.store.base import get_store

    if not isinstance(getattr(settings, "IDEMPOTENCY", {}), dict):
        return []  # reported as E001
    try:
        store = get_store()
    except ImproperlyConfigured:
        return []  # reported as E019
    read = getattr(store, "eviction_policy", None)
    policy = read() if read is not None else None
    if policy is None or policy == "noeviction":
        return []
    return [
        checks.Warning(
            f"The Redis store's server has maxmemory-policy {policy!r}: when it runs out of "
            "memory it evicts keys, idempotency records among them, and a retry of an "
            "evicted key runs the work again.",
            hint="Give the store a Redis of its own with maxmemory-policy noeviction (a full "
            "Redis then refuses new claims, answered 503, instead of forgetting old ones).",
            id="idempotency_django.W040",
        )
    ]


def _is_duration(value: Any) -> bool:
    return is_number(value) and value >= 0


def _check_switches_and_names(values: dict[str, Any]) -> list[checks.CheckMessage]:
    """E014, E015, E016, W005: the values that, wrong, would switch protection off or
    leave it on nothing, without a word (a header no request can carry, a method typo)."""
    errors: list[checks.CheckMessage] = []
    for name in SWITCHES:
        if not isinstance(values[name], bool):
            errors.append(
                checks.Error(
                    f"IDEMPOTENCY[{name!r}] is {values[name]!r}, not True or False.",
                    hint='A string such as "no" or "false" is not False: convert it, '
                    f'e.g. os.environ.get("...") == "1". Until then {name} counts as True.',
                    id="idempotency_django.E014",
                )
            )
    for name in ("HEADER", "REPLAY_HEADER"):
        if problem(name, values[name]) is not None:
            errors.append(
                checks.Error(
                    f"IDEMPOTENCY[{name!r}] is {values[name]!r}, not an HTTP header name "
                    "Django can read.",
                    hint="Letters, digits and !#$%&'*+-.^`|~ only: no spaces, and no "
                    "underscores (Django reads them as '-', servers drop them); e.g. "
                    f"{DEFAULTS[name]!r}.",
                    id="idempotency_django.E015",
                )
            )
    methods = values["METHODS"] if is_list_of_names(values["METHODS"]) else ()
    unknown = [method for method in methods if method.upper() not in HTTP_METHODS]
    if unknown:
        errors.append(
            checks.Error(
                f"IDEMPOTENCY['METHODS'] names {', '.join(map(repr, unknown))}, not an HTTP "
                "method: no request is protected by it.",
                hint=f"Use methods among {', '.join(HTTP_METHODS)}, e.g. "
                '["POST", "PATCH"] (add "PUT" for non-idempotent PUTs).',
                id="idempotency_django.E016",
            )
        )
    safe = [method for method in methods if method.upper() in SAFE_METHODS]
    if safe:
        errors.append(
            checks.Warning(
                f"IDEMPOTENCY['METHODS'] names {', '.join(safe)}, safe methods: a keyed "
                "request claims a key and stores a response that needs neither.",
                hint="Protect the methods that change state: POST, PATCH (PUT, DELETE).",
                id="idempotency_django.W005",
            )
        )
    return errors


def _check_store_statuses(value: Any) -> list[checks.CheckMessage]:
    """E017 for a list holding something that is not a status code; E009 for a callable
    (or dotted path) that cannot be loaded."""
    if not isinstance(value, Iterable) or isinstance(value, str):
        return _check_callable("STORE_STATUSES", status_predicate, value)
    wrong = not_status_codes(value)
    if not wrong:
        return []
    return [
        checks.Error(
            f"IDEMPOTENCY['STORE_STATUSES'] holds {', '.join(map(repr, wrong))}: not an HTTP "
            "status code.",
            hint="List status codes from 100 to 599, e.g. [200, 201, 400, 404], or give a "
            "predicate (status) -> bool or its dotted path.",
            id="idempotency_django.E017",
        )
    ]


def _check_durations(values: dict[str, Any]) -> list[checks.CheckMessage]:
    errors: list[checks.CheckMessage] = []
    if values["LEASE_SECONDS"] < 1:
        errors.append(
            checks.Error(
                f"IDEMPOTENCY['LEASE_SECONDS'] is {values['LEASE_SECONDS']}, shorter than 1 s.",
                hint="The lease is renewed every third of itself; below 1 s renewals "
                "cannot keep up with a busy database.",
                id="idempotency_django.E004",
            )
        )
    ttl = values["TTL_SECONDS"]
    if ttl is None:
        errors.append(
            checks.Warning(
                "IDEMPOTENCY['TTL_SECONDS'] is None: records are kept forever, and "
                "purge_idempotency_keys will never find one to delete.",
                hint="Set a TTL (Stripe keeps keys 24 hours) so the table stays bounded.",
                id="idempotency_django.W003",
            )
        )
    elif ttl < values["LEASE_SECONDS"]:
        errors.append(
            checks.Error(
                "IDEMPOTENCY['TTL_SECONDS'] is shorter than LEASE_SECONDS.",
                hint="A key must be kept at least as long as a claim on it can last.",
                id="idempotency_django.E005",
            )
        )
    elif ttl < 60:
        errors.append(
            checks.Warning(
                f"IDEMPOTENCY['TTL_SECONDS'] is {ttl}, under a minute.",
                hint="Clients retry after timeouts of 30-60 s and more; a key forgotten "
                "before its retry arrives runs the view again.",
                id="idempotency_django.W002",
            )
        )
    if values["MAX_RUN_SECONDS"] < values["LEASE_SECONDS"]:
        errors.append(
            checks.Error(
                "IDEMPOTENCY['MAX_RUN_SECONDS'] is shorter than LEASE_SECONDS.",
                hint="MAX_RUN_SECONDS bounds how long a running view keeps its key; make it "
                "longer than the slowest honest request.",
                id="idempotency_django.E006",
            )
        )
    return errors


def _check_callable(
    name: str, resolve: Callable[[Any, str], Any], value: Any
) -> list[checks.CheckMessage]:
    try:
        resolve(value, name)
    except (ImproperlyConfigured, TypeError, ValueError) as exc:
        return [
            checks.Error(
                str(exc),
                hint=f"IDEMPOTENCY[{name!r}] takes a callable or its dotted path.",
                id="idempotency_django.E009",
            )
        ]
    return []


def check_drf_views(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """E011: ``@idempotent`` (through ``method_decorator``) on a DRF view's method.

    It either claims before DRF authenticates (``dispatch``: every request is anonymous) or
    is handed DRF's ``Request`` with an unrendered response (an action). The mixin is the
    supported way; say so at startup rather than at the first protected request.
    """
    try:
        from rest_framework.views import APIView
    except ImportError:  # pragma: no cover - DRF is optional
        return []

    errors: list[checks.CheckMessage] = []
    seen: set[type] = set()
    for entry in url_patterns():
        cls = getattr(entry.callback, "cls", None)
        if not isinstance(cls, type) or not issubclass(cls, APIView) or cls in seen:
            continue
        seen.add(cls)
        decorated = sorted(
            name
            for name in dir(cls)
            if "idempotent_view" in getattr(getattr(cls, name, None), "__dict__", {})
        )
        if decorated:
            errors.append(
                checks.Error(
                    f"{cls.__module__}.{cls.__qualname__}.{decorated[0]} is decorated with "
                    "@idempotent; on a Django REST framework view it claims before DRF's "
                    "authentication or stores an unrendered response.",
                    hint="Remove the decorator and use idempotency_django.drf.IdempotentMixin "
                    "(first among the bases); idempotency_actions chooses the actions.",
                    obj=cls,
                    id="idempotency_django.E011",
                )
            )
    return errors


def url_patterns() -> Iterator[URLPattern]:
    """Every pattern of ``ROOT_URLCONF``, for the checks that look at routed views. None
    without a ``ROOT_URLCONF``: a worker's settings (Celery, a queue consumer) have no URLs,
    and Django's own URL checks skip them too."""
    if not getattr(settings, "ROOT_URLCONF", None):
        return
    pending: list[Any] = list(get_resolver().url_patterns)
    while pending:
        entry = pending.pop()
        if isinstance(entry, URLResolver):
            pending.extend(entry.url_patterns)
        elif isinstance(entry, URLPattern):  # pragma: no branch - nothing else is routed
            yield entry


IDEMPOTENCY_MIDDLEWARE = "idempotency_django.middleware.IdempotencyMiddleware"
AUTHENTICATION_MIDDLEWARE = "django.contrib.auth.middleware.AuthenticationMiddleware"
DEFAULT_ACCOUNT = DEFAULTS["ACCOUNT"]


def check_middleware(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """E012, E013, W004: where ``IdempotencyMiddleware`` sits in ``MIDDLEWARE``.

    Before ``AuthenticationMiddleware`` every plain view's request is anonymous to it (403,
    or unscoped with ANONYMOUS="bypass"); before a middleware that has ``process_view`` (the
    CSRF check) that method never runs for a protected view, which answers from the
    middleware. Without the auth middleware at all, the default ACCOUNT finds no user on a
    plain view's request (DRF views authenticate themselves, so that is a warning).
    """
    middleware = [str(path) for path in getattr(settings, "MIDDLEWARE", None) or ()]
    if IDEMPOTENCY_MIDDLEWARE not in middleware:
        return []
    position = middleware.index(IDEMPOTENCY_MIDDLEWARE)
    errors: list[checks.CheckMessage] = []
    if AUTHENTICATION_MIDDLEWARE in middleware[position + 1 :]:
        errors.append(
            checks.Error(
                f"{IDEMPOTENCY_MIDDLEWARE} comes before {AUTHENTICATION_MIDDLEWARE}.",
                hint="Move it after AuthenticationMiddleware (best: last in MIDDLEWARE), so "
                "that keys are scoped to the authenticated user.",
                id="idempotency_django.E012",
            )
        )
    elif AUTHENTICATION_MIDDLEWARE not in middleware and _uses_default_account():
        errors.append(
            checks.Warning(
                f"{IDEMPOTENCY_MIDDLEWARE} is installed without {AUTHENTICATION_MIDDLEWARE}.",
                hint="Plain Django views will have no request.user, so every key they get "
                "is refused as anonymous (DRF views authenticate themselves). Add "
                "AuthenticationMiddleware before it, or set IDEMPOTENCY['ACCOUNT'].",
                id="idempotency_django.W004",
            )
        )
    later = [path for path in middleware[position + 1 :] if _has_process_view(path)]
    if later:
        errors.append(
            checks.Error(
                f"{IDEMPOTENCY_MIDDLEWARE} comes before {', '.join(later)}, whose "
                "process_view would not run for a protected view.",
                hint="Put IdempotencyMiddleware after every middleware that has a "
                "process_view (CsrfViewMiddleware above all); last in MIDDLEWARE is safe.",
                id="idempotency_django.E013",
            )
        )
    return errors


def check_hidden_drf_views(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """E027: under ``IdempotencyMiddleware``, a routed callback that hides the DRF view behind
    it: a decorator that keeps ``__wrapped__`` but not the view's attributes (``cls``), as
    ``functools.wraps`` would copy them.

    The middleware tells a DRF view by its ``cls``, and has it claim inside DRF's
    ``initial()``, after DRF's authentication. A callback that hides it is protected as a
    plain view: claimed before DRF authenticates its caller (a token user is anonymous then).
    """
    middleware = [str(path) for path in getattr(settings, "MIDDLEWARE", None) or ()]
    if IDEMPOTENCY_MIDDLEWARE not in middleware:
        return []
    try:
        from rest_framework.views import APIView
    except ImportError:  # pragma: no cover - DRF is optional
        return []
    errors: list[checks.CheckMessage] = []
    for entry in url_patterns():
        callback = entry.callback
        if isinstance(getattr(callback, "cls", None), type):
            continue  # the middleware sees it (a DRF view, or a class-based view)
        inner = getattr(callback, "__wrapped__", None)
        for _ in range(100):  # a cycle of __wrapped__ is not ours to loop on
            if inner is None:
                break
            cls = getattr(inner, "cls", None)
            if isinstance(cls, type) and issubclass(cls, APIView):
                errors.append(
                    checks.Error(
                        f"The URL pattern {str(entry.pattern)!r} routes to "
                        f"{cls.__module__}.{cls.__qualname__} through a decorator that hides "
                        "it: IdempotencyMiddleware would protect it as a plain view, and "
                        "claim before DRF authenticates the caller.",
                        hint="Write the decorator with functools.wraps (which copies the "
                        "view's cls), or give the view IdempotentMixin, or exempt it "
                        "(EXEMPT_URL_NAMES, @idempotency_exempt).",
                        obj=callback,
                        id="idempotency_django.E027",
                    )
                )
                break
            inner = getattr(inner, "__wrapped__", None)
    return errors


def _uses_default_account() -> bool:
    user = getattr(settings, "IDEMPOTENCY", {})
    return not isinstance(user, dict) or user.get("ACCOUNT", DEFAULT_ACCOUNT) == DEFAULT_ACCOUNT


def _has_process_view(path: str) -> bool:
    try:
        middleware = import_string(path)
    except ImportError:
        return False  # Django reports a middleware it cannot import itself
    return callable(getattr(middleware, "process_view", None))


def check_drf_view_attributes(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """E018: a routed DRF view whose ``idempotency_*`` configuration names nothing.

    A misspelled attribute (``idempotency_mod``) leaves the view on the defaults, and a
    misspelled action in ``idempotency_actions`` (``{"craete"}``) leaves that action
    unprotected; neither fails a request. A class with the mixin is refused when it is
    created; this also covers views that only ``IdempotencyMiddleware`` protects.
    """
    try:
        from rest_framework.views import APIView
        from rest_framework.viewsets import ViewSetMixin

        from idempotency_django.adapters.drf import unknown_attributes, viewset_actions
    except ImportError:  # pragma: no cover - DRF is optional
        return []
    served: dict[type, set[str]] = {}
    for entry in url_patterns():
        cls = getattr(entry.callback, "cls", None)
        if isinstance(cls, type) and issubclass(cls, APIView):
            actions = getattr(entry.callback, "actions", None) or {}
            served.setdefault(cls, set()).update(actions.values())
    errors: list[checks.CheckMessage] = []
    for cls, actions in sorted(served.items(), key=lambda item: item[0].__qualname__):
        name = f"{cls.__module__}.{cls.__qualname__}"
        for attribute in unknown_attributes(cls):
            errors.append(
                checks.Error(
                    f"{name} has {attribute!r}, which idempotency_django does not read.",
                    hint="Check the spelling against the idempotency_* attributes and "
                    "get_idempotency_* hooks of idempotency_django.drf.IdempotentMixin.",
                    obj=cls,
                    id="idempotency_django.E018",
                )
            )
        wanted = getattr(cls, "idempotency_actions", None)
        if wanted is None or isinstance(wanted, (str, bytes)) or not issubclass(cls, ViewSetMixin):
            continue
        known = actions | viewset_actions(cls)
        for action in sorted(set(wanted) - known):
            errors.append(
                checks.Error(
                    f"{name}.idempotency_actions names {action!r}, which is not an action "
                    "of this viewset: no request to it would be protected.",
                    hint=f"Its actions: {', '.join(sorted(known)) or 'none'}.",
                    obj=cls,
                    id="idempotency_django.E018",
                )
            )
    return errors


# -- fail-open (ON_STORE_ERROR "open") ---------------------------------------------------------

FAIL_OPEN_HINT = (
    "'open' trades at-most-once for availability: while the store cannot be reached, a "
    "request runs its view without a claim, so a retry or a duplicate then runs it again "
    "(a second charge), and nothing is stored to replay. Only a store that cannot be "
    "reached fails open (never a timeout, a full pool, a server at its connection limit or "
    "contention), but whoever can cut the store off decides when views run unprotected. "
    "Keep 'closed' (the default: 503 with Retry-After) for views whose effects must not "
    "repeat; where the trade is meant, add this id to SILENCED_SYSTEM_CHECKS."
)


def check_fail_open(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """W031: ``ON_STORE_ERROR`` "open", in the setting or on a routed view (``@idempotent``
    or a DRF view's ``idempotency_on_store_error``), which says what "open" gives up."""
    user = getattr(settings, "IDEMPOTENCY", {})
    warnings: list[checks.CheckMessage] = []
    if isinstance(user, dict) and user.get("ON_STORE_ERROR") == "open":
        warnings.append(
            checks.Warning(
                "IDEMPOTENCY['ON_STORE_ERROR'] is 'open': views run unprotected while the "
                "store cannot be reached.",
                hint=FAIL_OPEN_HINT,
                id="idempotency_django.W031",
            )
        )
    seen: set[object] = set()
    for entry in url_patterns():
        view = getattr(entry.callback, "cls", None) or entry.callback
        if view in seen:
            continue
        seen.add(view)
        if isinstance(view, type):
            policy = getattr(view, "idempotency_on_store_error", None)
        else:
            options = getattr(view, "idempotency_options", None)
            policy = getattr(options, "on_store_error", None)
        if policy == "open":
            name = f"{getattr(view, '__module__', '?')}.{getattr(view, '__qualname__', view)}"
            warnings.append(
                checks.Warning(
                    f"{name} has on_store_error='open': it runs unprotected while the store "
                    "cannot be reached.",
                    hint=FAIL_OPEN_HINT,
                    obj=view,
                    id="idempotency_django.W031",
                )
            )
    return warnings


# -- the response codec and the hooks (codecs.py) -------------------------------------------


def check_codec_settings(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """A codec that cannot load, keys that cannot encrypt, hooks that cannot be called:
    reported at startup, rather than as unstored responses after views have run."""
    if not isinstance(getattr(settings, "IDEMPOTENCY", {}), dict):
        return []  # reported as E001
    errors: list[checks.CheckMessage] = []
    for name in codecs.HOOKS:
        value = conf.get(name)
        if value is None or value == DEFAULTS[name]:
            continue  # the admin's defaults import the admin: only where it is installed
        try:
            conf.optional_callable(name)
        except ImproperlyConfigured as error:
            errors.append(
                checks.Error(
                    str(error),
                    hint="Give a callable or its dotted path, or None.",
                    id="idempotency_django.E024",
                )
            )
    errors.extend(_check_codec())
    return errors


def _check_codec() -> list[checks.CheckMessage]:
    if conf.RESPONSE_CODEC is None:
        warnings: list[checks.CheckMessage] = []
        if conf.ENCRYPTION_KEYS:
            warnings.append(
                checks.Warning(
                    "IDEMPOTENCY ENCRYPTION_KEYS is set, but RESPONSE_CODEC is not: stored "
                    "responses are not encrypted.",
                    hint='Set RESPONSE_CODEC to "idempotency_django.codecs.FernetCodec".',
                    id="idempotency_django.W020",
                )
            )
        if conf.get("REQUIRE_BOUND_RESPONSES") is True:
            warnings.append(
                checks.Warning(
                    "IDEMPOTENCY REQUIRE_BOUND_RESPONSES is True, but RESPONSE_CODEC is not "
                    "set: responses are stored in clear, bound to nothing, and replayed.",
                    hint="Set RESPONSE_CODEC (it binds every response it seals to its "
                    "record), or leave REQUIRE_BOUND_RESPONSES out.",
                    id="idempotency_django.W021",
                )
            )
        return warnings
    try:
        codec = codecs.get_codec()
        assert codec is not None
        probe = b"idempotency-django codec check"
        if codec.decode(codec.encode(probe)) != probe:
            return [
                checks.Error(
                    "IDEMPOTENCY RESPONSE_CODEC does not decode what it encodes.",
                    hint="decode(encode(data)) must give data back.",
                    id="idempotency_django.E023",
                )
            ]
    except codecs.CryptographyMissing as error:
        return [
            checks.Error(
                str(error),
                hint='pip install "idempotency-django[encryption]"',
                id="idempotency_django.E021",
            )
        ]
    except codecs.EncryptionKeysInvalid as error:
        return [
            checks.Error(
                str(error),
                hint="Generate a key with: python -c 'from cryptography.fernet import "
                "Fernet; print(Fernet.generate_key().decode())' and keep it out of the "
                "repository (an environment variable or a secrets manager).",
                id="idempotency_django.E022",
            )
        ]
    except Exception as error:
        return [
            checks.Error(
                f"IDEMPOTENCY RESPONSE_CODEC cannot be used: {error}",
                hint="A codec class or object with encode(bytes) and decode(bytes), or its "
                "dotted path.",
                id="idempotency_django.E020",
            )
        ]
    return []


def check_metrics(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """``METRICS`` names known exporters (E061), each with its extra installed (E060), and
    ``LOG_REQUESTS`` is a bool (E061)."""
    from idempotency_django.conf import METRICS_EXPORTERS, metrics_exporters, problem

    user = getattr(settings, "IDEMPOTENCY", {})
    if not isinstance(user, dict):
        return []  # E001
    errors: list[checks.CheckMessage] = []
    for name in ("METRICS", "LOG_REQUESTS"):
        if name in user and problem(name, user[name]) is not None:
            errors.append(
                checks.Error(
                    f"IDEMPOTENCY[{name!r}] is {user[name]!r}: {problem(name, user[name])}.",
                    hint="METRICS: None, "
                    + ", ".join(repr(name) for name in METRICS_EXPORTERS)
                    + ", or a list of them; LOG_REQUESTS: True or False.",
                    id="idempotency_django.E061",
                )
            )
    for exporter in metrics_exporters(user.get("METRICS")) or ():
        module = EXPORTER_MODULES[exporter]
        try:
            importlib.import_module(module)
        except ImportError:
            errors.append(
                checks.Error(
                    f"IDEMPOTENCY['METRICS'] asks for {exporter}, but {module} cannot be imported.",
                    hint=f"pip install 'idempotency-django[{exporter}]'.",
                    id="idempotency_django.E060",
                )
            )
    return errors


# The module each exporter needs (its extra installs it).
EXPORTER_MODULES = {"prometheus": "prometheus_client", "opentelemetry": "opentelemetry.metrics"}
