"""The example's django-ninja front door, ``/ninja/charges/``, under gunicorn (sync workers),
over HTTP, on a real database: the same contract as ``/charges/``.

Every test uses a fresh Idempotency-Key and counts charges the way a client would, with
``GET /ninja/charges/`` (compared before and after: the server is shared).
"""

from __future__ import annotations

import pytest
import requests

from tools.fuzz import CORPUS, Case, send
from tools.server import (
    BOB,
    REPLAYED,
    Server,
    assert_in_flight,
    assert_problem,
    assert_replay,
    charge_body,
)
from tools.threads import concurrently

NINJA = "/ninja/charges/"
CLIENTS = 16


def test_concurrent_duplicates_make_one_charge(server: Server, key: str) -> None:
    body = charge_body()
    before = server.charge_count(path=NINJA)

    responses = concurrently(CLIENTS, lambda: server.post_charge(body, key=key, path=NINJA))

    statuses = sorted(response.status_code for response in responses)
    assert set(statuses) <= {201, 409}, statuses
    ran = [r for r in responses if r.status_code == 201 and REPLAYED not in r.headers]
    assert len(ran) == 1, statuses  # exactly one request ran the operation
    for response in responses:
        if response is ran[0]:
            continue
        if response.status_code == 409:
            assert_in_flight(response)
        else:
            assert_replay(response, ran[0])
    assert server.charge_count(path=NINJA) == before + 1
    retry = server.post_charge(body, key=key, path=NINJA)
    assert_replay(retry, ran[0])
    assert retry.headers["Location"] == ran[0].headers["Location"]
    assert retry.headers["Content-Type"] == ran[0].headers["Content-Type"]


def test_the_retry_of_a_charge_is_its_replay_and_another_body_a_422(
    server: Server, key: str
) -> None:
    body = charge_body()
    first = server.post_charge(body, key=key, path=NINJA)
    retry = server.post_charge(body, key=key, path=NINJA)
    other = server.post_charge(charge_body(amount=body["amount"] + 1), key=key, path=NINJA)
    bobs = server.post_charge(body, key=key, auth=BOB, path=NINJA)

    assert first.status_code == 201, first.text
    assert_replay(retry, first)
    assert_problem(other, 422, "key-mismatch")
    assert bobs.status_code == 201
    assert REPLAYED not in bobs.headers  # keys belong to ninja's authenticated caller
    location = requests.get(
        f"{server.base_url}{first.headers['Location']}", auth=("alice", "alice"), timeout=30
    )
    assert location.json() == first.json()


def test_a_declined_card_is_declined_again_without_a_second_attempt(
    server: Server, key: str
) -> None:
    body = charge_body(card="tok_declined")
    first = server.post_charge(body, key=key, path=NINJA)
    retry = server.post_charge(body, key=key, path=NINJA)

    assert first.status_code == 402
    assert_replay(retry, first)


def test_problems_before_the_claim(server: Server, key: str) -> None:
    missing = server.post_charge(charge_body(), key=None, path=NINJA)
    anonymous = server.post_charge(charge_body(), key=key, auth=None, path=NINJA)
    corrected = server.post_charge(charge_body(), key=key, path=NINJA)

    assert_problem(missing, 400, "key-missing")
    assert_problem(anonymous, 401)
    assert anonymous.headers["WWW-Authenticate"] == 'Basic realm="payments"'
    assert corrected.status_code == 201  # the 401 claimed nothing
    assert REPLAYED not in corrected.headers


@pytest.mark.parametrize(
    ("url", "path"), [("/ninja/openapi.json", NINJA), ("/api/schema/?format=json", "/api/charges/")]
)
def test_the_published_expiry_policy_is_served(server: Server, url: str, path: str) -> None:
    response = requests.get(f"{server.base_url}{url}", timeout=30)

    assert response.status_code == 200
    post = response.json()["paths"][path]["post"]
    header = next(p for p in post["parameters"] if p["name"] == "Idempotency-Key")
    assert header["schema"]["maxLength"] == 512  # a quoted key of 255, every character escaped
    assert post["x-idempotency"]["maxKeyLength"] == 255
    assert "Keys expire 86400 seconds" in header["description"]
    assert post["x-idempotency"]["ttlSeconds"] == 86400
    assert "Retry-After" in post["responses"]["409"]["headers"]
    assert REPLAYED in post["responses"]["201"]["headers"]


@pytest.mark.parametrize("case", CORPUS, ids=[case.name for case in CORPUS])
def test_each_fuzz_case_gets_the_plain_views_answer(case: Case, server: Server, key: str) -> None:
    """The fuzz's corpus (``tools/fuzz.py``): ``/ninja/charges/`` reads a charge as the
    plain view does, so each case gets the plain view's status and problem type."""
    amount = charge_body()["amount"]
    expected = case.expected("plain")

    answer = send(server.port, case.request(NINJA, key, amount))

    assert answer.status_code == expected.status, (answer.status_code, answer.text)
    if expected.status >= 400:
        assert answer.headers["Content-Type"] == "application/problem+json", answer.headers
        assert answer.json()["type"] == expected.type, answer.json()
    charged = sum(c["amount"] == amount for c in server.charges(path=NINJA)["results"])
    assert charged == (1 if expected.status == 201 else 0)
