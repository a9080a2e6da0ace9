"""The example's async view (``/async/charges/``) under uvicorn, over HTTP, on a real database.

Under ASGI the view runs as a task on the worker's event loop; ``aprotect`` claims and
completes the key with ``sync_to_async`` (one thread per request, under Django's ASGI
handler), and a client that disconnects gets its view task cancelled by Django, which
releases the key (safe while the view waits on the provider; not once its charge is being
written, see ``test_a_disconnect_while_the_charge_is_being_written_makes_no_second_charge``;
nor, under either policy, once the view has returned, see the last test, which serves
``tests/project/asgi_live_urls.py``). Charges are counted as a client would, with
``GET /async/charges/``; where the claim itself is the point, the e2e database is read (and
locked) directly.
"""

from __future__ import annotations

import base64
import json
import socket
import struct
from collections.abc import Callable
from typing import Any

import pytest

from tools.server import (
    ALICE,
    CHARGES_TABLE,
    COMPLETED,
    IN_PROGRESS,
    RECORDS_TABLE,
    RENDER_GATE_TABLE,
    REPLAYED,
    Database,
    InFlightRequest,
    Server,
    assert_in_flight,
    assert_one_ran,
    assert_problem,
    assert_replay,
    charge_body,
    charges_locked,
    lock_waits,
    new_key,
    post_with_header_lines,
    record_states,
    records_locked,
    render_gate_locked,
    retry_until,
)
from tools.threads import concurrently

ASYNC = "/async/charges/"
RECEIPTS = "/receipts/charges/"  # tests/project/asgi_live_urls.py
CLIENTS = 16
PARALLEL = 8
# Leases that outlast the tests: no key here is freed by a lapse, only by a completion or a
# release, and the heartbeat (one renewal a lease/3) keeps out of the locks the tests take.
LONG_LEASE = {"EXAMPLE_LEASE_SECONDS": "600", "EXAMPLE_MAX_RUN_SECONDS": "600"}
# And a provider that answers long after the test is over: a request to it stays in flight
# until its client goes away.
STUCK = {**LONG_LEASE, "EXAMPLE_PROVIDER_DELAY_MS": "600000", "EXAMPLE_ON_DISCONNECT": "release"}


@pytest.mark.parametrize("workers", [1, 2])
def test_concurrent_duplicates_make_one_charge(
    uvicorn_example: Callable[..., Server], key: str, workers: int
) -> None:
    server = uvicorn_example(workers=workers, **LONG_LEASE)
    body = charge_body()
    before = server.charge_count(path=ASYNC)

    responses = concurrently(CLIENTS, lambda: server.post_charge(body, key=key, path=ASYNC))

    ran = assert_one_ran(responses)
    charge_id = ran.json()["id"]
    assert ran.headers["Location"] == f"/charges/{charge_id}"
    assert server.charge_count(path=ASYNC) == before + 1
    assert server.charge_ids(path=ASYNC).count(charge_id) == 1
    assert_replay(server.post_charge(body, key=key, path=ASYNC), ran)


@pytest.mark.parametrize("path", [ASYNC, "/charges/"])
def test_two_key_header_lines_are_400_without_a_charge(
    uvicorn_example: Callable[..., Server], key: str, path: str
) -> None:
    """uvicorn hands the two lines over apart; Django's ASGI request joins them."""
    server = uvicorn_example(workers=1, **LONG_LEASE)
    body = charge_body()
    first = server.post_charge(body, key=key, path=path)
    assert first.status_code == 201, first.text
    after_first = server.charge_count(path=ASYNC)
    lines = [("Idempotency-Key", key), ("Idempotency-Key", new_key())]

    both = post_with_header_lines(server, body, lines, path=path)
    assert_problem(both, 400, "key-malformed")
    assert server.charge_count(path=ASYNC) == after_first


def test_requests_waiting_on_the_database_do_not_hold_up_the_event_loop(
    uvicorn_example: Callable[..., Server], e2e_db: Database
) -> None:
    """One worker, one event loop: while every request's database work is stuck (the
    view's ``Charge`` insert, then the package's completion), the loop goes on taking
    requests in and answering. All of them are in flight at once; none waits behind
    another, as they would if a database call ran on the loop."""
    server = uvicorn_example(workers=1, **LONG_LEASE)
    bodies = {new_key(): charge_body() for _ in range(PARALLEL)}
    first_key, first_body = next(iter(bodies.items()))
    before = server.charge_count(path=ASYNC)

    with charges_locked(e2e_db) as charges_lock:
        running = [
            InFlightRequest(server, body, key=key, path=ASYNC).start()
            for key, body in bodies.items()
        ]
        # 1. Every request claimed its key, and waits on its insert: all in flight at once.
        states, _ = retry_until(
            lambda: record_states(e2e_db, bodies),
            lambda states: len(states) == PARALLEL,
            within=20,
            every=0.05,
        )
        assert set(states.values()) == {IN_PROGRESS}, states
        # The loop still answers: a duplicate at once, a read of the charges too.
        assert_in_flight(server.post_charge(first_body, key=first_key, path=ASYNC))
        assert server.charge_count(path=ASYNC) == before

        # 2. The inserts go through; now every completion (the package's own UPDATE, via
        # sync_to_async) waits on its locked record. On the loop, the first would block
        # it and the others could not get that far.
        with records_locked(e2e_db, bodies):
            charges_lock.release()
            retry_until(
                lambda: lock_waits(e2e_db, f"UPDATE%{RECORDS_TABLE}%completed_at%"),
                lambda waiting: waiting == PARALLEL,
                within=20,
                every=0.05,
            )
            assert server.charge_count(path=ASYNC) == before + PARALLEL
            assert not [request for request in running if request.done.is_set()]
            assert set(record_states(e2e_db, bodies).values()) == {IN_PROGRESS}

    for request in running:
        request.wait_done()
    charge_ids = set()
    for request in running:
        assert request.error is None, request.error
        assert request.outcome is not None
        assert request.outcome.status_code == 201, request.outcome
        assert REPLAYED not in request.outcome.headers
        charge_ids.add(request.outcome.json()["id"])
    assert len(charge_ids) == PARALLEL
    assert server.charge_count(path=ASYNC) == before + PARALLEL
    assert record_states(e2e_db, bodies) == dict.fromkeys(bodies, COMPLETED)


def _raw_post(port: int, path: str, body: dict[str, Any], key: str) -> socket.socket:
    """Send a whole ``POST`` on a socket of our own, and return it unread."""
    payload = json.dumps(body).encode()
    credentials = base64.b64encode(":".join(ALICE).encode()).decode()
    head = (
        f"POST {path} HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{port}\r\n"
        f"Authorization: Basic {credentials}\r\n"
        "Content-Type: application/json\r\n"
        f"Idempotency-Key: {key}\r\n"
        f"Content-Length: {len(payload)}\r\n"
        "\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(head.encode() + payload)
    return sock


@pytest.mark.parametrize("hang_up", ["reset", "close"])
def test_on_disconnect_release_frees_the_key_of_a_client_that_hangs_up(
    uvicorn_example: Callable[..., Server], e2e_db: Database, key: str, hang_up: str
) -> None:
    # The first attempt reaches a worker whose provider won't answer while the test runs;
    # the client retries against another worker of the same deployment (same database),
    # whose provider answers in the default 300 ms.
    stuck = uvicorn_example(workers=1, **STUCK)
    quick = uvicorn_example(workers=1, **LONG_LEASE)
    body = charge_body()
    before = quick.charge_count(path=ASYNC)

    sock = _raw_post(stuck.port, ASYNC, body, key)
    try:
        # In flight: its claim is in the database and a duplicate is refused.
        retry_until(
            lambda: record_states(e2e_db, [key]),
            lambda states: states == {key: IN_PROGRESS},
            within=20,
            every=0.05,
        )
        assert_in_flight(stuck.post_charge(body, key=key, path=ASYNC))
        assert_in_flight(quick.post_charge(body, key=key, path=ASYNC))
    finally:
        if hang_up == "reset":
            # Linger 0: close() sends a RST, as a client killed mid-request does.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()

    # Django cancels the view task on http.disconnect, and with ON_DISCONNECT "release"
    # aprotect releases the key. Until
    # then (a moment) a retry is still told 409; the claim's lease outlasts this loop (and the
    # stuck worker renews it), so only that release can let a retry in.
    retried, refused = retry_until(
        lambda: quick.post_charge(body, key=key, path=ASYNC),
        lambda response: response.status_code != 409,
        within=15,
        every=0.1,
    )
    for response in refused:
        assert_in_flight(response)
    assert retried.status_code == 201, (retried.status_code, retried.text)
    assert REPLAYED not in retried.headers
    charge_id = retried.json()["id"]

    # One charge for the key: the cancelled attempt never got past the provider.
    charges = quick.charges(path=ASYNC)
    assert charges["count"] == before + 1
    assert [c["id"] for c in charges["results"] if c["amount"] == body["amount"]] == [charge_id]
    assert_replay(quick.post_charge(body, key=key, path=ASYNC), retried)
    assert record_states(e2e_db, [key]) == {key: COMPLETED}


def test_a_disconnect_while_the_charge_is_being_written_makes_no_second_charge(
    uvicorn_example: Callable[..., Server], e2e_db: Database, key: str
) -> None:
    server = uvicorn_example(workers=1, **LONG_LEASE)
    body = charge_body()
    before = server.charge_count(path=ASYNC)

    with charges_locked(e2e_db) as charges_lock:
        sock = _raw_post(server.port, ASYNC, body, key)
        try:
            # Past the provider: the view's INSERT of its Charge waits on the lock.
            retry_until(
                lambda: lock_waits(e2e_db, f"INSERT%{CHARGES_TABLE}%"),
                lambda waiting: waiting == 1,
                within=20,
                every=0.05,
            )
        finally:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        # The same event loop answers this after it has seen the reset (on loopback, before
        # this connection even exists) and cancelled the view: the key is still in flight.
        assert_in_flight(server.post_charge(body, key=key, path=ASYNC))
        charges_lock.release()  # the INSERT, already under way, goes through

    retried, refused = retry_until(
        lambda: server.post_charge(body, key=key, path=ASYNC),
        lambda response: response.status_code != 409,
        within=15,
        every=0.1,
    )
    for response in refused:
        assert_in_flight(response)
    charges = server.charges(path=ASYNC)
    made = [c["id"] for c in charges["results"] if c["amount"] == body["amount"]]
    # The charge the first attempt made is the key's answer: the retry replays it.
    assert len(made) == 1, f"{len(made)} charges for one Idempotency-Key: {made}"
    assert charges["count"] == before + 1
    assert retried.status_code == 201, (retried.status_code, retried.text)
    assert retried.headers.get(REPLAYED) == "true", retried.headers
    assert retried.json()["id"] == made[0]


@pytest.mark.parametrize("on_disconnect", ["finish", "release"])
def test_a_disconnect_while_the_response_renders_makes_no_second_charge(
    uvicorn_example: Callable[..., Server], e2e_db: Database, key: str, on_disconnect: str
) -> None:
    """The view has charged and returned; its ``TemplateResponse`` renders when the outcome
    is captured, reading a table the test holds locked (``tests/project/asgi_live_urls.py``). The
    client hangs up there. Under either ON_DISCONNECT policy the work is done, so the key is
    not released: the outcome is stored, and the retry gets the replay of the one charge."""
    server = uvicorn_example(
        workers=1,
        settings_module="tests.project.asgi_live_settings",
        EXAMPLE_ON_DISCONNECT=on_disconnect,
        **LONG_LEASE,
    )
    body = charge_body()
    before = server.charge_count(path=ASYNC)

    with render_gate_locked(e2e_db) as gate:
        sock = _raw_post(server.port, RECEIPTS, body, key)
        try:
            # Past the work: the receipt's read waits on the lock, and the charge is made.
            retry_until(
                # (Not "SELECT%table%": lock_waits' own query would match that.)
                lambda: lock_waits(e2e_db, f"SELECT COUNT(*) FROM {RENDER_GATE_TABLE}%"),
                lambda waiting: waiting == 1,
                within=20,
                every=0.05,
            )
            assert server.charge_count(path=ASYNC) == before + 1
        finally:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        assert_in_flight(server.post_charge(body, key=key, path=RECEIPTS))
        gate.release()

    retried, refused = retry_until(
        lambda: server.post_charge(body, key=key, path=RECEIPTS),
        lambda response: response.status_code != 409,
        within=15,
        every=0.1,
    )
    for response in refused:
        assert_in_flight(response)
    charges = server.charges(path=ASYNC)
    made = [c["id"] for c in charges["results"] if c["amount"] == body["amount"]]
    assert len(made) == 1, f"{len(made)} charges for one Idempotency-Key: {made}"
    assert charges["count"] == before + 1
    assert retried.status_code == 201, (retried.status_code, retried.text)
    assert retried.headers.get(REPLAYED) == "true", retried.headers
    assert retried.text == f"Charge {made[0]}: paid"
    assert record_states(e2e_db, [key]) == {key: COMPLETED}
