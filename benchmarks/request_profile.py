#!/usr/bin/env python
"""Where one protected request's CPU goes: a loop of requests through Django's handler, for a
profiler or an instruction counter.

    python -m benchmarks.request_profile --store redis [--scenario new] [--calls 2000]
    python -m benchmarks.request_profile --store redis --profile      # cProfile, by file
    python -m benchmarks.request_profile --store redis --calls 300 --callgrind # instructions

The benchmark's views (``/bench/bare/`` and ``/bench/commit/``), as ``store_requests.py``
serves them, against a fresh database of its own (``--database-url``, its name +
``_profile``) and, with ``--store redis``, the Redis store on ``--redis-url`` under a key
prefix of its own (deleted afterwards). ``--scenario``: ``bare`` (the view unprotected),
``new`` (a new key each time), ``replay`` (one key, every request after the first a
replay), ``store`` (the store's claim and completion alone, called directly), or on the
DRF view with token authentication ``drf-bare`` and ``drf-replay``.
``--metrics prometheus`` (or ``opentelemetry``) turns the metrics on, to count what they
add (Prometheus's values in files, as under gunicorn).
``--callgrind`` runs the child under callgrind with its instrumentation on around the
measured loop only (``callgrind_control -i``), and prints its instructions per request
(``callgrind_annotate`` the file it names for where they go). ``--profile`` prints
cProfile's totals per file group (Django, redis-py, this package, the rest) and its top
functions. With neither, the CPU per request (``time.process_time``).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from benchmarks.components import SETTINGS, own_database, serve_wsgi, wsgi_environ

PATHS = {
    "bare": "/bench/bare/",
    "new": "/bench/commit/",
    "replay": "/bench/commit/",
    "store": "",
    # The DRF view with TokenAuthentication (drf_views.py), bare and behind the mixin.
    "drf-bare": "/bench/drf/bare/",
    "drf-replay": "/bench/drf/protected/",
}


def _callgrind(on: bool) -> None:
    """Callgrind's instrumentation on or off for this process (``callgrind_control -i``,
    through valgrind's gdbserver). The process spins meanwhile, not blocked in a system
    call, so that valgrind polls for the command (``--vgdb-poll``)."""
    control = subprocess.Popen(
        ["callgrind_control", "-i", "on" if on else "off", str(os.getpid())],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while control.poll() is None:
        pass


def measure(scenario: str, calls: int, mode: str) -> None:
    import django

    django.setup()
    from django.contrib.auth.models import User
    from django.core.handlers.wsgi import WSGIHandler
    from django.core.management import call_command

    call_command("migrate", "--noinput", verbosity=0)
    if os.environ.get("REQUEST_PROFILE_METRICS"):
        from django.conf import settings

        from idempotency_django.core import observe

        metrics = os.environ["REQUEST_PROFILE_METRICS"]
        settings.IDEMPOTENCY = {**settings.IDEMPOTENCY, "METRICS": metrics}
        observe.connect()
    alice = User.objects.get_or_create(username="alice")[0]
    headers = {"HTTP_X_BENCH_USER": "alice"}
    if scenario.startswith("drf"):
        from rest_framework.authtoken.models import Token

        headers["HTTP_AUTHORIZATION"] = f"Token {Token.objects.get_or_create(user=alice)[0].key}"
    handler = WSGIHandler()
    serve = partial(serve_wsgi, handler)
    replay_key = "request-profile-replay"

    def environ() -> dict[str, Any]:
        key = None
        if scenario == "new":
            key = str(uuid.uuid4())
        elif scenario.endswith("replay"):
            key = replay_key
        return wsgi_environ(PATHS[scenario], key, **headers)

    if scenario == "store":
        serve = store_calls()  # type: ignore[assignment]
    for _ in range(50):  # warm: connections, caches, the replay key's record
        serve(environ())
    prepared = [environ() for _ in range(calls)]
    if mode == "callgrind":
        _callgrind(True)
        for env in prepared:
            serve(env)
        _callgrind(False)
        return
    if mode == "profile":
        profiler = cProfile.Profile(time.process_time)  # CPU, not waits
        profiler.enable()
        for env in prepared:
            serve(env)
        profiler.disable()
        report(profiler, calls)
        if os.environ.get("REQUEST_PROFILE_DUMP"):
            profiler.dump_stats(os.environ["REQUEST_PROFILE_DUMP"])
        return
    started = time.process_time()
    for env in prepared:
        serve(env)
    print(f"{scenario}: {(time.process_time() - started) / calls * 1e6:.1f} us CPU per request")


def store_calls() -> Callable[[Any], None]:
    """The store's part of a first request alone: its claim, then its completion, called
    as the request path calls them (the values of a 201 with a ``Location``)."""
    from datetime import timedelta

    from django.utils import timezone

    from idempotency_django.store import get_store
    from idempotency_django.store.base import Completion, Scope, Write

    store = get_store().bind("default")
    headers = (("Content-Type", "application/json"), ("Location", "/c/1"))

    def call(_env: Any) -> None:
        token = uuid.uuid4().hex
        scope = Scope(account="1", endpoint="POST /bench/commit/", key=token)
        write = Write(
            scope=scope,
            token=token,
            fingerprint="3:" + "a" * 64,
            created_at=timezone.now(),
            lease=timedelta(seconds=10),
            ttl=timedelta(days=1),
        )
        assert store.claim(write)
        done = Completion(
            status=201,
            headers=headers,
            body=b'{"id": 1, "amount": 1000, "currency": "EUR"}',
            completed_at=timezone.now(),
            ttl=timedelta(days=1),
        )
        assert store.complete(scope, token, done)

    return call


GROUPS = (
    ("idempotency_django", "/idempotency_django/"),
    ("redis-py", "/redis/"),
    ("Django", "/django/"),
    ("psycopg", "/psycopg"),
    ("benchmark views", "/benchmarks/"),
)


def report(profiler: cProfile.Profile, calls: int) -> None:
    """Own (tottime) time per file group, then the top functions by own time."""
    stats = pstats.Stats(profiler)
    groups: dict[str, float] = {}
    total = 0.0
    for (filename, _line, _name), (_cc, _nc, tottime, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        group = next((name for name, part in GROUPS if part in filename), "other")
        if filename == "~":
            group = "builtins (C)"
        groups[group] = groups.get(group, 0.0) + tottime
        total += tottime
    print(f"own CPU per request, by group (cProfile, {calls} calls; profiled, so inflated):")
    for name, seconds in sorted(groups.items(), key=lambda item: -item[1]):
        print(f"  {name:<22} {seconds / calls * 1e6:8.1f} us  {seconds / total:6.1%}")
    stats.sort_stats("tottime").print_stats(35)


def instructions(path: str) -> int:
    """The instruction count of a callgrind output: its ``totals:`` line (its ``summary:``
    is 0 when instrumentation started off)."""
    with open(path) as file:
        for line in file:
            if line.startswith("totals:"):
                return int(line.split()[1])
    raise ValueError(f"{path}: no totals line")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", choices=("database", "redis"), default="redis")
    parser.add_argument("--scenario", choices=tuple(PATHS), default="new")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--callgrind", action="store_true")
    parser.add_argument("--callgrind-out", default="", help="callgrind's output file")
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BENCH_DATABASE_URL", "postgres://root@127.0.0.1:5432/bench"),
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/11")
    parser.add_argument(
        "--metrics",
        choices=("prometheus", "opentelemetry"),
        help="IDEMPOTENCY['METRICS'] (Prometheus as under gunicorn: values in files)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    mode = "callgrind" if args.callgrind else "profile" if args.profile else "cpu"
    if args.child:
        measure(args.scenario, args.calls, mode)
        return 0
    parts = urlsplit(args.database_url)
    name = f"{parts.path.strip('/')}_profile_{os.getpid()}"
    prefix = f"request-profile-{os.getpid()}"
    multiprocess = tempfile.mkdtemp(prefix="request-profile-prometheus-")
    with own_database(args.database_url, name) as url:
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": SETTINGS,
            "DATABASE_URL": url,
            "EXAMPLE_PROVIDER_DELAY_MS": "0",
            "EXAMPLE_REDIS_URL": args.redis_url if args.store == "redis" else "",
            "EXAMPLE_REDIS_KEY_PREFIX": prefix,
            "REQUEST_PROFILE_METRICS": args.metrics or "",
            "PROMETHEUS_MULTIPROC_DIR": multiprocess,
        }
        command = [sys.executable, "-m", "benchmarks.request_profile", "--child"]
        out = args.callgrind_out or f"/tmp/request-profile-{os.getpid()}.callgrind"
        if args.callgrind:
            valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
            command = [*valgrind, f"--callgrind-out-file={out}", *command]
        command += ["--scenario", args.scenario, "--calls", str(args.calls)]
        command += ["--callgrind"] if args.callgrind else ["--profile"] if args.profile else []
        try:
            subprocess.run(
                command, env=env, check=True, stderr=subprocess.DEVNULL if args.callgrind else None
            )
            if args.callgrind:
                per_request = instructions(out) / args.calls
                print(f"{args.scenario}: {per_request:,.0f} instructions per request ({out})")
        finally:
            shutil.rmtree(multiprocess, ignore_errors=True)
            if args.store == "redis":
                from benchmarks.store_requests import clean

                clean(args.redis_url, prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
