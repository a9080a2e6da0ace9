"""``IdempotencyMiddleware`` in a real deployment: the example project under gunicorn (4 sync
workers) with the middleware installed (``tests/project/middleware_live_settings.py``), over HTTP,
on PostgreSQL or MariaDB.

``/mw/charges/`` is a plain view and ``/mw/api/charges/`` a DRF viewset, neither decorated
nor mixed in: the middleware is their only protection. The example's own ``/charges/``
(``@idempotent``) and ``/api/charges/`` (the mixin) must stay protected once. Charges are
counted the way a client counts them, with ``GET /charges/``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import requests

from tools.server import (
    ALICE,
    BOB,
    REPLAYED,
    WORKERS,
    Database,
    InFlightRequest,
    Server,
    assert_in_flight,
    assert_one_ran,
    assert_problem,
    assert_replay,
    charge_body,
    new_key,
    project_env,
    spawn_gunicorn,
    start_uvicorn,
)
from tools.threads import concurrently

PLAIN = "/mw/charges/"
DRF = "/mw/api/charges/"


@pytest.fixture(scope="module")
def server(e2e_db: Database, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """gunicorn serving the example with the middleware (its own settings module)."""
    log_path = tmp_path_factory.mktemp("gunicorn-middleware") / "gunicorn.log"
    running = spawn_gunicorn(
        project_env("tests.project.middleware_live_settings", e2e_db.url), log_path
    )
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()
        print(f"--- gunicorn (middleware) on port {running.port} ---\n{running.log()}")


@pytest.mark.parametrize("path", [PLAIN, DRF])
def test_a_retry_is_replayed_and_charges_once(server: Server, path: str) -> None:
    before = server.charge_count()
    key = new_key()
    body = charge_body()

    first = server.post_charge(body, key=key, path=path)
    retry = server.post_charge(body, key=key, path=path)
    other_body = server.post_charge(charge_body(), key=key, path=path)

    assert first.status_code == 201, first.text
    assert_replay(retry, first)
    assert_problem(other_body, 422)
    assert server.charge_count() == before + 1


@pytest.mark.parametrize("path", [PLAIN, DRF])
def test_a_missing_key_is_a_400_and_charges_nothing(server: Server, path: str) -> None:
    before = server.charge_count()
    assert_problem(server.post_charge(charge_body(), key=None, path=path), 400)
    assert server.charge_count() == before


@pytest.mark.parametrize("path", [PLAIN, DRF, "/charges/", "/api/charges/"])
def test_concurrent_duplicates_charge_once(server: Server, path: str) -> None:
    """Through every front door, protected by the middleware or by its own decorator or
    mixin (and then by that alone: twice protected, the first would be a 409)."""
    before = server.charge_count()
    key = new_key()
    body = charge_body()

    responses = concurrently(WORKERS, lambda: server.post_charge(body, key=key, path=path))

    ran = assert_one_ran(responses)
    assert server.charge_count() == before + 1
    assert_replay(server.post_charge(body, key=key, path=path), ran)


@pytest.mark.parametrize("path", [PLAIN, DRF])
def test_a_duplicate_while_the_first_runs_is_a_409(server: Server, path: str) -> None:
    """The provider takes 300 ms: the duplicate arrives while the first holds its claim."""
    key = new_key()
    body = charge_body()
    finished = threading.Event()
    first = InFlightRequest(server, body, key=key, finished=finished, path=path).start()
    first.wait_sent()
    second = InFlightRequest(server, body, key=key, finished=finished, path=path).start()
    assert finished.wait(30)
    refused, running = (first, second) if first.done.is_set() else (second, first)
    refused.wait_done()
    running.wait_done()

    assert refused.outcome is not None
    assert running.outcome is not None
    assert_in_flight(refused.outcome)
    assert running.outcome.status_code == 201


def test_drf_view_is_scoped_to_the_user_drf_authenticated(server: Server) -> None:
    """The viewset authenticates inside itself (no middleware sets request.user for it):
    claimed before DRF's authentication, both would be anonymous (refused, or sharing one
    scope). Each user gets their own charge and their own replay."""
    key = new_key()
    alice_before, bob_before = server.charge_count(ALICE), server.charge_count(BOB)
    body = charge_body()

    alices = server.post_charge(body, key=key, path=DRF, auth=ALICE)
    bobs = server.post_charge(body, key=key, path=DRF, auth=BOB)

    assert alices.status_code == bobs.status_code == 201
    assert REPLAYED not in bobs.headers
    assert alices.json()["id"] != bobs.json()["id"]
    assert_replay(server.post_charge(body, key=key, path=DRF, auth=BOB), bobs)
    assert server.charge_count(ALICE) == alice_before + 1
    assert server.charge_count(BOB) == bob_before + 1


def test_drf_refuses_bad_credentials_before_any_claim(server: Server) -> None:
    key = new_key()
    body = charge_body()
    refused = server.post_charge(body, key=key, path=DRF, auth=("alice", "wrong"))
    assert refused.status_code == 401

    accepted = server.post_charge(body, key=key, path=DRF)  # the key was never claimed
    assert accepted.status_code == 201
    assert REPLAYED not in accepted.headers


def test_get_is_untouched(server: Server) -> None:
    key = new_key()
    first = requests.get(
        f"{server.base_url}{DRF}", auth=ALICE, headers={"Idempotency-Key": key}, timeout=30
    )
    assert first.status_code == 200
    assert REPLAYED not in first.headers


# --- under uvicorn: nested layers of one scope -------------------------------------------------

NESTED = ["/mw/async/wrapped/charges/", "/mw/async/calls/charges/"]


@pytest.fixture(scope="module")
def asgi_server(e2e_db: Database, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """uvicorn serving the example with the middleware (its own settings module)."""
    log_path = tmp_path_factory.mktemp("uvicorn-middleware") / "uvicorn.log"
    running = start_uvicorn(
        e2e_db, log_path, workers=2, settings_module="tests.project.middleware_live_settings"
    )
    try:
        yield running
    finally:
        running.stop()
        print(f"--- uvicorn (middleware) on port {running.port} ---\n{running.log()}")


@pytest.mark.parametrize("path", NESTED)
def test_under_uvicorn_an_inner_idempotent_layer_charges_once(
    asgi_server: Server, path: str
) -> None:
    """The middleware claims, then meets ``@idempotent`` inside the view (hidden by a
    decorator without functools.wraps, or called by an undecorated view): concurrent
    duplicates charge once, and the retry is a replay (claimed twice, every one was a 409)."""
    before = asgi_server.charge_count()
    key = new_key()
    body = charge_body()

    responses = concurrently(8, lambda: asgi_server.post_charge(body, key=key, path=path))

    ran = assert_one_ran(responses)
    assert asgi_server.charge_count() == before + 1
    assert_replay(asgi_server.post_charge(body, key=key, path=path), ran)
