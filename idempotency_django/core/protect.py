"""Protect one HTTP request: what the decorator and the DRF mixin share.

Parse the key, scope it, fingerprint the request, and hand the view to the one shell
(``shell.py``), which decides everything else. This module only translates: a request
into a scope, a fingerprint and a policy; a response into an outcome to store; and the
shell's result back into a response.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.template.response import SimpleTemplateResponse

from idempotency_django import signals
from idempotency_django.core import claims, keys, observe, shell
from idempotency_django.core.decisions import outcome_unknown
from idempotency_django.core.options import Options
from idempotency_django.core.responses import problem_response, replay, stored_headers
from idempotency_django.core.transactions import (  # re-exported: they lived here
    RequestTransactions as RequestTransactions,
)
from idempotency_django.core.transactions import (
    request_transactions as request_transactions,
)
from idempotency_django.core.transactions import unprotected
from idempotency_django.exceptions import (
    AnonymousNotAllowed,
    BodyTooLarge,
    IdempotencyError,
    InFlight,
    KeyMalformed,
    KeyMissing,
)
from idempotency_django.models import ACCOUNT_MAX_LENGTH, ENDPOINT_MAX_LENGTH

ViewCall = Callable[[], HttpResponseBase]
AsyncViewCall = Callable[[], Awaitable[HttpResponseBase]]
ErrorResponse = Callable[[IdempotencyError], HttpResponseBase]


@dataclass(frozen=True)
class Guard:
    """One protected request: its scope, fingerprint and policy."""

    scope: claims.Scope
    fingerprint: str
    policy: shell.Policy
    store_statuses: Callable[[int], bool]

    @classmethod
    def for_request(cls, request: HttpRequest, options: Options) -> Guard | None:
        """Parse, scope and fingerprint ``request``; ``None`` when it runs unprotected."""
        resolved = options.resolved()
        resolved.stored_headers  # noqa: B018 - read after the work, refused before it
        # The unparsed key: what the ``key`` callable returns, or the ``HEADER`` header.
        raw = (
            options.key(request)
            if options.key is not None
            else request.headers.get(resolved.header)
        )
        if raw is None:
            if resolved.required:
                raise KeyMissing(f"This endpoint requires an {resolved.header} header.")
            return None
        key = keys.parse_key(raw)
        # "" and "None" name nobody, as None does: never one account shared by all of them.
        account = keys.account_or_none(resolved.account(request))
        if account is None:
            if resolved.anonymous == "bypass":
                return None
            raise AnonymousNotAllowed(options.anonymous_detail)
        endpoint = resolved.endpoint(request)
        if resolved.tenant is not None:
            endpoint = keys.tenant_endpoint(endpoint, resolved.tenant(request))
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
                account=keys.fit(account, ACCOUNT_MAX_LENGTH),
                endpoint=keys.fit(endpoint, ENDPOINT_MAX_LENGTH),
                key=key,
            ),
            # A custom FINGERPRINT may return anything: keyed as the library's own (never
            # stored as it is), compared by equality only (never as a library version).
            fingerprint=(
                fingerprint
                if resolved.fingerprint is keys.default_fingerprint
                else keys.custom_fingerprint(fingerprint)
            ),
            policy=resolved.policy(claims.store_alias()),
            store_statuses=resolved.store_statuses,
        )

    def outcome(self, response: HttpResponseBase) -> shell.Outcome:
        """What to keep of the view's response: a definitive one is stored (its body only
        when it fits and is not streamed: ``shell.definitive``); anything else releases
        the key, unless it is the framework's answer to an error that leaves the outcome
        unknown (``answered``)."""
        unknown = getattr(response, _UNKNOWN, None)
        if unknown is not None:
            return shell.Outcome(None, unknown=unknown)
        if not self.store_statuses(response.status_code):
            return shell.Outcome(None)
        body = response.content if isinstance(response, HttpResponse) else None
        return shell.definitive(
            response.status_code,
            body,
            lambda: stored_headers(response),
            self.policy,
            self.scope,
        )


_UNKNOWN = "_idempotency_unknown_outcome"


def _refused(request: HttpRequest, error: IdempotencyError) -> None:
    """Tell a refusal before any claim, which names no key (there is none to name, or no
    account): ``key_refused`` (missing, malformed), ``anonymous_refused``."""
    signal: signals.IdempotencySignal
    if isinstance(error, KeyMissing):
        signal, extra = signals.key_refused, {"reason": "missing"}
    elif isinstance(error, KeyMalformed):
        signal, extra = signals.key_refused, {"reason": "malformed"}
    elif isinstance(error, AnonymousNotAllowed):
        signal, extra = signals.anonymous_refused, {}
    else:
        return
    if signal.listened:
        signals.dispatch(signal, request=request, **extra)


def answered(error: Exception, response: HttpResponseBase) -> HttpResponseBase:
    """``response``, a framework's answer (DRF's or ninja's exception handler) to ``error``
    raised by the view, marked when the error leaves the work's outcome unknown (a lost
    database connection): whatever its status, the key is then kept, not released."""
    if outcome_unknown(error):
        setattr(response, _UNKNOWN, error)
    return response


def protect(
    request: HttpRequest,
    call_view: ViewCall,
    options: Options,
    error_response: ErrorResponse = problem_response,
    request_transactions: Sequence[str] = (),
) -> HttpResponseBase:
    """Run ``call_view`` at most once per key, or answer without running it; a request
    the options do not protect (its method, ``ENABLED``) runs as it is.

    ``error_response`` turns the app's own errors (400, 409, 422, 503 …) into responses;
    adapters pass their framework's error handling here.
    """
    if not options.protects(request.method):
        return unprotected(request_transactions, call_view)
    if observe.watching:
        return observe.observed(
            request,
            lambda: _protect(request, call_view, options, error_response, request_transactions),
        )
    return _protect(request, call_view, options, error_response, request_transactions)


def _protect(
    request: HttpRequest,
    call_view: ViewCall,
    options: Options,
    error_response: ErrorResponse,
    request_transactions: Sequence[str],
) -> HttpResponseBase:
    try:
        guard = Guard.for_request(request, options)
    except IdempotencyError as error:
        _refused(request, error)
        return error_response(error)
    if guard is None:
        return unprotected(request_transactions, call_view)
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

    result = shell.run(
        guard.scope, guard.fingerprint, guard.policy, work, guard.outcome, request_transactions
    )
    return respond(result, error_response)


async def aprotect(
    request: HttpRequest,
    call_view: AsyncViewCall,
    options: Options,
    error_response: ErrorResponse = problem_response,
) -> HttpResponseBase:
    """``protect`` for async views: every database call runs off the event loop."""
    if not options.protects(request.method):
        return await call_view()
    if observe.watching:
        return await observe.aobserved(
            request, lambda: _aprotect(request, call_view, options, error_response)
        )
    return await _aprotect(request, call_view, options, error_response)


async def _aprotect(
    request: HttpRequest,
    call_view: AsyncViewCall,
    options: Options,
    error_response: ErrorResponse,
) -> HttpResponseBase:
    from asgiref.sync import sync_to_async

    try:
        guard = await sync_to_async(Guard.for_request)(request, options)
    except IdempotencyError as error:
        await sync_to_async(_refused)(request, error)  # receivers run off the event loop
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

    result = await shell.arun(
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
    result: shell.Result[HttpResponseBase], error_response: ErrorResponse
) -> HttpResponseBase:
    if isinstance(result, shell.Replayed):
        return replay(result.stored)
    if isinstance(result, shell.Refused):
        return error_response(result.error)
    return result.value


def _rendered_outcome(guard: Guard) -> Callable[[HttpResponseBase], shell.Outcome]:
    def outcome(response: HttpResponseBase) -> shell.Outcome:
        return guard.outcome(_rendered(response))

    return outcome


def _rendered(response: HttpResponseBase) -> HttpResponseBase:
    """Render a template response now: its bytes are what gets stored (and a rendering
    error is the view's failure, which releases the key)."""
    if isinstance(response, SimpleTemplateResponse) and not response.is_rendered:
        response.render()
    return response
