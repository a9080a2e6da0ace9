"""Protect one HTTP request: the flow that the decorator (and other adapters) share.

Parse the key, scope it, fingerprint the request, then either replay, reject, or claim the
key and run the view, storing or releasing its outcome according to the transaction mode.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured, RequestDataTooBig
from django.db import DatabaseError, InterfaceError, OperationalError, connections, transaction
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.template.response import SimpleTemplateResponse

from idempotency_django import engine, keys, signals
from idempotency_django.conf import (
    DISCONNECT_POLICIES,
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
AsyncViewCall = Callable[[], Awaitable[HttpResponseBase]]

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
    # Callables take the request the adapter has: an HttpRequest, or DRF's Request.
    account: Callable[[Any], str | None] | str = _UNSET
    endpoint: Callable[[Any], str] | str = _UNSET
    fingerprint_fields: Sequence[str] | None = None
    fingerprint: Callable[[Any], str | bytes | None] | str | None = None
    store_statuses: Callable[[int], bool] | Iterable[int] | str = _UNSET
    on_store_error: str = _UNSET
    key: Callable[[Any], str | None] | None = None
    on_disconnect: str = _UNSET

    def __post_init__(self) -> None:
        for name, allowed in (
            ("mode", MODES),
            ("in_flight", IN_FLIGHT_POLICIES),
            ("on_store_error", STORE_ERROR_POLICIES),
            ("on_disconnect", DISCONNECT_POLICIES),
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
        return str(self.pick("mode", "MODE"))

    def raw_key(self, request: HttpRequest) -> str | None:
        """The unparsed key: the ``HEADER`` header, or what the ``key`` callable returns."""
        if self.key is not None:
            return self.key(request)
        return request.headers.get(conf.HEADER)


ErrorResponse = Callable[[IdempotencyError], HttpResponseBase]


def protect(
    request: HttpRequest,
    call_view: ViewCall,
    options: ViewOptions,
    error_response: ErrorResponse = problem_response,
) -> HttpResponseBase:
    """Run ``call_view`` at most once per key, or answer without running it.

    ``error_response`` turns the app's own errors (400, 409, 422, 503 …) into responses;
    adapters pass their framework's error handling here.
    """
    try:
        guard = Guard.for_request(request, options, error_response)
    except IdempotencyError as error:
        return error_response(error)
    if guard is None:
        return call_view()
    request.idempotency_scope = guard.scope  # type: ignore[attr-defined]
    if guard.mode() == "atomic":
        return guard.run_atomic(call_view)
    return guard.run_commit(call_view)


async def aprotect(
    request: HttpRequest,
    call_view: AsyncViewCall,
    options: ViewOptions,
    error_response: ErrorResponse = problem_response,
) -> HttpResponseBase:
    """``protect`` for async views: every database call runs off the event loop.

    Always ``commit`` mode: Django has no async transactions to run a view inside.
    """
    try:
        guard = await sync_to_async(Guard.for_request)(request, options, error_response)
    except IdempotencyError as error:
        return error_response(error)
    if guard is None:
        return await call_view()
    request.idempotency_scope = guard.scope  # type: ignore[attr-defined]
    return await guard.arun_commit(call_view)


class _StoreFailed(Exception):
    """The store raised while claiming; carried out of any transaction before it is handled."""


@dataclass(frozen=True)
class Guard:
    """One protected request: its scope and fingerprint, and how to run it."""

    scope: engine.Scope
    fingerprint: str
    engine_options: engine.Options
    store_statuses: Callable[[int], bool]
    options: ViewOptions
    error_response: ErrorResponse

    @classmethod
    def for_request(
        cls, request: HttpRequest, options: ViewOptions, error_response: ErrorResponse
    ) -> Guard | None:
        """Parse, scope and fingerprint ``request``; ``None`` when it runs unprotected."""
        raw = options.raw_key(request)
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
        body = options.fingerprint
        try:
            fingerprint = resolve_callable(conf.get("FINGERPRINT"), "FINGERPRINT")(
                request,
                endpoint,
                fields=options.fingerprint_fields,
                body=resolve_callable(body, "fingerprint") if body is not None else None,
            )
        except RequestDataTooBig as exc:
            raise BodyTooLarge(
                "The request body is larger than DATA_UPLOAD_MAX_MEMORY_SIZE."
            ) from exc
        return cls(
            scope=engine.Scope(
                account=keys.fit(str(account), ACCOUNT_MAX_LENGTH),
                endpoint=keys.fit(endpoint, ENDPOINT_MAX_LENGTH),
                key=key,
            ),
            fingerprint=fingerprint,
            engine_options=engine.Options(
                alias=engine.store_alias(),
                lease=float(options.pick("lease_seconds", "LEASE_SECONDS")),
                ttl=_seconds_or_none(options.pick("ttl_seconds", "TTL_SECONDS")),
                in_flight=str(options.pick("in_flight", "IN_FLIGHT")),
                wait_seconds=float(options.pick("wait_seconds", "WAIT_SECONDS")),
                retry_after=conf.RETRY_AFTER_SECONDS,
            ),
            store_statuses=status_predicate(options.pick("store_statuses", "STORE_STATUSES")),
            options=options,
            error_response=error_response,
        )

    @property
    def alias(self) -> str:
        return self.engine_options.alias

    def mode(self) -> str:
        mode = self.options.mode_for()
        if mode == "commit" and connections[self.alias].in_atomic_block:
            # The claim cannot commit on its own inside somebody else's transaction. The
            # unique index still serialises duplicates (they wait for that transaction), so
            # single flight holds, with the semantics of atomic mode: say so, don't pretend.
            logger.warning(
                "Idempotency MODE 'commit' inside an open transaction on %r: running in "
                "atomic mode for this request. Use @transaction.non_atomic_requests or "
                "MODE 'atomic'.",
                self.alias,
            )
            return "atomic"
        return mode

    def begin(self) -> engine.Claim | HttpResponseBase:
        """``engine.begin`` as a claim or a response to send instead of running the view."""
        try:
            token = engine.new_token()  # the same on a reconnected retry: see engine.begin
            began = engine.reconnecting(
                self.alias,
                lambda: engine.begin(self.scope, self.fingerprint, self.engine_options, token),
            )
        except IdempotencyError as error:
            return self.error_response(error)
        except DatabaseError as error:
            raise _StoreFailed from error
        if isinstance(began, StoredResponse):
            return replay(began)
        return began

    def store_failed(self) -> HttpResponseBase | None:
        """The answer when the store failed during the claim; ``None``: run unprotected."""
        policy = self.options.pick("on_store_error", "ON_STORE_ERROR")
        logger.exception("Idempotency store unavailable while claiming a key (fail %s).", policy)
        signals.store_unavailable.send(IdempotencyRecord, policy=policy, **self.scope.lookup())
        if policy == "open":
            return None
        return self.error_response(
            StoreUnavailable(
                "The request was not processed; retry it with the same Idempotency-Key.",
                retry_after=conf.RETRY_AFTER_SECONDS,
            )
        )

    def run_commit(self, call_view: ViewCall) -> HttpResponseBase:
        """Claim, commit, work: claim and completion are short transactions of their own."""
        try:
            began = self.begin()
        except _StoreFailed:
            return self.store_failed() or call_view()
        if isinstance(began, HttpResponseBase):
            return began
        claim = began
        heartbeat.register(claim, self.engine_options.lease, conf.MAX_RUN_SECONDS)
        try:
            if connections[self.alias].settings_dict.get("ATOMIC_REQUESTS"):
                return self._run_in_request_transaction(claim, call_view)
            response = _rendered(call_view())
        except BaseException as error:
            _release_after(claim, error)
            raise
        finally:
            heartbeat.unregister(claim)
        self.finish(claim, response)
        return response

    def _run_in_request_transaction(
        self, claim: engine.Claim, call_view: ViewCall
    ) -> HttpResponseBase:
        # The decorator opted this view out of ATOMIC_REQUESTS for the store's database so
        # that the claim could commit first; give the view its transaction back, and commit
        # the completion together with the view's work, or neither.
        with transaction.atomic(using=self.alias):
            response = _rendered(call_view())
            if self.finish(claim, response):
                return response
            transaction.set_rollback(True, using=self.alias)
            return self.error_response(
                InFlight(
                    "This request lost its claim to a retry and was rolled back.",
                    retry_after=self.engine_options.retry_after,
                )
            )

    def run_atomic(self, call_view: ViewCall) -> HttpResponseBase:
        """Claim, view and completion in one transaction: a duplicate waits on the unique
        index until this one commits (then replays) or rolls back (then runs)."""
        try:
            try:
                # Connect first, so that a store that is down is told apart from a view
                # that fails inside the transaction.
                engine.reconnecting(self.alias, connections[self.alias].ensure_connection)
            except DatabaseError as error:
                raise _StoreFailed from error
            with transaction.atomic(using=self.alias):
                began = self.begin()
                if isinstance(began, HttpResponseBase):
                    return began
                response = _rendered(call_view())
                if self.store_statuses(response.status_code):
                    self.finish(began, response)
                else:
                    # A failed outcome rolls back with its work, so that a retry starts clean.
                    transaction.set_rollback(True, using=self.alias)
                    signals.emit(
                        signals.released,
                        logging.INFO,
                        "Idempotency key released (rolled back).",
                        **self.scope.lookup(),
                    )
                return response
        except _StoreFailed:
            return self.store_failed() or call_view()

    async def arun_commit(self, call_view: AsyncViewCall) -> HttpResponseBase:
        try:
            began = await sync_to_async(self.begin)()
        except _StoreFailed:
            failed = await sync_to_async(self.store_failed)()
            return failed if failed is not None else await call_view()
        if isinstance(began, HttpResponseBase):
            return began
        claim = began
        heartbeat.register(claim, self.engine_options.lease, conf.MAX_RUN_SECONDS)
        cancelled: asyncio.CancelledError | None = None
        try:
            if self.options.pick("on_disconnect", "ON_DISCONNECT") == "finish":
                response, cancelled = await _outliving_cancellation(call_view)
            else:
                response = await call_view()
            if isinstance(response, SimpleTemplateResponse) and not response.is_rendered:
                await sync_to_async(response.render)()
        except BaseException as error:
            # Includes CancelledError under ON_DISCONNECT "release": the client went away
            # mid-flight. Shielded, so the release completes even if cancelled again.
            await asyncio.shield(sync_to_async(_release_after)(claim, error))
            raise
        finally:
            heartbeat.unregister(claim)
        await asyncio.shield(sync_to_async(self.finish)(claim, response))
        if cancelled is not None:
            raise cancelled
        return response

    def finish(self, claim: engine.Claim, response: HttpResponseBase) -> bool:
        """Store a definitive outcome or release the claim. False when the claim was lost."""
        return _finish(claim, response, self.store_statuses)


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
        return engine.reconnecting(
            claim.alias, lambda: engine.complete(claim, outcome, body_stored=storable)
        )
    except DatabaseError:
        logger.exception(
            "Idempotency store unavailable while completing a key: the view ran and its "
            "response is sent, but the record stays in progress until its lease lapses.",
            extra={"idempotency_key": claim.scope.key},
        )
        return True


def _release_after(claim: engine.Claim, error: BaseException) -> None:
    """Release the key of a view that failed, unless its outcome is unknown.

    A database connection lost while the view ran (``OperationalError``/``InterfaceError``)
    may have lost the acknowledgement of a write that committed: releasing would let the
    retry do it again. That key stays claimed until its lease lapses, as a crashed worker's.
    """
    if isinstance(error, (OperationalError, InterfaceError)):
        logger.error(
            "Idempotency key kept after a database connection error in the view: its work "
            "may have committed. A retry runs after the lease lapses.",
            extra=signals.log_fields(**claim.scope.lookup()),
        )
        return
    _release_quietly(claim)


def _release_quietly(claim: engine.Claim) -> None:
    try:
        engine.reconnecting(claim.alias, lambda: engine.release(claim))
    except DatabaseError:
        logger.exception(
            "Idempotency store unavailable while releasing a key; it frees itself when its "
            "lease lapses.",
            extra={"idempotency_key": claim.scope.key},
        )


def _seconds_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _rendered(response: HttpResponseBase) -> HttpResponseBase:
    """Render a template response now: its bytes are what gets stored (and a rendering
    error is the view's failure, which releases the key)."""
    if isinstance(response, SimpleTemplateResponse) and not response.is_rendered:
        response.render()
    return response


async def _outliving_cancellation(
    call_view: AsyncViewCall,
) -> tuple[HttpResponseBase, asyncio.CancelledError | None]:
    """Run the view to its end even if the request is cancelled (its client went away).

    Cancelling a view cannot call back work it already started, such as a database write
    running in a thread: releasing the key then would let the retry do it twice. So the view
    finishes, its outcome is stored, and the retry gets the replay.
    """
    task = asyncio.ensure_future(call_view())
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            return await asyncio.shield(task), cancelled
        except asyncio.CancelledError as error:
            if task.done():
                raise  # the view itself was cancelled: it did not finish
            cancelled = error
