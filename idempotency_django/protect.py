"""Protect one HTTP request: the flow that the decorator (and other adapters) share.

Parse the key, scope it, fingerprint the request, then either replay, reject, or claim the
key and run the view, storing or releasing its outcome according to the transaction mode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured, RequestDataTooBig
from django.db import DatabaseError, connections, transaction
from django.http import HttpRequest, HttpResponse, HttpResponseBase

from idempotency_django import engine, keys, signals
from idempotency_django.conf import (
    IN_FLIGHT_POLICIES,
    MODES,
    STORE_ERROR_POLICIES,
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
    StoreUnavailable,
)
from idempotency_django.heartbeat import heartbeat
from idempotency_django.models import ACCOUNT_MAX_LENGTH, ENDPOINT_MAX_LENGTH, IdempotencyRecord
from idempotency_django.responses import StoredResponse, capture, problem_response, replay

logger = logging.getLogger("idempotency_django")

ViewCall = Callable[[], HttpResponseBase]

_UNSET: Any = object()


@dataclass(frozen=True)
class ViewOptions:
    """Per-view overrides; anything left unset falls back to the ``IDEMPOTENCY`` setting
    at request time."""

    required: bool = _UNSET
    methods: Iterable[str] = _UNSET
    mode: str = _UNSET
    in_flight: str = _UNSET
    wait_seconds: float = _UNSET
    lease_seconds: float = _UNSET
    ttl_seconds: float = _UNSET
    account: Callable[[HttpRequest], str | None] | str = _UNSET
    endpoint: Callable[[HttpRequest], str] | str = _UNSET
    fingerprint_fields: Sequence[str] | None = None
    fingerprint: Callable[[HttpRequest], str | bytes] | str | None = None
    store_statuses: Callable[[int], bool] | Iterable[int] | str = _UNSET
    on_store_error: str = _UNSET

    def __post_init__(self) -> None:
        for name, allowed in (
            ("mode", MODES),
            ("in_flight", IN_FLIGHT_POLICIES),
            ("on_store_error", STORE_ERROR_POLICIES),
        ):
            value = getattr(self, name)
            if value is not _UNSET and value not in allowed:
                raise ImproperlyConfigured(
                    f"@idempotent({name}={value!r}): expected one of {', '.join(allowed)}"
                )
        if self.fingerprint_fields is not None and self.fingerprint is not None:
            raise ImproperlyConfigured(
                "@idempotent: give fingerprint_fields or fingerprint, not both"
            )

    def pick(self, name: str, setting: str) -> Any:
        value = getattr(self, name)
        return conf.get(setting) if value is _UNSET else value

    def protects(self, method: str | None) -> bool:
        methods = self.pick("methods", "METHODS")
        return conf.ENABLED and (method or "").upper() in {m.upper() for m in methods}

    def mode_for(self) -> str:
        mode = self.pick("mode", "MODE")
        return str(mode)


def protect(request: HttpRequest, call_view: ViewCall, options: ViewOptions) -> HttpResponseBase:
    """Run ``call_view`` at most once per key, or answer without running it."""
    try:
        prepared = _prepare(request, options)
    except IdempotencyError as error:
        return problem_response(error)
    if prepared is None:
        return call_view()
    scope, fingerprint = prepared
    alias = engine.store_alias()
    engine_options = engine.Options(
        alias=alias,
        lease=float(options.pick("lease_seconds", "LEASE_SECONDS")),
        ttl=float(options.pick("ttl_seconds", "TTL_SECONDS")),
        in_flight=str(options.pick("in_flight", "IN_FLIGHT")),
        wait_seconds=float(options.pick("wait_seconds", "WAIT_SECONDS")),
        retry_after=conf.RETRY_AFTER_SECONDS,
    )
    connection = connections[alias]
    mode = options.mode_for()
    if mode == "commit" and connection.in_atomic_block:
        # The claim cannot commit on its own inside somebody else's transaction. The unique
        # index still serialises duplicates (they wait for this transaction), so single-flight
        # holds, but with the semantics of atomic mode: say so rather than pretend.
        logger.warning(
            "Idempotency MODE 'commit' inside an open transaction on %r: running in atomic "
            "mode for this request. Use @transaction.non_atomic_requests or MODE 'atomic'.",
            alias,
        )
        mode = "atomic"
    store_statuses = status_predicate(options.pick("store_statuses", "STORE_STATUSES"))
    if mode == "atomic":
        return _run_atomic(scope, fingerprint, engine_options, call_view, store_statuses, options)
    return _run_commit(scope, fingerprint, engine_options, call_view, store_statuses, options)


def _prepare(request: HttpRequest, options: ViewOptions) -> tuple[engine.Scope, str] | None:
    raw = request.headers.get(conf.HEADER)
    if raw is None:
        if options.pick("required", "REQUIRED"):
            raise KeyMissing(f"This endpoint requires an {conf.HEADER} header.")
        return None
    key = keys.parse_key(raw)
    account = resolve_callable(options.pick("account", "ACCOUNT"), "ACCOUNT")(request)
    if account is None:
        if conf.ANONYMOUS == "bypass":
            return None
        raise AnonymousNotAllowed("Authenticate to use an Idempotency-Key on this endpoint.")
    endpoint = resolve_callable(options.pick("endpoint", "ENDPOINT"), "ENDPOINT")(request)
    fingerprint_callable = resolve_callable(conf.get("FINGERPRINT"), "FINGERPRINT")
    body = options.fingerprint
    try:
        fingerprint = fingerprint_callable(
            request,
            endpoint,
            fields=options.fingerprint_fields,
            body=resolve_callable(body, "fingerprint") if body is not None else None,
        )
    except RequestDataTooBig as exc:
        raise BodyTooLarge("The request body is larger than DATA_UPLOAD_MAX_MEMORY_SIZE.") from exc
    scope = engine.Scope(
        account=keys.fit(str(account), ACCOUNT_MAX_LENGTH),
        endpoint=keys.fit(endpoint, ENDPOINT_MAX_LENGTH),
        key=key,
    )
    return scope, fingerprint


class _StoreFailed(Exception):
    """The store raised while claiming; carried out of any transaction before it is handled."""


def _begin(
    scope: engine.Scope, fingerprint: str, options: engine.Options
) -> engine.Claim | HttpResponseBase:
    """``engine.begin`` as a claim or a response to send instead of running the view."""
    try:
        began = engine.begin(scope, fingerprint, options)
    except IdempotencyError as error:
        return problem_response(error)
    except DatabaseError as error:
        raise _StoreFailed from error
    if isinstance(began, StoredResponse):
        return replay(began)
    return began


def _store_failed(view_options: ViewOptions, call_view: ViewCall) -> HttpResponseBase:
    policy = view_options.pick("on_store_error", "ON_STORE_ERROR")
    logger.exception("Idempotency store unavailable while claiming a key (fail %s).", policy)
    if policy == "open":
        return call_view()
    return problem_response(
        StoreUnavailable(
            "The request was not processed; retry it with the same Idempotency-Key.",
            retry_after=conf.RETRY_AFTER_SECONDS,
        )
    )


def _run_commit(
    scope: engine.Scope,
    fingerprint: str,
    options: engine.Options,
    call_view: ViewCall,
    store_statuses: Callable[[int], bool],
    view_options: ViewOptions,
) -> HttpResponseBase:
    """Claim, commit, work: the claim and the completion are short transactions of their own."""
    try:
        began = _begin(scope, fingerprint, options)
    except _StoreFailed:
        return _store_failed(view_options, call_view)
    if isinstance(began, HttpResponseBase):
        return began
    claim = began
    heartbeat.register(claim, options.lease, conf.MAX_RUN_SECONDS)
    try:
        if connections[options.alias].settings_dict.get("ATOMIC_REQUESTS"):
            # The decorator opted this view out of ATOMIC_REQUESTS for the store's database
            # so that the claim could commit first; give the view its transaction back, and
            # commit the completion together with the view's work, or neither.
            with transaction.atomic(using=options.alias):
                response = call_view()
                if not _finish(claim, response, store_statuses):
                    transaction.set_rollback(True, using=options.alias)
                    return problem_response(
                        InFlight(
                            "This request lost its claim to a retry and was rolled back.",
                            retry_after=options.retry_after,
                        )
                    )
                return response
        response = call_view()
    except BaseException:
        _release_quietly(claim)
        raise
    finally:
        heartbeat.unregister(claim)
    _finish(claim, response, store_statuses)
    return response


def _run_atomic(
    scope: engine.Scope,
    fingerprint: str,
    options: engine.Options,
    call_view: ViewCall,
    store_statuses: Callable[[int], bool],
    view_options: ViewOptions,
) -> HttpResponseBase:
    """Claim, view and completion in one transaction: a duplicate waits on the unique index
    until this one commits (then replays) or rolls back (then runs)."""
    try:
        with transaction.atomic(using=options.alias):
            began = _begin(scope, fingerprint, options)
            if isinstance(began, HttpResponseBase):
                return began
            response = call_view()
            if store_statuses(response.status_code):
                _finish(began, response, store_statuses)
            else:
                # A failed outcome rolls back with its work, so that a retry starts clean.
                transaction.set_rollback(True, using=options.alias)
                signals.released.send(IdempotencyRecord, **scope.lookup())
            return response
    except _StoreFailed:
        return _store_failed(view_options, call_view)


def _finish(
    claim: engine.Claim, response: HttpResponseBase, store_statuses: Callable[[int], bool]
) -> bool:
    """Store a definitive outcome or release the claim. False when the claim was lost."""
    if not store_statuses(response.status_code):
        _release_quietly(claim)
        return True
    storable = (
        isinstance(response, HttpResponse) and len(response.content) <= conf.MAX_RESPONSE_BYTES
    )
    if not storable:
        logger.warning(
            "Idempotency response not stored (streaming or over MAX_RESPONSE_BYTES); "
            "a retry will be told the request was processed.",
            extra={"idempotency_key": claim.scope.key},
        )
    outcome = (
        capture(response)
        if isinstance(response, HttpResponse) and storable
        else (StoredResponse(response.status_code, b""))
    )
    try:
        return engine.complete(claim, outcome, body_stored=storable)
    except DatabaseError:
        logger.exception(
            "Idempotency store unavailable while completing a key: the view ran and its "
            "response is sent, but the record stays in progress until its lease lapses.",
            extra={"idempotency_key": claim.scope.key},
        )
        return True


def _release_quietly(claim: engine.Claim) -> None:
    try:
        engine.release(claim)
    except DatabaseError:
        logger.exception(
            "Idempotency store unavailable while releasing a key; it frees itself when its "
            "lease lapses.",
            extra={"idempotency_key": claim.scope.key},
        )
