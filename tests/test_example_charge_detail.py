"""The example project's ``GET /charges/ch_<n>``, where a new charge's ``Location`` points.

The example has its own settings and apps, so it runs in a child process on a SQLite file
of its own (migrated there), driven by Django's test client: on every test database, with
no server. The e2e tests serve the same project under gunicorn.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tools.server import example_env, run_python

# Run in the child, with the example's settings: each request's status, content type,
# Location and body, by name, printed as JSON on the last line. Its argument: the ids of
# no charge of alice's, as JSON.
CHILD = r"""
import base64, json, sys, django
django.setup()
from django.core.management import call_command
from django.test import Client

call_command("migrate", verbosity=0)
client = Client()

def auth(user):
    token = base64.b64encode(f"{user}:{user}".encode()).decode()
    return {"HTTP_AUTHORIZATION": f"Basic {token}"}

def answer(response):
    body = response.content.decode()
    return {
        "status": response.status_code,
        "type": response.get("Content-Type"),
        "location": response.get("Location"),
        "allow": response.get("Allow"),
        "body": json.loads(body) if body.startswith(("{", "[")) else body,
    }

def charge(user, key, path="/charges/"):
    return client.post(
        path, {"amount": 1000, "currency": "eur", "card": "tok_visa"},
        content_type="application/json", HTTP_IDEMPOTENCY_KEY=key, **auth(user),
    )

created = charge("alice", "order-42")
location = created["Location"]
async_created = charge("alice", "order-43", "/async/charges/")
drf_created = charge("alice", "order-44", "/api/charges/")
results = {
    "created": answer(created),
    "own": answer(client.get(location, **auth("alice"))),
    "own, from /async/charges/": answer(client.get(async_created["Location"], **auth("alice"))),
    "own, from /api/charges/": answer(client.get(drf_created["Location"], **auth("alice"))),
    "another account's": answer(client.get(location, **auth("bob"))),
    "anonymous": answer(client.get(location)),
    "wrong password": answer(
        client.get(location, HTTP_AUTHORIZATION="Basic " + base64.b64encode(b"alice:x").decode())
    ),
    "POST": answer(client.post(location, {}, content_type="application/json", **auth("alice"))),
}
for charge_id in json.loads(sys.argv[1]):
    results[charge_id] = answer(client.get(f"/charges/{charge_id}", **auth("alice")))
print(json.dumps(results))
"""

UNKNOWN_IDS = [
    "ch_999999",
    "nope",
    "ch_",
    "ch_0",
    "ch_01",
    "ch_-1",
    "ch_1.0",
    "ch_\u0661",  # an Arabic-Indic digit one: int() would read it
    "ch_9223372036854775808",  # past a BigAutoField
    "ch_" + "9" * 400,
    "1",
]


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    database = tmp_path_factory.mktemp("example") / "example.sqlite3"
    env = example_env(f"sqlite:///{database}", EXAMPLE_PROVIDER_DELAY_MS="0")
    child = run_python(env, "-c", CHILD, json.dumps(UNKNOWN_IDS))
    assert child.returncode == 0, child.stderr
    results: dict[str, dict[str, Any]] = json.loads(child.stdout.splitlines()[-1])
    return results


def assert_not_found(answer: dict[str, Any]) -> None:
    assert answer["status"] == 404
    assert answer["type"] == "application/problem+json"
    assert answer["body"]["type"] == "urn:example-payments:not-found"
    assert answer["body"]["status"] == 404


def test_location_of_a_new_charge_answers_that_charge(answers: dict[str, Any]) -> None:
    created = answers["created"]
    assert created["status"] == 201
    assert created["location"] == f"/charges/{created['body']['id']}"

    own = answers["own"]
    assert own["status"] == 200
    assert own["type"] == "application/json"
    assert own["body"] == created["body"]


@pytest.mark.parametrize("front_door", ["/async/charges/", "/api/charges/"])
def test_location_from_the_async_and_drf_endpoints_answers_too(
    answers: dict[str, Any], front_door: str
) -> None:
    own = answers[f"own, from {front_door}"]
    assert own["status"] == 200
    assert own["body"]["status"] == "succeeded"


def test_another_accounts_charge_is_not_found(answers: dict[str, Any]) -> None:
    assert_not_found(answers["another account's"])


@pytest.mark.parametrize("charge_id", UNKNOWN_IDS)
def test_an_unknown_id_is_a_not_found_problem(answers: dict[str, Any], charge_id: str) -> None:
    assert_not_found(answers[charge_id])


@pytest.mark.parametrize("who", ["anonymous", "wrong password"])
def test_without_credentials_it_is_401(answers: dict[str, Any], who: str) -> None:
    answer = answers[who]
    assert answer["status"] == 401
    assert answer["type"] == "application/problem+json"
    assert answer["body"]["type"] == "urn:example-payments:unauthorized"


def test_another_method_is_405(answers: dict[str, Any]) -> None:
    answer = answers["POST"]
    assert answer["status"] == 405
    assert answer["allow"] == "GET"
    assert answer["type"] == "application/problem+json"
