#!/usr/bin/env python
"""Where a protected request's time goes: CPU per call of each piece, in one process.

    python benchmarks/components.py [--calls 400]

No HTTP and no load: the benchmark's views and the engine's functions are called directly
(with ``RequestFactory`` requests) against a fresh PostgreSQL database, and each line is the
CPU time of this process per call (``time.process_time``, best of 3 runs of ``--calls``), so
it does not count waiting for the database and is much steadier than throughput on a busy
machine. The last lines time the same statements written as raw SQL, for comparison: what
the ORM costs on top of the database work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import common  # noqa: E402

SETTINGS = "benchmarks.benchproject.settings"
BODY = json.dumps({"amount": 1000, "currency": "EUR", "card": "tok_visa"})
TABLE = "idempotency_django_idempotencyrecord"


def measure(calls: int) -> list[tuple[str, float]]:
    import django

    django.setup()
    from django.contrib.auth.models import User
    from django.db import connection
    from django.http import HttpRequest
    from django.test import RequestFactory
    from django.utils import timezone

    from benchmarks.benchproject import views
    from idempotency_django import engine
    from idempotency_django.heartbeat import heartbeat
    from idempotency_django.protect import Guard, ViewOptions
    from idempotency_django.responses import capture
    from idempotency_django.store import store

    factory = RequestFactory()
    alice = User.objects.get(username="alice")
    options = ViewOptions()

    def request(key: str) -> HttpRequest:
        made = factory.post(
            "/bench/commit/", data=BODY, content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
        )
        made.user = alice
        return made

    def new_request() -> HttpRequest:
        return request(str(uuid.uuid4()))

    def guard() -> Guard:
        made = Guard.for_request(new_request(), options)
        assert made is not None
        return made

    def claim() -> engine.Claim:
        g = guard()
        began = engine.begin(g.scope, g.fingerprint, g.policy.options)
        assert isinstance(began, engine.Claim)
        return began

    results: list[tuple[str, float]] = []

    def cpu(name: str, call: Callable[[Any], object], prepare: Callable[[], Any]) -> None:
        best = float("inf")
        for _ in range(3):
            prepared = [prepare() for _ in range(calls)]
            started = time.process_time()
            for item in prepared:
                call(item)
            best = min(best, (time.process_time() - started) / calls)
        results.append((name, best))
        print(f"{name:<58} {best * 1000:7.3f} ms", flush=True)

    connection.ensure_connection()
    stored = views.commit(request("components-replay"))
    outcome = capture(stored)
    replay = Guard.for_request(request("components-replay"), options)
    assert replay is not None
    nothing: Callable[[], None] = lambda: None  # noqa: E731

    print(f"CPU per call, best of 3 x {calls} calls:")
    cpu("null view (no database)", views.null, new_request)
    cpu("bare view (validation + INSERT of a Charge)", views.bare, new_request)
    cpu("@idempotent view, new key, commit mode", views.commit, new_request)
    cpu("@idempotent view, new key, atomic mode", views.atomic, new_request)
    cpu("@idempotent view, replay", views.commit, lambda: request("components-replay"))
    cpu(
        "  Guard.for_request: parse, scope, fingerprint",
        lambda r: Guard.for_request(r, options),
        new_request,
    )
    cpu(
        "  engine.begin, new key: the claim INSERT",
        lambda g: engine.begin(g.scope, g.fingerprint, g.policy.options),
        guard,
    )
    cpu(
        "  engine.complete: the completion UPDATE (ORM)",
        lambda c: engine.complete(c, outcome),
        claim,
    )

    def beat(c: engine.Claim) -> None:
        heartbeat.register(c, 10, 300)
        heartbeat.unregister(c)

    cpu("  heartbeat.register + unregister", beat, claim)
    cpu(
        "  engine.begin, replay: INSERT attempt + read",
        lambda _: engine.begin(replay.scope, replay.fingerprint, replay.policy.options),
        nothing,
    )
    cpu(
        "  store.read alone (ORM, only the columns needed)",
        lambda _: store.read(replay.policy.alias, replay.scope.lookup(), replay.fingerprint),
        nothing,
    )

    def raw_read(_: object) -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT id, fingerprint, state, token, lease_expires_at, response_status, "
                f"response_headers, response_body, expires_at FROM {TABLE} "
                "WHERE account = %s AND endpoint = %s AND key = %s",
                [replay.scope.account, replay.scope.endpoint, replay.scope.key],
            )
            cursor.fetchone()

    def raw_complete(c: engine.Claim) -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {TABLE} SET state = %s, response_status = %s, response_headers = %s, "
                "response_body = %s, completed_at = %s, lease_expires_at = NULL "
                "WHERE token = %s AND state = %s AND account = %s AND endpoint = %s "
                "AND key = %s",
                [
                    "completed",
                    outcome.status,
                    json.dumps([list(pair) for pair in outcome.headers]),
                    outcome.body,
                    timezone.now(),
                    c.token,
                    "in_progress",
                    c.scope.account,
                    c.scope.endpoint,
                    c.scope.key,
                ],
            )

    def round_trip(_: object) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")

    cpu("  for comparison: the same read as raw SQL", raw_read, nothing)
    cpu("  for comparison: the same completion as raw SQL", raw_complete, claim)
    cpu("  for comparison: one round trip (SELECT 1)", round_trip, nothing)
    connection.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="CPU per call of each piece of a request.")
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BENCH_DATABASE_URL", "postgres://root@127.0.0.1:5432/bench"),
        help="PostgreSQL server; the database used is its name + _components",
    )
    args = parser.parse_args(argv)
    base = common.database(args.database_url)
    db = base.renamed(f"{base.name}_components")
    common.create_database(db)
    try:
        env = common.project_env(SETTINGS, db, EXAMPLE_PROVIDER_DELAY_MS="0")
        common.manage(env, "migrate", "--noinput", "-v", "0")
        os.environ.update(
            DJANGO_SETTINGS_MODULE=SETTINGS, DATABASE_URL=db.url, EXAMPLE_PROVIDER_DELAY_MS="0"
        )
        measure(args.calls)
    finally:
        common.drop_database(db)
    return 0


if __name__ == "__main__":
    sys.exit(main())
