#!/usr/bin/env python
"""Where a replay's time goes on a DRF view with token authentication, in one process.

    python -m benchmarks.drf_replay [--calls 400] [--database-url URL] [--top 25]

The benchmark's DRF scenario (``benchproject/drf_views.py``: an ``APIView`` with DRF's
``TokenAuthentication``, a ``SELECT`` per request) through Django's own handler, against a
fresh database of its own, as ``components.py`` does for the plain view: the CPU per
request (``time.process_time``, best of 3 runs of ``--calls``) of the view bare (a new
charge each time) and of a replay behind ``IdempotentMixin`` on the database store, then a
cProfile of the replays: the functions with the most CPU of their own, and the
app's and DRF's by cumulative time. No assertion (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from benchmarks.components import BODY, SETTINGS, own_database, serve_wsgi, wsgi_environ

REPLAY_KEY = "drf-replay"


def measure(calls: int, top: int) -> None:
    import django

    django.setup()
    from django.contrib.auth.models import User
    from django.core.handlers.wsgi import WSGIHandler
    from django.core.management import call_command
    from django.db import connection
    from rest_framework.authtoken.models import Token

    call_command("migrate", "--noinput", verbosity=0)
    alice, _ = User.objects.get_or_create(username="alice")
    token = Token.objects.get_or_create(user=alice)[0].key
    handler = WSGIHandler()

    def environ(path: str, key: str | None = None) -> dict[str, Any]:
        return wsgi_environ(path, key, HTTP_AUTHORIZATION=f"Token {token}")

    serve = partial(serve_wsgi, handler)

    def cpu(name: str, prepare: Callable[[], Any], call: Callable[[Any], object] = serve) -> float:
        """CPU and wall time per call, each the best of 3 runs."""
        best, best_wall = float("inf"), float("inf")
        for _ in range(3):
            prepared = [prepare() for _ in range(calls)]
            started, started_wall = time.process_time(), time.perf_counter()
            for item in prepared:
                call(item)
            best = min(best, (time.process_time() - started) / calls)
            best_wall = min(best_wall, (time.perf_counter() - started_wall) / calls)
        print(f"{name:<56} {best * 1000:7.3f} ms CPU {best_wall * 1000:7.3f} ms wall", flush=True)
        return best

    connection.ensure_connection()
    replay_path = "/bench/drf/protected/"
    serve(environ(replay_path, REPLAY_KEY))  # the record every replay below replays
    print(f"CPU per request, best of 3 x {calls} ({connection.vendor}):")
    bare = cpu("DRF view bare (token auth, one INSERT)", lambda: environ("/bench/drf/bare/"))
    replay = cpu("DRF view + IdempotentMixin, replay", lambda: environ(replay_path, REPLAY_KEY))
    print(f"{'  replay minus bare':<56} {(replay - bare) * 1000:7.3f} ms CPU")
    pieces(cpu, alice, token)

    envs = [environ(replay_path, REPLAY_KEY) for _ in range(calls)]
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    for env in envs:
        serve(env)
    profiler.disable()
    print(f"\n--- profile: {calls} replays, by own CPU time")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)
    print(f"\n--- profile: {calls} replays, idempotency_django and DRF by cumulative CPU time")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(
        r"idempotency_django|rest_framework", top
    )
    connection.close()


def pieces(cpu: Callable[..., float], alice: Any, token: str) -> None:
    """The pieces of both paths, called directly."""
    from django.test import RequestFactory
    from rest_framework.authentication import TokenAuthentication

    from benchmarks.benchproject.drf_protected import IdempotentCharge
    from example_project.payments import service
    from idempotency_django.core import claims, shell
    from idempotency_django.core.protect import Guard
    from idempotency_django.responses import replay

    factory = RequestFactory()
    body = {"amount": 1000, "currency": "EUR", "card": "tok_visa"}
    options = IdempotentCharge()._idempotency_options("DRF replay")

    def request() -> Any:
        made = factory.post(
            "/bench/drf/protected/", data=BODY, content_type="application/json",
            HTTP_IDEMPOTENCY_KEY=REPLAY_KEY,
        )  # fmt: skip
        made.user = alice
        return made

    guard = Guard.for_request(request(), options)
    assert guard is not None
    replayed = shell.claim_or_replay(guard.scope, guard.fingerprint, guard.policy.claiming)
    assert not isinstance(replayed, claims.Claim)
    print("pieces:")
    auth = TokenAuthentication()
    cpu("  both: TokenAuthentication (its SELECT)", lambda: token, auth.authenticate_credentials)
    cpu("  bare: service.charge (validation, the INSERT)", lambda: body,
        lambda b: service.charge(alice, b))  # fmt: skip
    cpu("  replay: Guard.for_request (key, scope, fingerprint)", request,
        lambda r: Guard.for_request(r, options))  # fmt: skip
    cpu("  replay: shell.claim_or_replay (the statement)", lambda: guard,
        lambda g: shell.claim_or_replay(g.scope, g.fingerprint, g.policy.claiming))  # fmt: skip
    cpu("  replay: responses.replay (the response)", lambda: replayed, replay)

    # The whole DRF view (dispatch, TokenAuthentication, no middleware): a constant answer,
    # against the replay behind the mixin. The difference is all the mixin's replay costs.
    from rest_framework.response import Response

    from benchmarks.benchproject.drf_views import Charge

    class Constant(Charge):
        def post(self, request: Any) -> Response:
            return Response({"id": "ch_1"}, status=201)

    def authenticated() -> Any:
        made = request()
        made.META["HTTP_AUTHORIZATION"] = f"Token {token}"
        return made

    constant, protected = Constant.as_view(), IdempotentCharge.as_view()

    cpu("  DRF view, a constant answer (dispatch, auth, render)", authenticated,
        lambda r: constant(r).render())  # fmt: skip
    cpu("  DRF view + IdempotentMixin, the replay", authenticated, protected)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Where a DRF replay's CPU goes.")
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BENCH_DATABASE_URL", "postgres://root@127.0.0.1:5432/bench"),
        help="PostgreSQL or MariaDB server; the database used is its name + _drf_replay",
    )
    parser.add_argument("--top", type=int, default=25, help="rows of each profile")
    args = parser.parse_args(argv)
    parts = urlsplit(args.database_url)
    name = f"{parts.path.strip('/')}_drf_replay"
    with own_database(args.database_url, name) as url:
        os.environ.update(
            DJANGO_SETTINGS_MODULE=SETTINGS, DATABASE_URL=url, EXAMPLE_PROVIDER_DELAY_MS="0"
        )
        try:
            measure(args.calls, args.top)
        finally:
            from django.db import connections

            connections.close_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
