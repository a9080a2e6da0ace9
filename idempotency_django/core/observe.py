"""Metrics, spans and a log line per protected request, built on the signals.

Nothing here runs unless ``IDEMPOTENCY["METRICS"]`` or ``LOG_REQUESTS`` is set: ``connect``
(called by ``AppConfig.ready`` and again when the setting changes in tests) connects these
receivers to the signals only then, and ``watching`` tells the adapters' shared entry
(``protect``) to open a ``Frame`` for the request. With both off, no receiver is connected,
no frame is opened and no store operation is timed.

A request's outcome is the last outcome signal sent while its frame is open (a duplicate
that waited and then replayed sends ``in_flight``, then ``replayed`` with ``waited``: it is
``waited_then_replayed``). When the request ends, each recorder (``metrics/prometheus.py``,
``metrics/opentelemetry.py``) counts it once, under attributes that are bounded: the
outcome, the store, the route template and the method; never the key, the account or the
fingerprint. The signals stay the extension point: a receiver of one's own sees what these
see. docs/observability.md.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from django.core.exceptions import ImproperlyConfigured
from django.dispatch import Signal
from django.http import HttpRequest
from django.http.response import HttpResponseBase

from idempotency_django import signals
from idempotency_django.conf import conf

#: Every value of ``idempotency.outcome``: a closed set.
OUTCOMES = (
    "claimed",  # the view ran under a new claim
    "replayed",
    "in_flight",  # 409: a duplicate of a request still running
    "waited_then_replayed",  # IN_FLIGHT "wait": waited for the first, then replayed it
    "mismatch",  # 422
    "key_invalid",  # 400: missing where required, or malformed
    "anonymous",  # 403
    "released",  # the view failed; the key is free for a retry
    "taken_over",  # a lapsed lease was taken over, and the view ran
    "store_unavailable",  # 503
    "failed_open",  # the store was unreachable and the view ran unprotected
    "outcome_not_stored",  # the work may have committed, its outcome is not stored
    "response_unreadable",  # 409: the stored response cannot be read back
    "completion_lost",  # 409: the view ran, but a retry took its lapsed claim over
    "quota_exceeded",  # 429
    "other",  # none of these: no key where none is required, a body too large, ...
)

requests_logger = logging.getLogger("idempotency_django.requests")


@dataclass(slots=True)
class Frame:
    """One protected request while it runs."""

    route: str
    method: str
    store: str
    started: float
    outcome: str | None = None
    # The client's key, kept for the log line, which names it by its HMAC only
    # (``signals.key_digest``): never exported as a label or an attribute.
    key: str | None = None
    span: Any = None  # the recorder's span (OpenTelemetry)
    context_token: Any = None


class Recorder(Protocol):
    """What an exporter does with what the signals tell. ``begin`` and ``event`` are called
    only on a recorder that ``traces`` (opens a span per request)."""

    traces: bool

    def begin(self, frame: Frame) -> None: ...
    def end(self, frame: Frame, outcome: str, seconds: float) -> None: ...
    def event(self, frame: Frame, name: str) -> None: ...
    def store_operation(self, operation: str, store: str, seconds: float) -> None: ...
    def response_size(self, store: str, size: int) -> None: ...
    def heartbeat(self, in_flight: int, oldest_age: float, lag: float, failures: int) -> None: ...
    def purged(self, store: str, expired: int, stale: int) -> None: ...


_frame: contextvars.ContextVar[Frame | None] = contextvars.ContextVar(
    "idempotency_django.core.observe.frame", default=None
)
recorders: list[Recorder] = []
_tracers: list[Recorder] = []  # the recorders that trace: ``begin`` and ``event`` go to them
#: Whether ``protect`` opens a frame per request: a metric or the log line is on.
watching = False


# -- the request's frame --------------------------------------------------------------------


def route(request: HttpRequest) -> str:
    """The route template (``charges/<str:charge_id>``), never the path: bounded."""
    match = getattr(request, "resolver_match", None)
    return str(match.route) if match is not None else ""


R = TypeVar("R", bound=HttpResponseBase)


def observed(request: HttpRequest, call: Callable[[], R]) -> R:
    """``call()``, the protected request, inside its frame. (``_begin`` and ``_end``
    written out: this runs on every protected request, docs/observability.md "Cost".)"""
    # The store: the STORE setting's until its first operation names one.
    frame = Frame(route(request), request.method or "", _default_store, time.perf_counter())
    for recorder in _tracers:
        recorder.begin(frame)
    token = _frame.set(frame)
    try:
        return call()
    finally:
        _frame.reset(token)
        seconds = time.perf_counter() - frame.started
        outcome = frame.outcome or "other"
        for recorder in recorders:
            recorder.end(frame, outcome, seconds)
        if _log_requests:
            log_request(frame, outcome, seconds)


async def aobserved(request: HttpRequest, call: Callable[[], Awaitable[R]]) -> R:
    """``observed`` for async views."""
    frame = _begin(request)
    token = _frame.set(frame)
    try:
        return await call()
    finally:
        _frame.reset(token)
        _end(frame)


def _begin(request: HttpRequest) -> Frame:
    # The store: the STORE setting's until its first operation names one.
    frame = Frame(route(request), request.method or "", _default_store, time.perf_counter())
    for recorder in _tracers:
        recorder.begin(frame)
    return frame


def _end(frame: Frame) -> None:
    seconds = time.perf_counter() - frame.started
    outcome = frame.outcome or "other"
    for recorder in recorders:
        recorder.end(frame, outcome, seconds)
    if _log_requests:
        log_request(frame, outcome, seconds)


def log_request(frame: Frame, outcome: str, seconds: float) -> None:
    """One line per protected request on ``idempotency_django.requests``: the key only as
    its HMAC, whatever ``LOG_KEYS`` says (the fields go to log pipelines, which keep them)."""
    if not requests_logger.isEnabledFor(logging.INFO):
        return
    requests_logger.info(
        "Idempotency %s %s: %s (%s store, %.1f ms).",
        frame.method,
        signals.escape_log_text(frame.route),
        outcome,
        frame.store,
        seconds * 1000,
        extra={
            "idempotency_outcome": outcome,
            "idempotency_store": frame.store,
            "http_route": signals.escape_log_text(frame.route),
            "http_request_method": frame.method,
            "idempotency_duration_ms": round(seconds * 1000, 3),
            "idempotency_key_hmac": None if frame.key is None else signals.key_digest(frame.key),
        },
    )


# -- receivers ------------------------------------------------------------------------------


def _outcome_of(outcome: str) -> Callable[..., None]:
    def receiver(key: str | None = None, **kwargs: Any) -> None:
        frame = _frame.get()
        if frame is not None:
            frame.outcome = outcome
            if key is not None:
                frame.key = key

    return receiver


def _replayed(key: str, waited: bool = False, **kwargs: Any) -> None:
    frame = _frame.get()
    if frame is not None:
        frame.outcome = "waited_then_replayed" if waited else "replayed"
        frame.key = key


def _store_unavailable(key: str, policy: str, **kwargs: Any) -> None:
    frame = _frame.get()
    if frame is not None:
        frame.outcome = "failed_open" if policy == "open" else "store_unavailable"
        frame.key = key


def _with_event(outcome: str, event: str) -> Callable[..., None]:
    def receiver(key: str, **kwargs: Any) -> None:
        frame = _frame.get()
        if frame is not None:
            frame.outcome = outcome
            frame.key = key
            for recorder in _tracers:
                recorder.event(frame, event)

    return receiver


def _completed(size: int, **kwargs: Any) -> None:
    frame = _frame.get()
    store = frame.store if frame is not None else _default_store
    for recorder in recorders:
        recorder.response_size(store, size)


def _store_operation(operation: str, store: str, seconds: float, **kwargs: Any) -> None:
    frame = _frame.get()
    if frame is not None:
        frame.store = store
    for recorder in recorders:
        recorder.store_operation(operation, store, seconds)


def _heartbeat(in_flight: int, oldest_age: float, lag: float, failures: int, **kw: Any) -> None:
    for recorder in recorders:
        recorder.heartbeat(in_flight, oldest_age, lag, failures)


def _purged(expired: int, stale: int, **kwargs: Any) -> None:
    for recorder in recorders:
        recorder.purged(_default_store, expired, stale)


def _receivers() -> list[tuple[Signal, Callable[..., None]]]:
    from idempotency_django.operations.purge import purged

    return [
        (signals.claimed, _outcome_of("claimed")),
        (signals.replayed, _replayed),
        (signals.in_flight, _outcome_of("in_flight")),
        (signals.mismatch, _outcome_of("mismatch")),
        (signals.key_refused, _outcome_of("key_invalid")),
        (signals.anonymous_refused, _outcome_of("anonymous")),
        (signals.released, _outcome_of("released")),
        (signals.lease_taken_over, _with_event("taken_over", "idempotency.taken_over")),
        (
            signals.outcome_not_stored,
            _with_event("outcome_not_stored", "idempotency.outcome_not_stored"),
        ),
        (signals.store_unavailable, _store_unavailable),
        (signals.response_unreadable, _outcome_of("response_unreadable")),
        (signals.completion_lost, _outcome_of("completion_lost")),
        (signals.quota_exceeded, _outcome_of("quota_exceeded")),
        (signals.completed, _completed),
        (signals.store_operation, _store_operation),
        (signals.heartbeat_beat, _heartbeat),
        (purged, _purged),
    ]


_connected: list[tuple[Signal, Callable[..., None]]] = []
# The name of the STORE setting's store, read when the receivers are connected: a request
# that reaches no store (a 400) is counted under it.
_default_store = ""
_log_requests = False  # LOG_REQUESTS, read when the receivers are connected


def connect() -> None:
    """Connect the receivers and the recorders that the settings ask for, and nothing
    otherwise (disconnecting what an earlier call connected)."""
    global watching, _default_store, _log_requests
    disconnect()
    exporters = conf.METRICS
    _log_requests = conf.LOG_REQUESTS
    if not exporters and not _log_requests:
        return
    from idempotency_django.store.base import get_store

    _default_store = signals.store_name(get_store())
    for exporter in exporters:
        if exporter == "prometheus":
            from idempotency_django.metrics import prometheus

            recorders.append(prometheus.recorder())
        else:
            from idempotency_django.metrics import opentelemetry

            recorders.append(opentelemetry.recorder())
    _tracers.extend(recorder for recorder in recorders if recorder.traces)
    for signal, receiver in _receivers():
        # The package's own signals hold these in their observer slot, outside Django's
        # dispatch (``signals.IdempotencySignal``: most of the metrics' cost on a replay);
        # the purge's signal, sent once per purge, takes a plain receiver.
        if isinstance(signal, signals.IdempotencySignal):
            signal.observer = receiver
        else:
            signal.connect(receiver, weak=False, dispatch_uid=_UID)
        _connected.append((signal, receiver))
    watching = True


def disconnect() -> None:
    global watching
    watching = False
    for signal, _ in _connected:
        if isinstance(signal, signals.IdempotencySignal):
            signal.observer = None
        else:
            signal.disconnect(dispatch_uid=_UID)
    _connected.clear()
    recorders.clear()
    _tracers.clear()


_UID = "idempotency_django.core.observe"


def purge_lag_seconds() -> float | None:
    """How long ago the oldest expired record still present expired (0 when none): the
    store's ``oldest_expired``, read through the expiry index, against this process's clock.
    ``None`` for a store that expires its records itself (Redis): nothing can lag. What
    ``idempotency.purge.lag`` reports, when it is collected."""
    from django.utils import timezone

    from idempotency_django.store.base import get_store, store_alias

    store = get_store()
    if not store.needs_purge:
        return None
    oldest = store.bind(store_alias()).oldest_expired()
    return 0.0 if oldest is None else max(0.0, (timezone.now() - oldest).total_seconds())


def setting_changed(setting: str, **kwargs: Any) -> None:
    """``override_settings(IDEMPOTENCY=...)`` in tests connects what the new value asks for."""
    if setting == "IDEMPOTENCY":
        try:
            connect()
        except (ImportError, ImproperlyConfigured):
            disconnect()  # checks E001, E060 and E061 tell what is wrong
