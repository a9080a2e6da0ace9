#!/usr/bin/env python
"""CPU and wall time per whole request on each store, in one process.

    python -m benchmarks.store_requests [--calls 300] [--redis-url URL] [--cluster-url URL]

The benchmark's plain view (``/bench/bare/``) and the same behind ``@idempotent``
(``/bench/commit/``: a new key each time, then one key replayed) through Django's own
handler, against a fresh database of its own (as ``components.py``), once per store: the
database store, the Redis store on ``--redis-url`` (``redis://127.0.0.1:6379/11``), and on a
Redis Cluster when ``--cluster-url`` is given (``redis+cluster://127.0.0.1:7200/0``; start
one with ``REDIS_CLUSTER_PORT=7200 python -m tools.redis_cluster start``). Each store runs
in a process of its own (the store is a setting); its records go under a key prefix of
their own, deleted afterwards. CPU is ``time.process_time`` (best of 3 runs of
``--calls``), the app's process only: not Redis's, nor the database's. No assertion.

Then the cost of the metrics (``IDEMPOTENCY["METRICS"]``) on a replay: ``--rounds``
interleaved rounds of ``--calls`` replays with the metrics off, on Prometheus (its
multiprocess mode, as under gunicorn) and on OpenTelemetry (the SDK configured: a meter
provider with a reader, a tracer provider with a batch span processor whose exporter drops
the spans; each request's span sampled, or sampled out as most are in production), the best
round of each, and its ratio to off; then the metrics' own work alone (``measure_chain``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from benchmarks.components import SETTINGS, own_database, serve_wsgi, wsgi_environ


def measure(calls: int) -> None:
    import django

    django.setup()
    from django.contrib.auth.models import User
    from django.core.handlers.wsgi import WSGIHandler
    from django.core.management import call_command

    call_command("migrate", "--noinput", verbosity=0)
    User.objects.get_or_create(username="alice")
    handler = WSGIHandler()

    def environ(path: str, key: str | None = None) -> dict[str, Any]:
        return wsgi_environ(path, key, HTTP_X_BENCH_USER="alice")

    serve = partial(serve_wsgi, handler)

    replay_key = "store-requests-replay"
    serve(environ("/bench/commit/", replay_key))
    for name, make in (
        ("bare view", lambda: environ("/bench/bare/")),
        ("@idempotent, new key", lambda: environ("/bench/commit/", str(uuid.uuid4()))),
        ("@idempotent, replay", lambda: environ("/bench/commit/", replay_key)),
    ):
        best, best_wall = float("inf"), float("inf")
        for _ in range(3):
            prepared = [make() for _ in range(calls)]
            started, started_wall = time.process_time(), time.perf_counter()
            for env in prepared:
                serve(env)
            best = min(best, (time.process_time() - started) / calls)
            best_wall = min(best_wall, (time.perf_counter() - started_wall) / calls)
        print(f"  {name:<28} {best * 1000:6.3f} ms CPU {best_wall * 1000:6.3f} ms wall", flush=True)
    measure_metrics(lambda: serve(environ("/bench/commit/", replay_key)), calls, ROUNDS)
    measure_chain(calls * 20, ROUNDS)


ROUNDS = 7


def measure_metrics(replay: Callable[[], Any], calls: int, rounds: int) -> None:
    """CPU per replay with the metrics off and on, in interleaved rounds (so that a
    machine's drift hits every mode alike): the best round of each, and its ratio to off."""
    from django.conf import settings
    from django.test import override_settings
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, Sampler, SamplingResult

    class Dropped(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    class Switch(Sampler):
        """Every span recorded, or none (as a sampled-out request's)."""

        on = True

        def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
            return (ALWAYS_ON if self.on else ALWAYS_OFF).should_sample(*args, **kwargs)

        def get_description(self) -> str:
            return "switch"

    sampler = Switch()
    tracing = TracerProvider(sampler=sampler)
    tracing.add_span_processor(BatchSpanProcessor(Dropped()))
    trace.set_tracer_provider(tracing)
    metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
    base = dict(settings.IDEMPOTENCY)
    modes = {
        "off": (None, False),
        "prometheus": ("prometheus", False),
        "opentelemetry, span sampled": ("opentelemetry", True),
        "opentelemetry, span not": ("opentelemetry", False),
    }
    best = dict.fromkeys(modes, float("inf"))
    for _ in range(rounds):
        for mode, (exporter, sampled) in modes.items():
            sampler.on = sampled
            with override_settings(IDEMPOTENCY={**base, "METRICS": exporter}):
                replay()  # the recorder's first labels, outside the timing
                started = time.process_time()
                for _ in range(calls):
                    replay()
                best[mode] = min(best[mode], (time.process_time() - started) / calls)
    tracing.shutdown()
    print(f"  replay CPU, metrics off and on (best of {rounds} interleaved rounds x {calls}):")
    for mode, seconds in best.items():
        ratio = seconds / best["off"]
        print(f"    {mode:<26} {seconds * 1000:6.3f} ms CPU  {ratio:5.3f}x off", flush=True)


def measure_chain(calls: int, rounds: int) -> None:
    """The metrics' own work on a replay, without the request around it: the frame
    (``observe.observed``), the store operation's timing and signal, the ``replayed``
    signal. CPU per chain in interleaved rounds: nothing connected, Prometheus, and
    Prometheus's receivers with no recorder (the signals and the frame alone). A loop keeps
    the caches hot: a request pays more for the same code (docs/observability.md, "Cost")."""
    import logging

    from django.conf import settings
    from django.http import HttpResponse
    from django.test import RequestFactory, override_settings
    from django.urls import resolve

    from idempotency_django import signals
    from idempotency_django.core import observe
    from idempotency_django.store.base import get_store

    store = get_store()
    request = RequestFactory().post("/bench/commit/")
    request.resolver_match = resolve("/bench/commit/")

    answer = HttpResponse()

    def replay() -> HttpResponse:
        signals.timed("claim", store, lambda: None)
        signals.emit(signals.replayed, logging.DEBUG, "Replayed.", "1", "POST /bench/commit/",
                     "store-requests-replay", status=201, waited=False)  # fmt: skip
        return answer

    def chain() -> None:
        if observe.watching:
            observe.observed(request, replay)
        else:
            replay()

    base = dict(settings.IDEMPOTENCY)
    modes = {"off": None, "prometheus": "prometheus", "signals and frame only": "prometheus"}
    best = dict.fromkeys(modes, float("inf"))
    for _ in range(rounds):
        for mode, exporter in modes.items():
            with override_settings(IDEMPOTENCY={**base, "METRICS": exporter}):
                if mode == "signals and frame only":
                    observe.recorders.clear()
                chain()
                started = time.process_time()
                for _ in range(calls):
                    chain()
                best[mode] = min(best[mode], (time.process_time() - started) / calls)
    print(f"  the metrics' own work alone (best of {rounds} interleaved rounds x {calls}):")
    for mode, seconds in best.items():
        print(
            f"    {mode:<26} {seconds * 1e6:6.2f} µs CPU  +{(seconds - best['off']) * 1e6:5.2f} µs"
        )


def clean(url: str, prefix: str) -> None:
    import redis
    from redis.cluster import RedisCluster

    client = (
        RedisCluster.from_url(url.replace("+cluster", ""))
        if "+cluster" in url
        else redis.Redis.from_url(url)
    )
    with client:
        for key in client.scan_iter(match=f"{prefix}:*", count=1000):
            client.delete(key)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="CPU and wall per request on each store.")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BENCH_DATABASE_URL", "postgres://root@127.0.0.1:5432/bench"),
        help="PostgreSQL or MariaDB server; the database used is its name + _stores",
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/11")
    parser.add_argument("--cluster-url", default="")
    parser.add_argument("--store", default="", help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args(argv)
    if args.store:
        measure(args.calls)
        return 0
    parts = urlsplit(args.database_url)
    name = f"{parts.path.strip('/')}_stores"
    prefix = f"store-requests-{os.getpid()}"
    stores = {"database store": ""}
    stores["Redis store, " + args.redis_url] = args.redis_url
    if args.cluster_url:
        stores["Redis store, " + args.cluster_url] = args.cluster_url
    for label, redis_url in stores.items():
        with own_database(args.database_url, name) as url:
            run_child(label, url, redis_url, prefix, args.calls)
    return 0


def run_child(label: str, url: str, redis_url: str, prefix: str, calls: int) -> None:
    """``measure`` in a process of its own, on the database at ``url`` and the store of
    ``redis_url`` (the database store if empty)."""
    multiprocess = tempfile.mkdtemp(prefix="bench-prometheus-")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": SETTINGS,
        "DATABASE_URL": url,
        "EXAMPLE_PROVIDER_DELAY_MS": "0",
        "EXAMPLE_REDIS_URL": redis_url,
        "EXAMPLE_REDIS_KEY_PREFIX": prefix,
        # The Prometheus exporter as under gunicorn: values in files (measure_metrics).
        "PROMETHEUS_MULTIPROC_DIR": multiprocess,
    }
    print(f"{label} (CPU per request, best of 3 x {calls}):", flush=True)
    try:
        command = [sys.executable, "-m", "benchmarks.store_requests", "--store", "child"]
        subprocess.run([*command, "--calls", str(calls)], env=env, check=True)
    finally:
        shutil.rmtree(multiprocess, ignore_errors=True)
        if redis_url:
            clean(redis_url, prefix)


if __name__ == "__main__":
    sys.exit(main())
