"""The example's Django REST framework endpoint (``/api/charges/``, ``IdempotentMixin``) under
gunicorn (4 sync workers), over HTTP, on a real database.

The same contract as ``/charges/``, with the claim after DRF's authentication: a request that
DRF refuses never claims its key. Charges are counted with ``GET /api/charges/``; whether a
key was claimed or stored is read from the e2e database.
"""

from __future__ import annotations

import pytest

from tools.server import (
    BOB,
    COMPLETED,
    REPLAYED,
    Database,
    Server,
    assert_one_ran,
    assert_problem,
    assert_replay,
    charge_body,
    record_states,
)
from tools.threads import concurrently

API = "/api/charges/"
CLIENTS = 16


def test_concurrent_duplicates_make_one_charge(server: Server, key: str) -> None:
    body = charge_body()
    before = server.charge_count(path=API)

    responses = concurrently(CLIENTS, lambda: server.post_charge(body, key=key, path=API))

    ran = assert_one_ran(responses)
    charge_id = ran.json()["id"]
    assert server.charge_count(path=API) == before + 1
    assert server.charge_ids(path=API).count(charge_id) == 1
    assert_replay(server.post_charge(body, key=key, path=API), ran)


def test_a_retry_is_a_byte_identical_replay(server: Server, key: str) -> None:
    body = charge_body()
    before = server.charge_count(path=API)

    first = server.post_charge(body, key=key, path=API)
    assert first.status_code == 201, first.text
    assert REPLAYED not in first.headers
    charge_id = first.json()["id"]
    assert first.headers["Location"] == f"/charges/{charge_id}"
    assert first.headers["Content-Type"] == "application/json"

    for _ in range(2):
        retry = server.post_charge(body, key=key, path=API)
        assert_replay(retry, first)  # status, body bytes, Content-Type and Location
    assert server.charge_count(path=API) == before + 1


def test_declined_card_is_stored_and_replayed_without_a_charge(
    server: Server, key: str, e2e_db: Database
) -> None:
    body = charge_body("tok_declined")
    before = server.charge_count(path=API)

    first = server.post_charge(body, key=key, path=API)
    problem = assert_problem(first, 402)
    assert problem["type"] == "urn:example-payments:card-declined", problem
    assert REPLAYED not in first.headers
    assert record_states(e2e_db, [key]) == {key: COMPLETED}
    assert_replay(server.post_charge(body, key=key, path=API), first)
    assert server.charge_count(path=API) == before


def test_provider_timeout_is_not_stored_and_the_retry_runs_again(
    server: Server, key: str, e2e_db: Database
) -> None:
    body = charge_body("tok_timeout")
    before = server.charge_count(path=API)

    first = server.post_charge(body, key=key, path=API)
    assert_problem(first, 504)
    assert REPLAYED not in first.headers
    # Released, not stored: the key has no record, so the retry runs the view again.
    assert record_states(e2e_db, [key]) == {}
    retry = server.post_charge(body, key=key, path=API)
    assert_problem(retry, 504)
    assert REPLAYED not in retry.headers
    assert record_states(e2e_db, [key]) == {}
    assert server.charge_count(path=API) == before


def test_invalid_body_is_400_stored_and_replayed(
    server: Server, key: str, e2e_db: Database
) -> None:
    body = {**charge_body(), "amount": 0}
    before = server.charge_count(path=API)

    first = server.post_charge(body, key=key, path=API)
    problem = assert_problem(first, 400)
    assert "amount" in problem["errors"], problem
    assert record_states(e2e_db, [key]) == {key: COMPLETED}
    assert_replay(server.post_charge(body, key=key, path=API), first)
    assert server.charge_count(path=API) == before


@pytest.mark.parametrize("credentials", [None, ("alice", "wrong"), ("nobody", "nobody")])
def test_unauthenticated_is_401_and_claims_no_key(
    server: Server, key: str, e2e_db: Database, credentials: tuple[str, str] | None
) -> None:
    body = charge_body()
    before = server.charge_count(path=API)

    refused = server.post_charge(body, key=key, path=API, auth=credentials)
    assert refused.status_code == 401, refused.text
    assert refused.headers["WWW-Authenticate"].startswith("Basic"), refused.headers
    assert REPLAYED not in refused.headers
    # DRF refused it before the claim: no record, and the key is still free.
    assert record_states(e2e_db, [key]) == {}
    assert server.charge_count(path=API) == before
    first = server.post_charge(body, key=key, path=API)
    assert first.status_code == 201, first.text
    assert REPLAYED not in first.headers
    assert server.charge_count(path=API) == before + 1


def test_unauthenticated_request_with_a_used_key_gets_401_not_the_stored_charge(
    server: Server, key: str
) -> None:
    body = charge_body()
    alice = server.post_charge(body, key=key, path=API)
    assert alice.status_code == 201, alice.text

    anonymous = server.post_charge(body, key=key, path=API, auth=None)
    assert anonymous.status_code == 401, anonymous.text
    assert REPLAYED not in anonymous.headers
    assert alice.json()["id"] not in anonymous.text
    # And another account's same key is its own: a fresh charge, not alice's replay.
    bob = server.post_charge(body, key=key, path=API, auth=BOB)
    assert bob.status_code == 201, bob.text
    assert REPLAYED not in bob.headers
    assert bob.json()["id"] != alice.json()["id"]
