"""Protect one HTTP request: what the decorator and the DRF mixin share.

Parse the key, scope it, fingerprint the request, and hand the view to the one lifecycle
(``lifecycle.py``), which decides everything else. This module only translates: a request
into a scope, a fingerprint and a policy; a response into an outcome to store; and the
lifecycle's result back into a response.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

from django.core.exceptions import ImproperlyConfigured, RequestDataTooBig
from django.core.signals import setting_changed
from django.db import connections
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.template.response import SimpleTemplateResponse

from idempotency_django import claims, keys, lifecycle, signals
from idempotency_django.conf import (
    check_argument,
    check_durations,
    conf,
    resolve_callable,
    status_predicate,
)
from idempotency_django.exceptions import (
    AnonymousNotAllowed,
    BodyTooLarge,
    IdempotencyError,
    InFlight,
    KeyMissing,
)
from idempotency_django.models import ACCOUNT_MAX_LENGTH, ENDPOINT_MAX_LENGTH
from idempotency_django.responses import StoredResponse, capture, problem_response, replay
from idempotency_django.store.base import Store, check_store, get_store

logger = logging.getLogger("idempotency_django")

ViewCall = Callable[[], HttpResponseBase]
AsyncViewCall = Callable[[], Awaitable[HttpResponseBase]]
ErrorResponse = Callable[[IdempotencyError], HttpResponseBase]

_UNSET: Any = object()

# ViewOptions field → the setting it overrides, for the ones validated as their setting is.
_VALIDATED = {
    "required": "REQUIRED",
    "methods": "METHODS",
    "mode": "MODE",
    "in_flight": "IN_FLIGHT",
    "wait_seconds": "WAIT_SECONDS",
    "lease_seconds": "LEASE_SECONDS",
    "ttl_seconds": "TTL_SECONDS",
    "max_run_seconds": "MAX_RUN_SECONDS",
    "on_store_error": "ON_STORE_ERROR",
    "on_disconnect": "ON_DISCONNECT",
}


@dataclass(frozen=True)
class ViewOptions:
    """Per-view overrides; anything left unset falls back to the ``IDEMPOTENCY`` setting
    at request time. Every value is validated as its setting is, when the view is
    decorated (or the DRF view class is created), naming the view."""

    required: bool = _UNSET
    methods: Iterable[str] = _UNSET
    mode: str = _UNSET
    in_flight: str = _UNSET
    wait_seconds: float = _UNSET
    lease_seconds: float = _UNSET
    ttl_seconds: float | None = _UNSET
    max_run_seconds: float = _UNSET
    # Callables take the request the adapter has: an HttpRequest, or DRF's Request.
    account: Callable[[Any], str | None] | str = _UNSET
    endpoint: Callable[[Any], str] | str = _UNSET
    fingerprint_fields: Sequence[str] | None = None
    fingerprint: Callable[[Any], str | bytes | None] | str | None = None
    store_statuses: Callable[[int], bool] | Iterable[int] | str = _UNSET
    on_store_error: str = _UNSET
    key: Callable[[Any], str | None] | None = None
    on_disconnect: str = _UNSET
    store: str | Store = _UNSET  # a dotted path to a store class, or a store
    label: str = "@idempotent"
    # The 403's detail: where the account comes from differs per adapter (set by each).
    anonymous_detail: str = (
        "Authenticate to use an Idempotency-Key on this endpoint. (If the view does "
        "authenticate, apply its authentication outside @idempotent, so that it runs first.)"
    )

    def __post_init__(self) -> None:
        for name, setting in _VALIDATED.items():
            value = getattr(self, name)
            if value is not _UNSET:
                check_argument(setting, value, self.label)
        durations = {
            name: getattr(self, name)
            for name in ("lease_seconds", "ttl_seconds", "max_run_seconds")
            if getattr(self, name) is not _UNSET
        }
        if durations:
            check_durations(durations, self.label)
        if self.store_statuses is not _UNSET:
            try:
                status_predicate(self.store_statuses, "store_statuses")
            except (ImproperlyConfigured, TypeError, ValueError) as error:
                raise ImproperlyConfigured(f"{self.label}: {error}") from error
        if self.store is not _UNSET:
            check_store(self.store, self.mode, self.label)
        if self.fingerprint_fields is not None and self.fingerprint is not None:
            raise ImproperlyConfigured(
                f"{self.label}: give fingerprint_fields or fingerprint, not both"
            )

    def pick(self, name: str, setting: str) -> Any:
        value = getattr(self, name)
        return conf.get(setting) if value is _UNSET else value

    def checked(self, name: str, setting: str) -> Any:
        """``pick``, with the setting refused as its system check refuses it (the view's
        own value was checked when it was declared): see ``conf.checked``."""
        value = getattr(self, name)
        return conf.checked(setting) if value is _UNSET else value

    def resolved(self) -> Resolved:
        """This view's settings, resolved on first use and kept until a setting changes
        (``setting_changed``: ``override_settings`` and pytest-django's ``settings`` send
        it), rather than looked up in ``settings.IDEMPOTENCY`` a score of times per request."""
        cached = self.__dict__.get("_resolved")
        if cached is None or cached.generation != _settings_generation:
            cached = Resolved(self, _settings_generation)
            object.__setattr__(self, "_resolved", cached)  # frozen: a cache, not a field
        return cached

    def protects(self, method: str | None) -> bool:
        resolved = self.resolved()
        return resolved.enabled and (method or "").upper() in resolved.methods

    def raw_key(self, request: HttpRequest) -> str | None:
        """The unparsed key: the ``HEADER`` header, or what the ``key`` callable returns."""
        if self.key is not None:
            return self.key(request)
        return request.headers.get(self.resolved().header)

    def policy(self) -> lifecycle.Policy:
        return self.resolved().policy(claims.store_alias())


_settings_generation = 0


def _settings_changed(**kwargs: Any) -> None:
    global _settings_generation
    _settings_generation += 1


setting_changed.connect(_settings_changed, dispatch_uid="idempotency_django.protect")


class Resolved:
    """One view's options merged with the ``IDEMPOTENCY`` setting. Cheap values are read
    at once; callables are imported on first use (a bad dotted path raises then, on every
    request, as before); the policy is built once per store alias. The alias itself is
    looked up per request (``claims.store_alias``): a database router may depend on the
    request (a tenant), so it is never cached."""

    def __init__(self, options: ViewOptions, generation: int) -> None:
        self.options = options
        self.generation = generation
        self.enabled = conf.ENABLED
        self.methods = frozenset(m.upper() for m in options.checked("methods", "METHODS"))
        self.header = conf.HEADER
        # Only False lets a keyless request through unprotected (a non-bool setting is E014).
        self.required = options.pick("required", "REQUIRED") is not False
        self.anonymous = conf.ANONYMOUS
        self.max_response_bytes = int(conf.checked("MAX_RESPONSE_BYTES"))
        conf.checked("STORED_HEADERS")  # read after the work, by capture: refused before it
        self._policies: dict[str, lifecycle.Policy] = {}

    @cached_property
    def account(self) -> Callable[..., Any]:
        return resolve_callable(self.options.pick("account", "ACCOUNT"), "ACCOUNT")

    @cached_property
    def endpoint(self) -> Callable[..., Any]:
        return resolve_callable(self.options.pick("endpoint", "ENDPOINT"), "ENDPOINT")

    @cached_property
    def fingerprint(self) -> Callable[..., Any]:
        return resolve_callable(conf.get("FINGERPRINT"), "FINGERPRINT")

    @cached_property
    def body(self) -> Callable[..., Any] | None:
        body = self.options.fingerprint
        return resolve_callable(body, "fingerprint") if body is not None else None

    @cached_property
    def store_statuses(self) -> Callable[[int], bool]:
        return status_predicate(self.options.pick("store_statuses", "STORE_STATUSES"))

    def policy(self, alias: str) -> lifecycle.Policy:
        policy = self._policies.get(alias)
        if policy is None:
            policy = self._policies[alias] = self._policy(alias)
        return policy

    def _policy(self, alias: str) -> lifecycle.Policy:
        return policy_for(self.options.checked, alias, self.options.label)


def policy_for(pick: Callable[[str, str], Any], alias: str, label: str) -> lifecycle.Policy:
    """The per-run policy, for views and tasks alike: ``pick(option, setting)`` is the
    view's or task's own value, or the setting refused as its system check refuses it.
    An own ``ttl_seconds=None`` keeps keys forever, as ``TTL_SECONDS = None`` does."""
    ttl = pick("ttl_seconds", "TTL_SECONDS")
    store = get_store(pick("store", "STORE"))
    mode = str(pick("mode", "MODE"))
    if mode == "atomic" and not store.transactional:
        raise ImproperlyConfigured(
            f"{label}: mode 'atomic' needs a store in the database (no transaction spans "
            f"{type(store).__name__} and the database): use MODE 'commit' with this store."
        )
    return lifecycle.Policy(
        claiming=claims.ClaimPolicy(
            alias=alias,
            lease=float(pick("lease_seconds", "LEASE_SECONDS")),
            ttl=None if ttl is None else float(ttl),
            in_flight=str(pick("in_flight", "IN_FLIGHT")),
            wait_seconds=float(pick("wait_seconds", "WAIT_SECONDS")),
            retry_after=int(conf.checked("RETRY_AFTER_SECONDS")),
            store=store,
        ),
        mode=mode,
        max_run=float(pick("max_run_seconds", "MAX_RUN_SECONDS")),
        on_store_error=str(pick("on_store_error", "ON_STORE_ERROR")),
        on_disconnect=str(pick("on_disconnect", "ON_DISCONNECT")),
        label=label,
    )


def refuse_async_atomic(options: ViewOptions) -> None:
    """An async view given ``mode="atomic"`` is refused where it is declared, naming it, by
    every adapter: Django has no async transactions, and running it in ``commit`` mode
    instead would silently drop what its author asked for."""
    if options.mode == "atomic":
        raise ImproperlyConfigured(
            f"{options.label}: mode='atomic' on an async view: Django has no async "
            "transactions; async views run in 'commit' mode."
        )


def options_from(values: dict[str, Any], label: str) -> ViewOptions:
    known = {field.name for field in fields(ViewOptions)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ImproperlyConfigured(f"{label}: unknown argument {unknown[0]!r}")
    return ViewOptions(**{**values, "label": label})


class RequestTransactions:
    """A protected view's ``_non_atomic_requests``: every database, resolved per request.

    Django would open the ``ATOMIC_REQUESTS`` transactions around the whole view, claim
    included, so that the claim could not commit first and the completion would commit
    before (or without) the work. The view opts out of all of them, and the lifecycle opens
    them again around the work, in the order that keeps a stored outcome truthful.
    Aliases that the view's author opted out (``@transaction.non_atomic_requests``) stay out.
    """

    def __init__(self, by_author: Iterable[str] = ()) -> None:
        self._by_author: set[str] = set(by_author)

    def add(self, alias: str) -> None:  # what @transaction.non_atomic_requests calls
        self._by_author.add(alias)

    def __contains__(self, alias: object) -> bool:
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(list(connections))

    def to_reopen(self) -> list[str]:
        return _atomic_requests(excluding=self._by_author)


def request_transactions(view: Any) -> list[str]:
    """The aliases whose ``ATOMIC_REQUESTS`` transaction Django would open around ``view``
    (``BaseHandler.make_view_atomic``), less those its author opted out of with
    ``@transaction.non_atomic_requests``: the ones the lifecycle opens again around the
    work. The one answer for every adapter (decorator, DRF mixin, middleware)."""
    opted_out = getattr(view, "_non_atomic_requests", ())
    if isinstance(opted_out, RequestTransactions):
        return opted_out.to_reopen()
    return _atomic_requests(excluding=opted_out)


def _atomic_requests(excluding: Collection[str]) -> list[str]:
    return [
        alias
        for alias in connections
        if alias not in excluding and connections[alias].settings_dict.get("ATOMIC_REQUESTS")
    ]


@dataclass(frozen=True)
class Guard:
    """One protected request: its scope, fingerprint and policy."""

    scope: claims.Scope
    fingerprint: str
    policy: lifecycle.Policy
    store_statuses: Callable[[int], bool]
    max_response_bytes: int = 1024 * 1024

    @classmethod
    def for_request(cls, request: HttpRequest, options: ViewOptions) -> Guard | None:
        """Parse, scope and fingerprint ``request``; ``None`` when it runs unprotected."""
        resolved = options.resolved()
        raw = options.raw_key(request)
        if raw is None:
            if resolved.required:
                raise KeyMissing(f"This endpoint requires an {resolved.header} header.")
            return None
        key = keys.parse_key(raw)
        account = resolved.account(request)
        if account is None:
            if resolved.anonymous == "bypass":
                return None
            raise AnonymousNotAllowed(options.anonymous_detail)
        endpoint = resolved.endpoint(request)
        try:
            fingerprint = resolved.fingerprint(
                request, endpoint, fields=options.fingerprint_fields, body=resolved.body
            )
        except RequestDataTooBig as exc:
            raise BodyTooLarge(
                "The request body is larger than DATA_UPLOAD_MAX_MEMORY_SIZE."
            ) from exc
        return cls(
            scope=claims.Scope(
                account=keys.fit(str(account), ACCOUNT_MAX_LENGTH),
                endpoint=keys.fit(endpoint, ENDPOINT_MAX_LENGTH),
                key=key,
            ),
            # A custom FINGERPRINT may return anything: namespaced, it is compared by
            # equality only (never as a library version) and fits its column.
            fingerprint=(
                fingerprint
                if resolved.fingerprint is keys.default_fingerprint
                else keys.custom_fingerprint(fingerprint)
            ),
            policy=resolved.policy(claims.store_alias()),
            store_statuses=resolved.store_statuses,
            max_response_bytes=resolved.max_response_bytes,
        )

    def outcome(self, response: HttpResponseBase) -> lifecycle.Outcome:
        """What to keep of the view's response: a definitive one is stored (its body only
        when it fits and is not streamed); anything else releases the key, unless it is the
        framework's answer to an error that leaves the outcome unknown (``answered``)."""
        unknown = getattr(response, _UNKNOWN, None)
        if unknown is not None:
            return lifecycle.Outcome(None, unknown=unknown)
        if not self.store_statuses(response.status_code):
            return lifecycle.Outcome(None)
        if isinstance(response, HttpResponse) and len(response.content) <= self.max_response_bytes:
            return lifecycle.Outcome(capture(response))
        logger.warning(
            "Idempotency response not stored (streaming or over MAX_RESPONSE_BYTES); "
            "a retry will be told the request was processed.",
            extra=signals.log_fields(**self.scope.lookup()),
        )
        return lifecycle.Outcome(StoredResponse(response.status_code, b""), body_stored=False)


_UNKNOWN = "_idempotency_unknown_outcome"


def answered(error: Exception, response: HttpResponseBase) -> HttpResponseBase:
    """``response``, a framework's answer (DRF's or ninja's exception handler) to ``error``
    raised by the view, marked when the error leaves the work's outcome unknown (a lost
    database connection): whatever its status, the key is then kept, not released."""
    if lifecycle.outcome_unknown(error):
        setattr(response, _UNKNOWN, error)
    return response


def protect(
    request: HttpRequest,
    call_view: ViewCall,
    options: ViewOptions,
    error_response: ErrorResponse = problem_response,
    request_transactions: Sequence[str] = (),
) -> HttpResponseBase:
    """Run ``call_view`` at most once per key, or answer without running it.

    ``error_response`` turns the app's own errors (400, 409, 422, 503 …) into responses;
    adapters pass their framework's error handling here.
    """
    try:
        guard = Guard.for_request(request, options)
    except IdempotencyError as error:
        return error_response(error)
    if guard is None:
        return lifecycle.unprotected(request_transactions, call_view)
    held = _claims_held(request)
    if guard.scope in held:
        if held[guard.scope]:
            return _ran_once(error_response)
        with _inner(held, guard.scope):
            return call_view()
    request.idempotency_scope = guard.scope  # type: ignore[attr-defined]

    def work() -> HttpResponseBase:
        with _holding(held, guard.scope):
            return _rendered(call_view())

    result = lifecycle.run(
        guard.scope, guard.fingerprint, guard.policy, work, guard.outcome, request_transactions
    )
    return respond(result, error_response)


async def aprotect(
    request: HttpRequest,
    call_view: AsyncViewCall,
    options: ViewOptions,
    error_response: ErrorResponse = problem_response,
) -> HttpResponseBase:
    """``protect`` for async views: every database call runs off the event loop."""
    from asgiref.sync import sync_to_async

    try:
        guard = await sync_to_async(Guard.for_request)(request, options)
    except IdempotencyError as error:
        return error_response(error)
    if guard is None:
        return await call_view()
    held = _claims_held(request)
    if guard.scope in held:
        if held[guard.scope]:
            return _ran_once(error_response)
        with _inner(held, guard.scope):
            return await call_view()
    request.idempotency_scope = guard.scope  # type: ignore[attr-defined]

    async def work() -> HttpResponseBase:
        with _holding(held, guard.scope):
            return await call_view()

    result = await lifecycle.arun(
        guard.scope, guard.fingerprint, guard.policy, work, _rendered_outcome(guard)
    )
    return respond(result, error_response)


# -- nested layers of one request -----------------------------------------------------------
#
# One request can meet several protecting layers: the middleware, then an ``@idempotent``
# view under a decorator that dropped its marker; a view that calls an ``@idempotent``
# function. The scopes whose claim this request holds are kept on the request while their
# work runs (the ``HttpRequest`` under DRF's ``Request``): an inner layer of the same scope
# (account, endpoint, key) runs inside the outer claim, which governs (its options, its
# stored outcome), once: layers nested in it pass too, a second call after it has returned is
# refused. A layer of another scope claims its own key, as any caller would.


def _claims_held(request: HttpRequest) -> dict[claims.Scope, bool]:
    """Scope → whether an inner layer has already run under that claim."""
    inner = getattr(request, "_request", None)
    base = inner if isinstance(inner, HttpRequest) else request
    held: dict[claims.Scope, bool] = base.__dict__.setdefault("_idempotency_claims", {})
    return held


@contextlib.contextmanager
def _holding(held: dict[claims.Scope, bool], scope: claims.Scope) -> Iterator[None]:
    held[scope] = False
    try:
        yield
    finally:
        del held[scope]


@contextlib.contextmanager
def _inner(held: dict[claims.Scope, bool], scope: claims.Scope) -> Iterator[None]:
    """An inner layer running under the outer claim; layers within it pass too (a decorated
    view calling a decorated function), but once it has returned the work is done."""
    try:
        yield
    finally:
        held[scope] = True


def _ran_once(error_response: ErrorResponse) -> HttpResponseBase:
    """A second inner run under one claim would do the work twice for one key."""
    return error_response(
        InFlight(
            "This request already ran the work of this Idempotency-Key once; a second "
            "protected call under the same claim is refused."
        )
    )


def respond(
    result: lifecycle.Result[HttpResponseBase], error_response: ErrorResponse
) -> HttpResponseBase:
    if isinstance(result, lifecycle.Replayed):
        return replay(result.stored)
    if isinstance(result, lifecycle.Refused):
        return error_response(result.error)
    return result.value


def _rendered_outcome(guard: Guard) -> Callable[[HttpResponseBase], lifecycle.Outcome]:
    def outcome(response: HttpResponseBase) -> lifecycle.Outcome:
        return guard.outcome(_rendered(response))

    return outcome


def _rendered(response: HttpResponseBase) -> HttpResponseBase:
    """Render a template response now: its bytes are what gets stored (and a rendering
    error is the view's failure, which releases the key)."""
    if isinstance(response, SimpleTemplateResponse) and not response.is_rendered:
        response.render()
    return response
