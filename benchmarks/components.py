#!/usr/bin/env python
"""Where a protected request's time goes: CPU per call of each piece, in one process.

    python -m benchmarks.components [--calls 400] [--database-url URL] [--profile]

No HTTP server and no load: requests go through Django's own handler (middleware, URL
routing, the view) and through the app's functions directly, against a fresh database of
its own (PostgreSQL or MariaDB), and each line is the CPU time of this process per call
(``time.process_time``, best of 3 runs of ``--calls``). It does not count waiting for the
database, so it is much steadier than throughput on a busy machine. Each whole request is
shown next to the bare view's, as "added": that is the app's cost per request.

The last block answers whether an in-process replay cache would pay: what a replay costs
with its database read, and what it would cost without it (the read replaced by a lookup in
a dict), in CPU and in wall time per call.

``--profile`` prints, after the table, the functions where the app's CPU goes (cProfile of
the first request and of the replay through the handler).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

REPO_ROOT = Path(__file__).resolve().parents[1]

SETTINGS = "benchmarks.benchproject.settings"
BODY = json.dumps({"amount": 1000, "currency": "EUR", "card": "tok_visa"}).encode()
REPLAY_KEY = "components-replay"
Row = tuple[str, float]


def _views() -> Any:
    """The benchmark's charge (parse the body, validate, one ``INSERT`` of a ``Charge``),
    bare and behind ``@idempotent``, defined here so that this file measures the package
    whatever the benchmark project's views look like."""
    from django.contrib.auth.models import User
    from django.http import HttpRequest, HttpResponse
    from django.urls import path
    from django.views.decorators.csrf import csrf_exempt
    from django.views.decorators.http import require_POST

    from example_project.payments import jsonbody, service
    from idempotency_django.decorators import idempotent

    def charge(request: HttpRequest) -> HttpResponse:
        account = request.user
        if not isinstance(account, User):
            return HttpResponse(status=401)
        outcome = service.charge(account, jsonbody.loads(request.body))
        response = HttpResponse(
            json.dumps(outcome.data), status=outcome.status, content_type=outcome.content_type
        )
        for name, value in outcome.headers.items():
            response[name] = value
        return response

    class Views:
        bare = csrf_exempt(require_POST(charge))
        commit = csrf_exempt(require_POST(idempotent(charge)))
        atomic = csrf_exempt(require_POST(idempotent(mode="atomic")(charge)))
        urlpatterns = [
            path("bare/", bare),
            path("commit/", commit),
            path("atomic/", atomic),
        ]

    return Views


def measure(calls: int, profile: bool) -> list[Row]:
    import django

    django.setup()
    from django.conf import settings
    from django.contrib.auth.models import User
    from django.core.handlers.wsgi import WSGIHandler
    from django.core.management import call_command
    from django.db import connection
    from django.http import HttpRequest
    from django.test import RequestFactory

    from idempotency_django.core import claims, shell
    from idempotency_django.core.options import Options
    from idempotency_django.core.protect import Guard
    from idempotency_django.store import store

    call_command("migrate", "--noinput", verbosity=0)
    User.objects.get_or_create(username="alice")
    views = _views()
    settings.ROOT_URLCONF = views
    handler = WSGIHandler()
    factory = RequestFactory()
    alice = User.objects.get(username="alice")
    options = Options()

    def request(key: str, path: str = "/commit/") -> HttpRequest:
        made = factory.post(
            path, data=BODY, content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
        )
        made.user = alice
        return made

    def environ(path: str, key: str | None = None) -> dict[str, Any]:
        return wsgi_environ(path, key, HTTP_X_BENCH_USER="alice")

    serve = partial(serve_wsgi, handler)

    results: list[Row] = []

    def cpu(name: str, call: Callable[[Any], object], prepare: Callable[[], Any]) -> float:
        best = float("inf")
        for _ in range(3):
            prepared = [prepare() for _ in range(calls)]
            started = time.process_time()
            for item in prepared:
                call(item)
            best = min(best, (time.process_time() - started) / calls)
        results.append((name, best))
        print(f"{name:<64} {best * 1000:7.3f} ms", flush=True)
        return best

    def wall(name: str, call: Callable[[], object]) -> float:
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            for _ in range(calls):
                call()
            best = min(best, (time.perf_counter() - started) / calls)
        print(f"{name:<64} {best * 1000:7.3f} ms (wall)", flush=True)
        return best

    def added(name: str, value: float, bare: float) -> None:
        print(f"{'  added over bare: ' + name:<64} {(value - bare) * 1000:7.3f} ms", flush=True)
        results.append((f"added: {name}", value - bare))

    connection.ensure_connection()
    serve(environ("/commit/", REPLAY_KEY))  # the record every replay below replays
    serve(environ("/atomic/", REPLAY_KEY + "-atomic"))

    def new_key() -> str:
        return str(uuid.uuid4())

    print(f"CPU per call, best of 3 x {calls} calls ({connection.vendor}):")
    bare = cpu("bare view, whole request (handler)", serve, lambda: environ("/bare/"))
    first = cpu(
        "@idempotent, new key, commit mode, whole request",
        serve,
        lambda: environ("/commit/", new_key()),
    )
    first_atomic = cpu(
        "@idempotent, new key, atomic mode, whole request",
        serve,
        lambda: environ("/atomic/", new_key()),
    )
    replay = cpu(
        "@idempotent, replay, whole request",
        serve,
        lambda: environ("/commit/", REPLAY_KEY),
    )
    added("first request (commit)", first, bare)
    added("first request (atomic)", first_atomic, bare)
    # A replay runs no view: its cost is against the bare request, whose view work it skips.
    added("replay", replay, bare)

    def guard() -> Guard:
        made = Guard.for_request(request(new_key()), options)
        assert made is not None
        return made

    def claim() -> claims.Claim:
        g = guard()
        began = shell.claim_or_replay(g.scope, g.fingerprint, g.policy.claiming)
        assert isinstance(began, claims.Claim)
        return began

    replayed = Guard.for_request(request(REPLAY_KEY), options)
    assert replayed is not None
    outcome_of = shell.claim_or_replay(
        replayed.scope, replayed.fingerprint, replayed.policy.claiming
    )
    assert not isinstance(outcome_of, claims.Claim)
    nothing: Callable[[], None] = lambda: None  # noqa: E731

    cpu(
        "  Guard.for_request: parse, scope, fingerprint, policy",
        lambda r: Guard.for_request(r, options),
        lambda: request(new_key()),
    )
    cpu(
        "  shell.claim_or_replay, new key: the claim",
        lambda g: shell.claim_or_replay(g.scope, g.fingerprint, g.policy.claiming),
        guard,
    )
    cpu("  shell.complete: the completion", lambda c: shell.complete(c, outcome_of), claim)
    cpu("  shell.release: the release", shell.release, claim)
    cpu(
        "  shell.claim_or_replay, replay: claim attempt + read",
        lambda _: shell.claim_or_replay(
            replayed.scope, replayed.fingerprint, replayed.policy.claiming
        ),
        nothing,
    )

    if not hasattr(store, "claim_or_read"):  # an older version of the package
        return results
    # Item 5: the replay with and without its database read. "Without" serves the record
    # from a dict, as an in-process cache would on a hit; everything else is the same.
    values: dict[str, Any] = {
        **replayed.scope.lookup(),
        "fingerprint": replayed.fingerprint,
        "state": "in_progress",
        "token": claims.new_token(),
        "lease_expires_at": None,
        "response_headers": [],
        "created_at": None,
        "expires_at": None,
    }

    # The request path's store: bound to the policy's alias (the same instance before the
    # store was bound to its alias).
    bound = replayed.policy.claiming.store

    def claim_or_read(_: object) -> object:
        from django.utils import timezone

        now = timezone.now()
        try:
            from idempotency_django.store.base import Write
        except ImportError:  # before the store's writes were typed
            older: Any = store
            return older.claim_or_read(
                replayed.policy.alias,
                {**values, "created_at": now, "lease_expires_at": now, "expires_at": now},
                replayed.fingerprint,
            )
        write = Write(
            replayed.scope, values["token"], replayed.fingerprint, now, timedelta(0), timedelta(0)
        )
        return bound.claim_or_read(write)

    snapshot = claim_or_read(None)
    cpu("  store.claim_or_read on a completed key (the replay's DB work)", claim_or_read, nothing)
    with _cached(bound, snapshot):
        cached_cpu = cpu(
            "@idempotent, replay served from a dict, whole request",
            serve,
            lambda: environ("/commit/", REPLAY_KEY),
        )
        cached_wall = wall(
            "@idempotent, replay served from a dict, whole request",
            lambda: serve(environ("/commit/", REPLAY_KEY)),
        )
    replay_wall = wall(
        "@idempotent, replay, whole request", lambda: serve(environ("/commit/", REPLAY_KEY))
    )
    print(
        f"{'  a replay cache would save':<64} {(replay - cached_cpu) * 1000:7.3f} ms CPU, "
        f"{(replay_wall - cached_wall) * 1000:.3f} ms wall per replay",
        flush=True,
    )
    results.append(("replay cache saves (CPU)", replay - cached_cpu))

    def round_trip(_: object) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")

    cpu("  for comparison: one round trip (SELECT 1)", round_trip, nothing)

    if profile:
        for name, path, key in (
            ("first request", "/commit/", None),
            ("replay", "/commit/", REPLAY_KEY),
        ):
            envs = [environ(path, key or new_key()) for _ in range(calls)]
            profiler = cProfile.Profile(time.process_time)
            profiler.enable()
            for env in envs:
                serve(env)
            profiler.disable()
            print(f"\n--- profile: {name}, {calls} calls, by cumulative CPU time")
            stats = pstats.Stats(profiler).sort_stats("cumulative")
            stats.print_stats(r"idempotency_django|django/db|psycopg|MySQLdb", 30)
    connection.close()
    return results


@contextmanager
def _cached(store: Any, snapshot: Any) -> Iterator[None]:
    """Serve every claim attempt from ``snapshot``, as a replay cache's hit would."""
    original = store.claim_or_read
    store.claim_or_read = lambda *given: snapshot
    try:
        yield
    finally:
        store.claim_or_read = original


# -- requests through Django's handler, and a database of its own ------------------------------


def wsgi_environ(path: str, key: str | None = None, **headers: str) -> dict[str, Any]:
    """A WSGI environ for a POST of ``BODY`` to ``path``, with ``key`` as its idempotency key
    and ``headers`` (``HTTP_…`` names) as the caller's."""
    env: dict[str, Any] = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": path,
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(BODY),
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(BODY)),
        **headers,
    }
    if key is not None:
        env["HTTP_IDEMPOTENCY_KEY"] = key
    return env


def serve_wsgi(handler: Callable[..., Any], env: dict[str, Any]) -> None:
    """One request through ``handler``, its body read to the end; it must answer 2xx."""
    statuses: list[str] = []
    response = handler(env, lambda status, headers: statuses.append(status))
    b"".join(response)
    response.close()
    assert statuses[0][:1] == "2", statuses


@contextmanager
def own_database(server_url: str, name: str) -> Iterator[str]:
    """A fresh database ``name`` on the server of ``server_url`` (PostgreSQL or MariaDB),
    dropped afterwards: its URL."""
    parts = urlsplit(server_url)
    url = urlunsplit(parts._replace(path=f"/{name}"))
    postgres = parts.scheme.startswith("postgres")
    drop = f"DROP DATABASE IF EXISTS `{name}`" + (" WITH (FORCE)" if postgres else "")
    _server_execute(url, drop)
    _server_execute(
        url, f"CREATE DATABASE `{name}`" + ("" if postgres else " CHARACTER SET utf8mb4")
    )
    try:
        yield url
    finally:
        _server_execute(url, drop)


def _server_execute(url: str, statement: str) -> None:
    parts = urlsplit(url)
    if parts.scheme.startswith("postgres"):
        import psycopg

        server = urlunsplit(parts._replace(path="/postgres"))
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(statement.replace("`", '"'))  # type: ignore[arg-type]
    else:
        import MySQLdb

        conn = MySQLdb.connect(
            host=parts.hostname or "127.0.0.1",
            port=parts.port or 3306,
            user=parts.username or "root",
            password=parts.password or "",
        )
        try:
            conn.cursor().execute(statement)
        finally:
            conn.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="CPU per call of each piece of a request.")
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BENCH_DATABASE_URL", "postgres://root@127.0.0.1:5432/bench"),
        help="PostgreSQL or MariaDB server; the database used is its name + _components",
    )
    parser.add_argument(
        "--database-name", help="the database to create, use and drop (default: see above)"
    )
    parser.add_argument("--profile", action="store_true", help="print where the CPU goes")
    args = parser.parse_args(argv)
    parts = urlsplit(args.database_url)
    name = args.database_name or f"{parts.path.strip('/')}_components"
    with own_database(args.database_url, name) as url:
        os.environ.update(
            DJANGO_SETTINGS_MODULE=SETTINGS, DATABASE_URL=url, EXAMPLE_PROVIDER_DELAY_MS="0"
        )
        try:
            measure(args.calls, args.profile)
        finally:
            from django.db import connections

            connections.close_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
