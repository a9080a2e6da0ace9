"""The Prometheus exporter (``IDEMPOTENCY["METRICS"] = "prometheus"``; the ``prometheus``
extra): the signals as prometheus-client metrics, and ``metrics_view`` to scrape them.

The metrics live in prometheus-client's default registry, as django-prometheus's do, under
names of their own (``idempotency_*``): with both installed, either view exports both, and
nothing is registered twice. Under gunicorn with several workers, prometheus-client's
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set before the first import of
prometheus_client: ``idempotency_django.metrics.gunicorn`` does it) keeps each worker's
values in files that ``metrics_view`` sums at scrape time, whichever worker answers it; the
gauges of a worker that exited are dropped (``multiprocess.mark_process_dead``).

Not built on the OpenTelemetry exporter: OpenTelemetry's Prometheus exporter serves one
process's values, so under ``gunicorn -w 4`` a scrape would see a quarter of them.
docs/observability.md.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any

from django.http import HttpRequest, HttpResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from idempotency_django.core import observe

REQUEST_LABELS = ("idempotency_outcome", "idempotency_store", "http_route", "http_request_method")
# Seconds: a claim on a local database takes about a millisecond, a replay on Redis less.
DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
SIZE_BUCKETS = (256, 1024, 4096, 16384, 65536, 262144, 1048576)


def _metrics() -> dict[str, Any]:
    """Created once per process, in the default registry (as django-prometheus's)."""
    return {
        "requests": Counter(
            "idempotency_requests",
            "Protected requests, by outcome.",
            REQUEST_LABELS,
        ),
        "store_operation": Histogram(
            "idempotency_store_operation_duration_seconds",
            "Duration of store operations (claim, complete, release, renew, read).",
            ("idempotency_operation", "idempotency_store"),
            buckets=DURATION_BUCKETS,
        ),
        "in_flight": Gauge(
            "idempotency_claims_in_flight",
            "Claims this process holds (its view running), sampled at each heartbeat beat.",
            multiprocess_mode="livesum",
        ),
        "oldest_age": Gauge(
            "idempotency_claims_oldest_age_seconds",
            "Age of the oldest claim this process holds, sampled at each heartbeat beat.",
            multiprocess_mode="livemax",
        ),
        "renewal_lag": Gauge(
            "idempotency_lease_renewal_lag_seconds",
            "Seconds since the least recently renewed lease of this process was renewed.",
            multiprocess_mode="livemax",
        ),
        "renewal_failures": Counter(
            "idempotency_lease_renewal_failures",
            "Lease renewals that failed (per claim).",
        ),
        "response_size": Histogram(
            "idempotency_response_size_bytes",
            "Size of the stored responses' bodies.",
            ("idempotency_store",),
            buckets=SIZE_BUCKETS,
        ),
        "purge_deletions": Counter(
            "idempotency_purge_deletions",
            "Records deleted by the purge, expired or stale in progress.",
            ("idempotency_store", "idempotency_purge_reason"),
        ),
    }


_created: dict[str, Any] | None = None


def metrics() -> dict[str, Any]:
    global _created
    if _created is None:
        _created = _metrics()
    return _created


class PrometheusRecorder:
    """Feeds the metrics from ``observe``'s receivers.

    Each labelled child is resolved once (per outcome, store, route and method; per
    operation and store), and kept as the few calls a measurement needs: a request then costs
    one dictionary lookup and one write per value, not prometheus-client's checks and label
    handling on every call (the recorder's share of a replay fell by a quarter, measured;
    docs/observability.md, "Cost")."""

    traces = False

    def __init__(self) -> None:
        self.metrics = metrics()
        self._requests: dict[tuple[str, str, str, str], Callable[[float], None]] = {}
        self._operations: dict[tuple[str, str], Callable[[float], None]] = {}
        self._sizes: dict[str, Callable[[float], None]] = {}
        self._children: dict[tuple[str, ...], Any] = {}

    def _child(self, name: str, *labels: str) -> Any:
        key = (name, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.metrics[name].labels(*labels)
        return child

    def begin(self, frame: observe.Frame) -> None:
        pass

    def end(self, frame: observe.Frame, outcome: str, seconds: float) -> None:
        key = (outcome, frame.store, frame.route, frame.method)
        inc = self._requests.get(key)
        if inc is None:
            inc = self._requests[key] = _incrementer(self.metrics["requests"].labels(*key))
        inc(1)

    def event(self, frame: observe.Frame, name: str) -> None:
        pass

    def store_operation(self, operation: str, store: str, seconds: float) -> None:
        key = (operation, store)
        observe_ = self._operations.get(key)
        if observe_ is None:
            child = self.metrics["store_operation"].labels(operation, store)
            observe_ = self._operations[key] = _observer(child)
        observe_(seconds)

    def response_size(self, store: str, size: int) -> None:
        observe_ = self._sizes.get(store)
        if observe_ is None:
            observe_ = self._sizes[store] = _observer(self.metrics["response_size"].labels(store))
        observe_(size)

    def heartbeat(self, in_flight: int, oldest_age: float, lag: float, failures: int) -> None:
        self.metrics["in_flight"].set(in_flight)
        self.metrics["oldest_age"].set(oldest_age)
        self.metrics["renewal_lag"].set(lag)
        if failures:
            self.metrics["renewal_failures"].inc(failures)

    def purged(self, store: str, expired: int, stale: int) -> None:
        self._child("purge_deletions", store, "expired").inc(expired)
        self._child("purge_deletions", store, "stale").inc(stale)


def _incrementer(child: Any) -> Callable[[float], None]:
    """``child.inc``, as the write of its value alone: the checks ``Counter.inc`` makes on
    every call (the metric is labelled, the amount not negative, an exemplar) hold here by
    construction. The public method where prometheus-client keeps its value elsewhere."""
    value = getattr(child, "_value", None)
    inc = getattr(value, "inc", None)
    return inc if callable(inc) else child.inc  # type: ignore[no-any-return]


def _observer(child: Any) -> Callable[[float], None]:
    """``child.observe``, as the two writes it makes (the sum, then the first bucket whose
    bound holds the value, found by bisection): ``Histogram.observe`` walks its bounds one
    by one and checks the labels and the exemplar on every call. The public method where
    prometheus-client keeps its values elsewhere."""
    try:
        add = child._sum.inc
        buckets = [bucket.inc for bucket in child._buckets]
        bounds = list(child._upper_bounds)
    except AttributeError:
        return child.observe  # type: ignore[no-any-return]
    if len(buckets) != len(bounds) or bounds[-1] != float("inf"):
        return child.observe  # type: ignore[no-any-return]

    def observe_(amount: float) -> None:
        add(amount)
        index = bisect_left(bounds, amount)  # the first bound >= amount, the last +Inf
        if amount <= bounds[index]:  # false for NaN only: in the sum, in no bucket, as there
            buckets[index](1)

    return observe_


def recorder() -> PrometheusRecorder:
    return PrometheusRecorder()


class PurgeLagCollector(Collector):
    """``idempotency_purge_lag_seconds``, read from the store when scraped: the age of the
    oldest expired record still present. One value for the whole deployment, whichever
    process answers the scrape; none for a store that expires records itself."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        lag = observe.purge_lag_seconds()
        if lag is not None:
            family = GaugeMetricFamily(
                "idempotency_purge_lag_seconds",
                "Age of the oldest expired record not purged yet (0: none).",
            )
            family.add_metric([], lag)
            yield family


class _Default(Collector):
    """The default registry's metrics (this process's, django-prometheus's included)."""

    def collect(self) -> Iterator[Any]:
        yield from REGISTRY.collect()


def registry() -> CollectorRegistry:
    """What a scrape exports: every process's metrics (multiprocess mode) or this process's,
    and the purge lag."""
    scraped = CollectorRegistry(auto_describe=False)
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.MultiProcessCollector(scraped)  # type: ignore[no-untyped-call]
    else:
        scraped.register(_Default())
    scraped.register(PurgeLagCollector())
    return scraped


def metrics_view(request: HttpRequest) -> HttpResponse:
    """The metrics in Prometheus's text format. Mount it where your scraper looks (and
    keep it off the public internet): ``path("metrics", metrics_view)``."""
    return HttpResponse(generate_latest(registry()), content_type=CONTENT_TYPE_LATEST)
