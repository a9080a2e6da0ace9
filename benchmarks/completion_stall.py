#!/usr/bin/env python
"""What a Redis stall during the completion costs a request: its answer's delay, and whether
its outcome was stored.

    python -m benchmarks.completion_stall [--pauses 0,0.5,2,5,12] [--lease 10]
        [--socket-timeout 1] [--requests 2] [--port 6391] [--database-url URL]

The benchmark's charge behind ``@idempotent`` on the Redis store, through Django's own
handler, in one process, against a ``redis-server`` of its own (``--port``, default
``REDIS_STANDALONE_PORT`` or 6391) and a fresh database of its own. For each pause, each
request's claim is followed at once by ``CLIENT PAUSE <pause> WRITE`` (the view then runs
and its completion meets the stall), and the table shows when the answer came (wall time,
the whole request), and whether a retry of the key replays (the outcome was stored) or
not. The request waits for its completion (docs/store.md, "When the store fails"): the
added delay is the stall, up to a lease; past the lease the completion is given up and
``outcome_not_stored`` is signalled. The worker serving the request is busy that long.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

from benchmarks.components import SETTINGS, own_database, wsgi_environ


def measure(pauses: list[float], lease: float, socket_timeout: float, requests: int) -> None:
    import django

    django.setup()
    import redis
    from django.conf import settings
    from django.contrib.auth.models import User
    from django.core.handlers.wsgi import WSGIHandler
    from django.core.management import call_command

    from idempotency_django import signals

    call_command("migrate", "--noinput", verbosity=0)
    User.objects.get_or_create(username="alice")
    options = dict(settings.IDEMPOTENCY.get("STORE_OPTIONS", {}))
    settings.IDEMPOTENCY = {
        **settings.IDEMPOTENCY,
        "LEASE_SECONDS": lease,
        "STORE_OPTIONS": {**options, "SOCKET_TIMEOUT": socket_timeout},
    }
    stall = redis.Redis.from_url(options["URL"])
    armed: list[float] = []
    not_stored: list[str] = []

    def pause_after_the_claim(sender: Any, **kwargs: Any) -> None:
        if armed:
            stall.execute_command("CLIENT", "PAUSE", str(int(armed.pop() * 1000)), "WRITE")

    def lost(sender: Any, **kwargs: Any) -> None:
        not_stored.append(signals.raw_key())  # ``key`` is its digest

    signals.claimed.connect(pause_after_the_claim, weak=False)
    signals.outcome_not_stored.connect(lost, weak=False)
    handler = WSGIHandler()

    def serve(key: str) -> tuple[str, dict[str, str]]:
        statuses: list[tuple[str, dict[str, str]]] = []
        response = handler(
            wsgi_environ("/bench/commit/", key, HTTP_X_BENCH_USER="alice"),
            lambda status, headers: statuses.append((status, dict(headers))),
        )
        b"".join(response)
        response.close()
        return statuses[0]

    def writable() -> None:
        while True:  # the pause is over once a write goes through
            try:
                stall.set("completion-stall:probe", "1")
                return
            except redis.RedisError:
                time.sleep(0.05)

    print(
        f"lease {lease:g} s, SOCKET_TIMEOUT {socket_timeout:g} s; "
        "answer: when the request was answered; stored: a retry of its key replays",
        flush=True,
    )
    print(f"  {'stall':>6}  {'answer after':>12}  stored", flush=True)
    for pause in pauses:
        for _ in range(requests):
            key = f"stall-{uuid.uuid4()}"
            if pause:
                armed.append(pause)
            started = time.perf_counter()
            status, _ = serve(key)
            took = time.perf_counter() - started
            stall_ends = threading.Thread(target=writable)
            stall_ends.start()
            stall_ends.join(pause + 10)
            _, headers = serve(key)
            stored = headers.get("Idempotent-Replayed") == "true"
            note = " (outcome_not_stored)" if key in not_stored else ""
            print(
                f"  {pause:>5g}s  {took * 1000:>9.0f} ms  {'yes' if stored else 'NO'}"
                f" [{status[:3]}]{note}",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="What a Redis stall costs a completion.")
    parser.add_argument("--pauses", default="0,0.5,2,5,12", help="seconds, comma-separated")
    parser.add_argument("--lease", type=float, default=10.0)
    parser.add_argument("--socket-timeout", type=float, default=1.0)
    parser.add_argument("--requests", type=int, default=2, help="per pause")
    parser.add_argument("--port", type=int, default=0, help="the throwaway redis-server's")
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BENCH_DATABASE_URL", "postgres://root@127.0.0.1:5432/bench"),
        help="PostgreSQL or MariaDB server; the database used is its name + _stall",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    pauses = [float(p) for p in args.pauses.split(",") if p]
    if args.child:
        measure(pauses, args.lease, args.socket_timeout, args.requests)
        return 0
    from tools.redis_cluster import StandaloneRedis

    server = StandaloneRedis(**({"port": args.port} if args.port else {})).start()
    parts = urlsplit(args.database_url)
    try:
        with own_database(args.database_url, f"{parts.path.strip('/')}_stall") as url:
            env = {
                **os.environ,
                "DJANGO_SETTINGS_MODULE": SETTINGS,
                "DATABASE_URL": url,
                "EXAMPLE_PROVIDER_DELAY_MS": "0",
                "EXAMPLE_REDIS_URL": server.url,
                "EXAMPLE_REDIS_KEY_PREFIX": "completion-stall",
            }
            command = [sys.executable, "-m", "benchmarks.completion_stall", "--child"]
            command += ["--pauses", args.pauses, "--lease", str(args.lease)]
            command += ["--socket-timeout", str(args.socket_timeout)]
            subprocess.run([*command, "--requests", str(args.requests)], env=env, check=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
