"""Metrics (Prometheus and OpenTelemetry), a span per protected request and the request
log line, as a user reads them: the scrape of ``metrics_view``, the SDK's in-memory
exporters, the log records."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import DataError, OperationalError, connection, connections
from django.test import Client, RequestFactory
from django.utils import timezone
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from idempotency_django import checks, signals
from idempotency_django.core import observe
from idempotency_django.core.heartbeat import Heartbeat
from idempotency_django.metrics import prometheus
from idempotency_django.models import IdempotencyRecord
from idempotency_django.purge import purge_records
from tests import records
from tests.conftest import Post
from tests.docs_snippets import observability
from tests.test_lifecycle import is_completion

pytestmark = pytest.mark.django_db(transaction=True)

Scrape = Callable[[], dict[tuple[str, frozenset[tuple[str, str]]], float]]


def scrape_once() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of ``metrics_view``'s answer, by name and labels."""
    response = prometheus.metrics_view(RequestFactory().get("/metrics"))
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.content.decode())
        for sample in family.samples
    }


@pytest.fixture
def prom(settings: Any) -> Scrape:
    settings.IDEMPOTENCY = {"METRICS": "prometheus"}
    assert observe.watching
    return scrape_once


def requests_by_outcome(samples: dict[Any, float], route: str = "effect/") -> dict[str, float]:
    counts: dict[str, float] = {}
    for (name, labels), value in samples.items():
        found = dict(labels)
        if name == "idempotency_requests_total" and found["http_route"] == route:
            counts[found["idempotency_outcome"]] = value
    return counts


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def test_each_outcome_is_counted_once_under_its_label(
    alice: User, post: Post, prom: Scrape, client: Client
) -> None:
    before = requests_by_outcome(prom())

    assert post("/effect/", {"amount": 1}, key="a").status_code == 201  # claimed
    assert post("/effect/", {"amount": 1}, key="a").status_code == 201  # replayed
    assert post("/effect/", {"amount": 1}, key="a").status_code == 201  # replayed
    assert post("/effect/", {"amount": 2}, key="a").status_code == 422  # mismatch
    assert post("/effect/", {"amount": 1}, key=None).status_code == 400  # missing
    assert post("/effect/", {"amount": 1}, key='"open').status_code == 400  # malformed
    assert post("/effect/", {"amount": 1}, key="b", user=None).status_code == 403
    assert post("/effect/", {"status": 503}, key="c").status_code == 503  # released
    records.update(
        {"key": "a"},
        state=IdempotencyRecord.State.IN_PROGRESS,
        lease_expires_at=timezone.now() + timedelta(seconds=30),
    )
    assert post("/effect/", {"amount": 1}, key="a").status_code == 409  # in flight
    records.update({"key": "a"}, lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert post("/effect/", {"amount": 1}, key="a").status_code == 201  # taken over

    assert delta(before, requests_by_outcome(prom())) == {
        "claimed": 1,
        "replayed": 2,
        "mismatch": 1,
        "key_invalid": 2,
        "anonymous": 1,
        "released": 1,
        "in_flight": 1,
        "taken_over": 1,
    }


def test_a_duplicate_that_waited_and_replayed_is_waited_then_replayed(
    alice: User, post: Post, prom: Scrape
) -> None:
    """The duplicate arrives while the first request runs (its record in progress), waits
    under IN_FLIGHT "wait", and replays the outcome once the record completes."""
    assert post("/waiting/", {"amount": 1}, key="w").status_code == 201
    completed = records.get(key="w")
    records.update(
        {"key": "w"},
        state=IdempotencyRecord.State.IN_PROGRESS,
        lease_expires_at=timezone.now() + timedelta(seconds=30),
    )
    before = requests_by_outcome(prom(), route="waiting/")
    waiting = threading.Event()

    def in_flight(**kwargs: Any) -> None:
        waiting.set()

    def complete_when_waiting() -> None:
        waiting.wait(10)
        try:
            records.update(
                {"key": "w"},
                state=IdempotencyRecord.State.COMPLETED,
                response_status=completed.response_status,
                response_headers=completed.response_headers,
                response_body=completed.response_body,
            )
        finally:
            connections.close_all()

    signals.in_flight.connect(in_flight)
    completer = threading.Thread(target=complete_when_waiting)
    completer.start()
    try:
        response = post("/waiting/", {"amount": 1}, key="w")
    finally:
        completer.join()
        signals.in_flight.disconnect(in_flight)

    assert response.status_code == 201
    assert response["Idempotent-Replayed"] == "true"
    assert delta(before, requests_by_outcome(prom(), route="waiting/")) == {
        "waited_then_replayed": 1
    }


@pytest.mark.database_store("injects SQL failures; the Redis store's: test_redis_store")
def test_store_unavailable_and_failed_open_are_counted(
    alice: User, post: Post, prom: Scrape, settings: Any
) -> None:
    def fail(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
        if IdempotencyRecord._meta.db_table in sql:
            raise OperationalError("server closed the connection unexpectedly")
        return execute(sql, params, many, context)

    before = requests_by_outcome(prom())
    with connection.execute_wrapper(fail):
        assert post("/effect/", {}, key="x").status_code == 503
    settings.IDEMPOTENCY = {"METRICS": "prometheus", "ON_STORE_ERROR": "open"}
    with connection.execute_wrapper(fail):
        assert post("/effect/", {}, key="y").status_code == 201

    assert delta(before, requests_by_outcome(prom())) == {
        "store_unavailable": 1,
        "failed_open": 1,
    }


def test_routes_are_templates_and_no_key_or_account_is_a_label(
    alice: User, post: Post, prom: Scrape
) -> None:
    post("/effect/41/", {"amount": 1}, key="order-4711-secret")
    post("/effect/42/", {"amount": 1}, key="order-4712-secret")
    samples = prom()
    values = {value for (name, found) in samples if name.startswith("idem") for _, value in found}

    assert not [value for value in values if "order-47" in value]
    assert signals.key_digest("order-4711-secret") not in values
    assert str(alice.pk) not in values  # no account
    routes = {dict(labels).get("http_route") for (name, labels) in samples}
    assert "effect/<int:number>/" in routes
    assert not {route for route in routes if route and "41" in route}
    labels = {key for (name, found) in samples if name.startswith("idem") for key, _ in found}
    assert labels <= {
        "idempotency_outcome",
        "idempotency_store",
        "http_route",
        "http_request_method",
        "idempotency_operation",
        "idempotency_purge_reason",
        "le",
    }


def test_store_operations_are_timed_by_operation(
    alice: User, post: Post, prom: Scrape, store_name: str
) -> None:
    def counts() -> dict[str, float]:
        return {
            dict(labels)["idempotency_operation"]: value
            for (name, labels), value in prom().items()
            if name == "idempotency_store_operation_duration_seconds_count"
            and dict(labels)["idempotency_store"] == store_name
        }

    before = counts()
    post("/effect/", {"amount": 1}, key="t")  # a claim, a completion
    post("/effect/", {"amount": 1}, key="t")  # a claim that reads the record
    post("/effect/", {"status": 503}, key="u")  # a claim, a release

    assert delta(before, counts()) == {"claim": 3, "complete": 1, "release": 1}


@pytest.fixture
def store_name() -> str:
    from idempotency_django.store.base import get_store

    return signals.store_name(get_store())


def test_stored_response_sizes(alice: User, post: Post, prom: Scrape, store_name: str) -> None:
    def sizes() -> tuple[float, float]:
        samples = prom()
        labels = frozenset({("idempotency_store", store_name)})
        return (
            samples.get(("idempotency_response_size_bytes_count", labels), 0),
            samples.get(("idempotency_response_size_bytes_sum", labels), 0),
        )

    count, total = sizes()
    response = post("/effect/", {"amount": 1}, key="s")

    assert sizes() == (count + 1, total + len(response.content))


def test_heartbeat_samples_in_flight_claims_and_failed_renewals(
    alice: User, prom: Scrape, settings: Any
) -> None:
    from idempotency_django.core.claims import Claim, Scope
    from idempotency_django.store.base import get_store

    store = get_store()
    beat = Heartbeat()
    claims = [Claim(Scope(str(alice.pk), "POST /hb/", f"h{n}"), f"t{n}", "default") for n in (1, 2)]
    failures = prom().get(("idempotency_lease_renewal_failures_total", frozenset()), 0)
    try:
        for claim in claims:
            beat.register(claim, 30, 300)
        beat.renew_once()  # no record behind them: renewed none, failed none
        samples = prom()
        assert samples[("idempotency_claims_in_flight", frozenset())] == 2
        assert samples[("idempotency_claims_oldest_age_seconds", frozenset())] > 0

        def broken(*args: Any) -> int:
            raise OperationalError("renewal refused")

        # on the class: the heartbeat renews through the store bound to the claims' alias
        saved = type(store).renew
        type(store).renew = broken  # type: ignore[method-assign]
        try:
            beat.renew_once()
        finally:
            type(store).renew = saved  # type: ignore[method-assign]
        samples = prom()
        assert samples[("idempotency_lease_renewal_failures_total", frozenset())] == failures + 2
        for claim in claims:
            beat.unregister(claim)
        beat.renew_once()
        assert prom()[("idempotency_claims_in_flight", frozenset())] == 0
    finally:
        beat.stop()


@pytest.mark.database_store("the purge and its lag are the database store's")
def test_purge_deletions_and_lag(alice: User, post: Post, prom: Scrape) -> None:
    post("/effect/", {"amount": 1}, key="p")
    assert prom()[("idempotency_purge_lag_seconds", frozenset())] == 0
    records.update({"key": "p"}, expires_at=timezone.now() - timedelta(hours=3))
    lag = prom()[("idempotency_purge_lag_seconds", frozenset())]
    assert 3 * 3600 <= lag < 3 * 3600 + 60
    labels = frozenset({("idempotency_store", "database"), ("idempotency_purge_reason", "expired")})
    deleted = prom().get(("idempotency_purge_deletions_total", labels), 0)

    purge_records()

    assert prom()[("idempotency_purge_deletions_total", labels)] == deleted + 1
    assert prom()[("idempotency_purge_lag_seconds", frozenset())] == 0


def test_with_metrics_off_nothing_is_connected(alice: User, post: Post, settings: Any) -> None:
    settings.IDEMPOTENCY = {"METRICS": "prometheus"}
    assert signals.store_operation.listened
    settings.IDEMPOTENCY = {}

    assert not observe.watching
    assert not observe.recorders
    for signal in (
        signals.claimed,
        signals.replayed,
        signals.store_operation,
        signals.heartbeat_beat,
        signals.completed,
    ):
        assert signal.observer is None
        uids = [lookup[0] for lookup, *_ in signal.receivers]
        assert not [uid for uid in uids if "observe" in str(uid)]
    assert not signals.store_operation.listened  # so no store operation is timed
    before = scrape_once()
    post("/effect/", {"amount": 1}, key="off")
    assert requests_by_outcome(scrape_once()) == requests_by_outcome(before)


def test_a_receiver_of_ones_own_sees_what_the_metrics_see(
    alice: User, post: Post, prom: Scrape
) -> None:
    """The metrics hold their receiver in each signal's own slot (outside Django's
    dispatch): a receiver connected beside them still gets every signal, with the key's
    digest and ``raw_key()``, and the metrics still count the same requests."""
    seen: list[tuple[str, str, str]] = []

    def receiver(signal: Any, key: str, **kwargs: Any) -> None:
        name = "replayed" if signal is signals.replayed else "claimed"
        seen.append((name, key, signals.raw_key()))

    signals.claimed.connect(receiver)
    signals.replayed.connect(receiver)
    operations: list[str] = []
    signals.store_operation.connect(
        lambda operation, **kw: operations.append(operation), weak=False, dispatch_uid="own"
    )
    try:
        before = requests_by_outcome(prom())
        assert post("/effect/", {"amount": 1}, key="own").status_code == 201
        assert post("/effect/", {"amount": 1}, key="own").status_code == 201
    finally:
        signals.claimed.disconnect(receiver)
        signals.replayed.disconnect(receiver)
        signals.store_operation.disconnect(dispatch_uid="own")

    digest = signals.key_digest("own")
    assert seen == [("claimed", digest, "own"), ("replayed", digest, "own")]
    assert "claim" in operations
    assert "complete" in operations
    assert delta(before, requests_by_outcome(prom())) == {"claimed": 1, "replayed": 1}


def test_django_prometheus_exports_the_same_metrics_once(
    alice: User, post: Post, prom: Scrape
) -> None:
    """django-prometheus's view reads the same default registry: our metrics appear in it,
    once, next to its own."""
    exports = pytest.importorskip("django_prometheus.exports")
    ExportToDjangoView = exports.ExportToDjangoView

    post("/effect/", {"amount": 1}, key="dp")
    text = ExportToDjangoView(RequestFactory().get("/metrics")).content.decode()
    names = [family.name for family in text_string_to_metric_families(text)]

    assert "idempotency_requests" in names
    assert len(names) == len(set(names))
    ours = {family.name for family in text_string_to_metric_families(text)} & {
        family.name
        for family in text_string_to_metric_families(
            prometheus.metrics_view(RequestFactory().get("/m")).content.decode()
        )
    }
    assert "idempotency_requests" in ours


# -- OpenTelemetry ------------------------------------------------------------------------------


class Otel:
    spans = InMemorySpanExporter()
    reader = InMemoryMetricReader()
    installed = False

    @classmethod
    def install(cls) -> None:
        if not cls.installed:
            provider = TracerProvider()
            provider.add_span_processor(SimpleSpanProcessor(cls.spans))
            trace.set_tracer_provider(provider)
            from opentelemetry import metrics

            metrics.set_meter_provider(MeterProvider(metric_readers=[cls.reader]))
            cls.installed = True

    @classmethod
    def points(cls, name: str) -> list[Any]:
        data = cls.reader.get_metrics_data()
        assert data is not None
        return [
            point
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == name
            for point in metric.data.data_points
        ]


@pytest.fixture
def otel(settings: Any) -> type[Otel]:
    Otel.install()
    settings.IDEMPOTENCY = {"METRICS": "opentelemetry"}
    Otel.spans.clear()
    return Otel


def test_a_span_per_request_under_the_server_span_with_its_outcome(
    alice: User, post: Post, otel: type[Otel]
) -> None:
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("POST /effect/") as server:
        post("/effect/", {"amount": 1}, key="o1")
        post("/effect/", {"amount": 1}, key="o1")
        post("/effect/", {"amount": 2}, key="o1")

    spans = [s for s in otel.spans.get_finished_spans() if s.name == "idempotency"]
    assert [s.attributes["idempotency.outcome"] for s in spans] == [
        "claimed",
        "replayed",
        "mismatch",
    ]
    for span in spans:
        assert span.parent is not None
        assert span.parent.span_id == server.get_span_context().span_id
        assert span.attributes["http.route"] == "effect/"
        assert span.attributes["http.request.method"] == "POST"
        assert "o1" not in json.dumps(dict(span.attributes))


def test_span_events_on_take_over_and_outcome_not_stored(
    alice: User, post: Post, otel: type[Otel]
) -> None:
    post("/effect/", {"amount": 1}, key="o2")
    records.update(
        {"key": "o2"},
        state=IdempotencyRecord.State.IN_PROGRESS,
        lease_expires_at=timezone.now() - timedelta(seconds=1),
    )
    otel.spans.clear()
    post("/effect/", {"amount": 1}, key="o2")
    (taken,) = otel.spans.get_finished_spans()
    assert taken.attributes["idempotency.outcome"] == "taken_over"
    assert [event.name for event in taken.events] == ["idempotency.taken_over"]


@pytest.mark.database_store("refuses the completion's SQL statement")
@pytest.mark.urls("tests.project.unknown_outcome_views")
def test_span_event_and_error_when_the_outcome_is_not_stored(
    alice: User, post: Post, otel: type[Otel]
) -> None:
    def refuse_completions(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
        if is_completion(sql, params):
            raise DataError("the store refuses the completion")
        return execute(sql, params, many, context)

    with connection.execute_wrapper(refuse_completions):
        assert post("/uo/decorated/", {"amount": 1}, key="o3").status_code == 201

    (span,) = [s for s in otel.spans.get_finished_spans() if s.name == "idempotency"]
    assert span.attributes["idempotency.outcome"] == "outcome_not_stored"
    assert [event.name for event in span.events] == ["idempotency.outcome_not_stored"]
    assert not span.status.is_ok


def test_opentelemetry_metrics_carry_the_conventional_names_and_attributes(
    alice: User, post: Post, otel: type[Otel]
) -> None:
    post("/effect/", {"amount": 1}, key="o4")
    post("/effect/", {"amount": 1}, key="o4")

    requests = {
        point.attributes["idempotency.outcome"]: point.value
        for point in otel.points("idempotency.requests")
        if point.attributes["http.route"] == "effect/"
    }
    assert requests["claimed"] >= 1
    assert requests["replayed"] >= 1
    for point in otel.points("idempotency.requests"):
        assert set(point.attributes) == {
            "idempotency.outcome",
            "idempotency.store",
            "http.route",
            "http.request.method",
        }
    operations = {
        p.attributes["idempotency.operation"]
        for p in otel.points("idempotency.store.operation.duration")
    }
    assert {"claim", "complete"} <= operations
    assert otel.points("idempotency.response.size")
    assert [p.value for p in otel.points("idempotency.claims.in_flight")] == [0.0]


# -- the log line -------------------------------------------------------------------------------


def test_one_log_line_per_request_with_the_keys_hmac_only(
    alice: User, post: Post, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    settings.IDEMPOTENCY = {"LOG_REQUESTS": True}
    with caplog.at_level(logging.INFO, logger="idempotency_django.requests"):
        post("/effect/7/", {"amount": 1}, key="order-99")
        post("/effect/7/", {"amount": 1}, key="order-99")
    lines = [r for r in caplog.records if r.name == "idempotency_django.requests"]

    assert [r.idempotency_outcome for r in lines] == ["claimed", "replayed"]  # type: ignore[attr-defined]
    for line in lines:
        assert line.http_route == "effect/<int:number>/"  # type: ignore[attr-defined]
        assert line.http_request_method == "POST"  # type: ignore[attr-defined]
        assert line.idempotency_key_hmac == signals.key_digest("order-99")  # type: ignore[attr-defined]
        assert line.idempotency_duration_ms > 0  # type: ignore[attr-defined]
        assert "order-99" not in line.getMessage()


def test_structlogs_stdlib_bridge_picks_up_the_fields(
    alice: User, post: Post, settings: Any
) -> None:
    import io

    settings.IDEMPOTENCY = {"LOG_REQUESTS": True}
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(observability.formatter())  # as the docs show it
    logger = logging.getLogger("idempotency_django.requests")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        post("/effect/", {"amount": 1}, key="order-100")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    (line,) = [json.loads(text) for text in stream.getvalue().splitlines()]

    assert line["idempotency_outcome"] == "claimed"
    assert line["http_route"] == "effect/"
    assert line["idempotency_key_hmac"] == signals.key_digest("order-100")
    assert line["level"] == "info"
    assert "order-100" not in stream.getvalue()


# -- checks -------------------------------------------------------------------------------------


def test_check_e061_bad_values(settings: Any) -> None:
    settings.IDEMPOTENCY = {"METRICS": "statsd", "LOG_REQUESTS": "yes"}
    ids = [error.id for error in checks.check_metrics()]
    assert ids == ["idempotency_django.E061", "idempotency_django.E061"]
    with pytest.raises(SystemCheckError, match="E061"):
        call_command("check")


def test_check_e060_a_missing_extra(settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    settings.IDEMPOTENCY = {"METRICS": ["prometheus", "opentelemetry"]}
    assert checks.check_metrics() == []
    monkeypatch.setitem(checks.EXPORTER_MODULES, "opentelemetry", "opentelemetry_not_installed")
    (error,) = checks.check_metrics()
    assert error.id == "idempotency_django.E060"
    assert "idempotency-django[opentelemetry]" in (error.hint or "")


@pytest.mark.urls("tests.docs_snippets.observability")
def test_the_documented_settings_and_url_serve_the_metrics(
    alice: User, post: Post, settings: Any, client: Client
) -> None:
    settings.IDEMPOTENCY = observability.IDEMPOTENCY
    assert checks.check_metrics() == []
    assert checks.check_settings() == []
    assert observe.watching

    response = client.get("/metrics")

    assert response.status_code == 200
    assert b"# TYPE idempotency_requests_total counter" in response.content


def test_async_views_are_counted_and_spanned_as_sync_ones(
    alice: User, post: Post, prom: Scrape, settings: Any
) -> None:
    before = requests_by_outcome(prom(), route="async/")
    assert post("/async/", {"amount": 1}, key="as").status_code == 201
    assert post("/async/", {"amount": 1}, key="as").status_code == 201
    assert post("/async/", {"amount": 2}, key="as").status_code == 422

    assert delta(before, requests_by_outcome(prom(), route="async/")) == {
        "claimed": 1,
        "replayed": 1,
        "mismatch": 1,
    }


def test_store_durations_and_sizes_fall_in_the_buckets_prometheus_client_would_choose() -> None:
    """The recorder writes a histogram's sum and bucket itself (``_observer``): what a scrape
    reads must be what ``Histogram.observe`` would have written, values on a bound, between
    bounds, below the first and above the last included."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    registry = CollectorRegistry()
    ours = Histogram("ours", "", buckets=prometheus.DURATION_BUCKETS, registry=registry)
    theirs = Histogram("theirs", "", buckets=prometheus.DURATION_BUCKETS, registry=registry)
    observe_ = prometheus._observer(ours)
    values = [0.0, 0.0004, *prometheus.DURATION_BUCKETS, 0.0007, 0.003, 0.3, 2.5001, 60.0]
    for value in values:
        observe_(value)
        theirs.observe(value)

    def samples(name: str) -> list[tuple[str, dict[str, str], float]]:
        return [
            (sample.name.removeprefix(name), sample.labels, sample.value)
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            if family.name == name
            for sample in family.samples
            if not sample.name.endswith("_created")
        ]

    assert samples("ours") == samples("theirs")
    assert ("_count", {}, len(values)) in samples("ours")
