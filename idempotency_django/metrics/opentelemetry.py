"""The OpenTelemetry exporter (``IDEMPOTENCY["METRICS"] = "opentelemetry"``; the
``opentelemetry`` extra): the signals as OpenTelemetry metrics, and a span per protected
request, through ``opentelemetry-api`` only. Without an SDK configured every call is the
API's no-op; with one, the application's own providers, readers and exporters decide where
it all goes (an OTLP collector, or Prometheus through it).

Names follow OpenTelemetry's conventions: the ``idempotency.*`` namespace, units as UCUM
(``s``, ``By``, ``{request}``), no ``_total``; attributes ``idempotency.outcome``,
``idempotency.store``, ``http.route`` (the template) and ``http.request.method``.
docs/observability.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from opentelemetry import context, metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import SpanKind, Status, StatusCode

from idempotency_django import __version__
from idempotency_django.core import observe

SCOPE = "idempotency_django"
DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
SIZE_BUCKETS = (256, 1024, 4096, 16384, 65536, 262144, 1048576)
# Outcomes after which the request's span is an error: its client got a 5xx, or its work's
# outcome is not kept.
FAILED = frozenset({"store_unavailable", "outcome_not_stored", "completion_lost"})


class OpenTelemetryRecorder:
    traces = True

    def __init__(self) -> None:
        meter = metrics.get_meter(SCOPE, __version__)
        self.tracer = trace.get_tracer(SCOPE, __version__)
        self.requests = meter.create_counter(
            "idempotency.requests", unit="{request}", description="Protected requests, by outcome."
        )
        self.operation_durations = meter.create_histogram(
            "idempotency.store.operation.duration",
            unit="s",
            description="Duration of store operations (claim, complete, release, renew, read).",
            explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS),
        )
        self.response_sizes = meter.create_histogram(
            "idempotency.response.size",
            unit="By",
            description="Size of the stored responses' bodies.",
            explicit_bucket_boundaries_advisory=list(SIZE_BUCKETS),
        )
        self.renewal_failures = meter.create_counter(
            "idempotency.lease.renewal.failures",
            unit="{claim}",
            description="Lease renewals that failed (per claim).",
        )
        self.purge_deletions = meter.create_counter(
            "idempotency.purge.deletions",
            unit="{record}",
            description="Records deleted by the purge, expired or stale in progress.",
        )
        # Attribute dictionaries, built once per distinct set of values (bounded: see
        # ``observe``) and passed again on every measurement; the SDK only reads them.
        self._attributes: dict[tuple[str, ...], dict[str, str]] = {}
        # The heartbeat's last sample, observed when the reader collects.
        self.sample = {"in_flight": 0.0, "oldest_age": 0.0, "lag": 0.0}
        meter.create_observable_gauge(
            "idempotency.claims.in_flight",
            callbacks=[self._observe("in_flight")],
            unit="{claim}",
            description="Claims this process holds, sampled at each heartbeat beat.",
        )
        meter.create_observable_gauge(
            "idempotency.claims.oldest_age",
            callbacks=[self._observe("oldest_age")],
            unit="s",
            description="Age of the oldest claim this process holds.",
        )
        meter.create_observable_gauge(
            "idempotency.lease.renewal.lag",
            callbacks=[self._observe("lag")],
            unit="s",
            description="Seconds since the least recently renewed lease was renewed.",
        )
        meter.create_observable_gauge(
            "idempotency.purge.lag",
            callbacks=[_purge_lag],
            unit="s",
            description="Age of the oldest expired record not purged yet (0: none).",
        )

    def _observe(self, name: str) -> Any:
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(self.sample[name])]

        return callback

    def begin(self, frame: observe.Frame) -> None:
        key = ("span", frame.store, frame.route, frame.method)
        attributes = self._attributes.get(key)
        if attributes is None:
            attributes = self._attributes[key] = {
                "idempotency.store": frame.store,
                "http.route": frame.route,
                "http.request.method": frame.method,
            }
        span = self.tracer.start_span("idempotency", kind=SpanKind.INTERNAL, attributes=attributes)
        frame.span = span
        frame.context_token = context.attach(trace.set_span_in_context(span))

    def end(self, frame: observe.Frame, outcome: str, seconds: float) -> None:
        key = (outcome, frame.store, frame.route, frame.method)
        attributes = self._attributes.get(key)
        if attributes is None:
            attributes = self._attributes[key] = {
                "idempotency.outcome": outcome,
                "idempotency.store": frame.store,
                "http.route": frame.route,
                "http.request.method": frame.method,
            }
        self.requests.add(1, attributes)
        span = frame.span
        if span is None:
            return
        span.set_attribute("idempotency.outcome", outcome)
        if outcome in FAILED:
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end()
        context.detach(frame.context_token)

    def event(self, frame: observe.Frame, name: str) -> None:
        if frame.span is not None:
            frame.span.add_event(name)

    def store_operation(self, operation: str, store: str, seconds: float) -> None:
        key = ("operation", operation, store)
        attributes = self._attributes.get(key)
        if attributes is None:
            attributes = self._attributes[key] = {
                "idempotency.operation": operation,
                "idempotency.store": store,
            }
        self.operation_durations.record(seconds, attributes)

    def response_size(self, store: str, size: int) -> None:
        self.response_sizes.record(size, {"idempotency.store": store})

    def heartbeat(self, in_flight: int, oldest_age: float, lag: float, failures: int) -> None:
        self.sample = {"in_flight": float(in_flight), "oldest_age": oldest_age, "lag": lag}
        if failures:
            self.renewal_failures.add(failures)

    def purged(self, store: str, expired: int, stale: int) -> None:
        self.purge_deletions.add(
            expired, {"idempotency.store": store, "idempotency.purge.reason": "expired"}
        )
        self.purge_deletions.add(
            stale, {"idempotency.store": store, "idempotency.purge.reason": "stale"}
        )


def _purge_lag(options: CallbackOptions) -> Iterable[Observation]:
    lag = observe.purge_lag_seconds()
    return [] if lag is None else [Observation(lag)]


def recorder() -> OpenTelemetryRecorder:
    return OpenTelemetryRecorder()
