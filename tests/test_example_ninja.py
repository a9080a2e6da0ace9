"""The example project's django-ninja front door, ``/ninja/charges/``, and the two OpenAPI
documents it serves (``/ninja/openapi.json`` and drf-spectacular's ``/api/schema/``).

The example has its own settings and apps, so it runs in a child process on a SQLite file
of its own (migrated there), driven by Django's test client. ``tests/e2e/test_ninja_live.py``
serves the same project under gunicorn on PostgreSQL.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tools.server import example_env, run_python

# Run in the child, with the example's settings: each answer by name, as JSON on the last
# line, and the number of charges alice has at the end.
CHILD = r"""
import base64, json, django
django.setup()
from django.core.management import call_command
from django.test import Client
from example_project.payments.models import Charge

call_command("migrate", verbosity=0)
client = Client()

def auth(user, password=None):
    token = base64.b64encode(f"{user}:{password or user}".encode()).decode()
    return {"HTTP_AUTHORIZATION": f"Basic {token}"}

def answer(response):
    body = response.content.decode()
    return {
        "status": response.status_code,
        "type": response.get("Content-Type"),
        "location": response.get("Location"),
        "allow": response.get("Allow"),
        "replayed": response.get("Idempotent-Replayed"),
        "retry_after": response.get("Retry-After"),
        "www_authenticate": response.get("WWW-Authenticate"),
        "raw": body,
        "body": json.loads(body) if body.startswith(("{", "[")) else body,
    }

CHARGE = {"amount": 1000, "currency": "eur", "card": "tok_visa"}

def post(
    body=CHARGE, key="order-1", user="alice", content_type="application/json",
    url="/ninja/charges/", **extra,
):
    headers = dict(auth(user) if user else {}, **extra)
    if key is not None:
        headers["HTTP_IDEMPOTENCY_KEY"] = key
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return answer(client.post(url, data, content_type=content_type, **headers))

def drf(body=CHARGE, key="drf-1", user="bob", **kwargs):
    return post(body, key, user, url="/api/charges/", **kwargs)

results = {
    "first": post(),
    "retry": post(),
    "other body": post(dict(CHARGE, amount=2000)),
    "bob, same key": post(user="bob"),
    "no key": post(key=None),
    "malformed key": post(key="\u00e9t\u00e9"),
    "anonymous": post(user=None),
    "wrong password": post(user=None, **auth("alice", "x")),
    "invalid json": post("{bad", key="order-2"),
    "invalid json, retried": post("{bad", key="order-2"),
    "form": post("amount=1", key="order-3", content_type="application/x-www-form-urlencoded"),
    "invalid charge": post({"amount": -1}, key="order-4"),
    "declined": post(dict(CHARGE, card="tok_declined"), key="order-5"),
    "declined, retried": post(dict(CHARGE, card="tok_declined"), key="order-5"),
    "PUT": answer(client.put("/ninja/charges/", "{}", content_type="application/json")),
    "list": answer(client.get("/ninja/charges/", **auth("alice"))),
    "list anonymous": answer(client.get("/ninja/charges/")),
    "drf list": answer(client.get("/api/charges/", **auth("alice"))),
    "drf list anonymous": answer(client.get("/api/charges/")),
    "timeout": post(dict(CHARGE, card="tok_timeout"), key="order-6"),
    "drf first": drf(),
    "drf no key": drf(key=None),
    "drf anonymous": drf(user=None),
    "drf form": drf("amount=1", key="drf-3", content_type="application/x-www-form-urlencoded"),
    "drf invalid charge": drf({"amount": -1}, key="drf-4"),
    "drf declined": drf(dict(CHARGE, card="tok_declined"), key="drf-5"),
    "drf timeout": drf(dict(CHARGE, card="tok_timeout"), key="drf-6"),
    "ninja schema": answer(client.get("/ninja/openapi.json")),
    "drf schema": answer(client.get("/api/schema/?format=json")),
}
results["charges"] = Charge.objects.filter(account__username="alice").count()
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    database = tmp_path_factory.mktemp("example") / "example.sqlite3"
    env = example_env(f"sqlite:///{database}", EXAMPLE_PROVIDER_DELAY_MS="0")
    child = run_python(env, "-c", CHILD)
    assert child.returncode == 0, child.stderr
    results: dict[str, Any] = json.loads(child.stdout.splitlines()[-1])
    return results


def problem(answer: dict[str, Any], status: int, type_: str) -> None:
    assert answer["status"] == status
    assert answer["type"] == "application/problem+json"
    assert answer["body"]["type"] == type_
    assert answer["body"]["status"] == status


def test_a_charge_is_made_once_and_its_retry_replayed(answers: dict[str, Any]) -> None:
    first, retry = answers["first"], answers["retry"]

    assert first["status"] == 201
    assert first["location"] == f"/charges/{first['body']['id']}"
    assert first["replayed"] is None
    assert retry["status"] == 201
    assert retry["raw"] == first["raw"]
    assert retry["location"] == first["location"]
    assert retry["replayed"] == "true"


def test_alice_was_charged_once_per_key(answers: dict[str, Any]) -> None:
    # order-1 once; order-2/3/4 were refused by validation; order-5 was declined.
    assert answers["charges"] == 1
    assert answers["list"]["status"] == 200
    assert answers["list"]["body"]["count"] == 1


def test_keys_belong_to_the_authenticated_account(answers: dict[str, Any]) -> None:
    bob = answers["bob, same key"]

    assert bob["status"] == 201
    assert bob["replayed"] is None
    assert bob["body"]["id"] != answers["first"]["body"]["id"]


def test_the_idempotency_problems_are_the_apps(answers: dict[str, Any]) -> None:
    base = "urn:idempotency-django:problem:"
    problem(answers["other body"], 422, base + "key-mismatch")
    problem(answers["no key"], 400, base + "key-missing")
    problem(answers["malformed key"], 400, base + "key-malformed")


def test_authentication_comes_first_and_is_a_401_problem(answers: dict[str, Any]) -> None:
    for name in ("anonymous", "wrong password"):
        problem(answers[name], 401, "urn:example-payments:unauthorized")
        assert answers[name]["www_authenticate"] == 'Basic realm="payments"'


def test_bad_bodies_are_the_plain_views_problems_and_are_stored(answers: dict[str, Any]) -> None:
    problem(answers["invalid json"], 400, "urn:example-payments:invalid-json")
    assert answers["invalid json, retried"]["replayed"] == "true"
    problem(answers["form"], 415, "urn:example-payments:unsupported-media-type")
    problem(answers["invalid charge"], 400, "urn:example-payments:invalid-charge")
    assert set(answers["invalid charge"]["body"]["errors"]) == {"amount", "currency", "card"}


def test_a_declined_card_is_declined_again_without_a_second_attempt(
    answers: dict[str, Any],
) -> None:
    problem(answers["declined"], 402, "urn:example-payments:card-declined")
    assert answers["declined, retried"]["raw"] == answers["declined"]["raw"]
    assert answers["declined, retried"]["replayed"] == "true"


def test_another_method_is_a_405_problem(answers: dict[str, Any]) -> None:
    problem(answers["PUT"], 405, "urn:example-payments:method-not-allowed")
    assert answers["PUT"]["allow"] == "GET, POST"


def _key_header(operation: dict[str, Any]) -> dict[str, Any]:
    return next(p for p in operation["parameters"] if p["name"] == "Idempotency-Key")


@pytest.mark.parametrize(
    ("document", "path"),
    [("ninja schema", "/ninja/charges/"), ("drf schema", "/api/charges/")],
)
def test_both_documents_publish_the_contract(
    answers: dict[str, Any], document: str, path: str
) -> None:
    assert answers[document]["status"] == 200
    post = answers[document]["body"]["paths"][path]["post"]
    header = _key_header(post)

    assert header["required"] is True
    assert header["schema"]["maxLength"] == 512  # a quoted key of 255, every character escaped
    assert "Keys expire 86400 seconds (24 hours)" in header["description"]
    assert post["x-idempotency"]["ttlSeconds"] == 86400
    for status in ("400", "403", "409", "413", "422", "503"):
        assert "application/problem+json" in post["responses"][status]["content"]
    assert "Retry-After" in post["responses"]["409"]["headers"]
    assert "Idempotent-Replayed" in post["responses"]["201"]["headers"]
    assert all(
        p["name"] != "Idempotency-Key"
        for p in answers[document]["body"]["paths"][path]["get"].get("parameters", [])
    )


SENT = ["first", "no key", "anonymous", "form", "invalid charge", "declined", "timeout"]


@pytest.mark.parametrize(
    ("document", "prefix"), [("ninja schema", ""), ("drf schema", "drf ")], ids=["ninja", "drf"]
)
def test_every_answer_is_documented_as_it_is_sent(
    answers: dict[str, Any], document: str, prefix: str
) -> None:
    """Each answer of the charging endpoint (the example's own and the app's) has its
    status documented, with the media type it is sent with and a schema its body fits;
    nothing is documented that is never sent (ninja's default 200)."""
    from openapi_schema_validator import OAS30Validator, OAS31Validator
    from openapi_spec_validator import validate

    schema = answers[document]["body"]
    validate(schema)
    path = "/ninja/charges/" if document == "ninja schema" else "/api/charges/"
    responses = schema["paths"][path]["post"]["responses"]
    validator = OAS31Validator if schema["openapi"].startswith("3.1") else OAS30Validator
    assert "200" not in responses
    sent = set()
    for name in SENT:
        got = answers[prefix + name]
        status, media_type = str(got["status"]), got["type"].split(";")[0]
        sent.add(status)
        assert status in responses, name
        assert media_type in responses[status].get("content", {}), name
        body_schema = responses[status]["content"][media_type]["schema"]
        root = {**body_schema, "components": schema.get("components", {})}
        assert validator(root).is_valid(got["body"]), name
    assert sent >= {"201", "400", "401", "402", "415", "504"}


@pytest.mark.parametrize(
    ("document", "prefix"), [("ninja schema", ""), ("drf schema", "drf ")], ids=["ninja", "drf"]
)
def test_the_list_documents_its_answers_as_they_are_sent(
    answers: dict[str, Any], document: str, prefix: str
) -> None:
    """``GET``: the account's charges (200, typed, an object and not an array) and the 401
    without credentials, each with the media type it is sent with and a schema it fits."""
    from openapi_schema_validator import OAS30Validator, OAS31Validator

    schema = answers[document]["body"]
    path = "/ninja/charges/" if document == "ninja schema" else "/api/charges/"
    responses = schema["paths"][path]["get"]["responses"]
    validator = OAS31Validator if schema["openapi"].startswith("3.1") else OAS30Validator
    for name, status in (("list", "200"), ("list anonymous", "401")):
        got = answers[prefix + name]
        assert str(got["status"]) == status, name
        media_type = got["type"].split(";")[0]
        body_schema = responses[status]["content"][media_type]["schema"]
        root = {**body_schema, "components": schema.get("components", {})}
        assert validator(root).is_valid(got["body"]), name
    assert answers[prefix + "list"]["body"]["count"] >= 1
    assert set(responses) == {"200", "401"}


@pytest.mark.parametrize("document", ["ninja schema", "drf schema"])
def test_the_charge_body_is_published_required_and_typed(
    answers: dict[str, Any], document: str
) -> None:
    from openapi_schema_validator import OAS30Validator, OAS31Validator

    schema = answers[document]["body"]
    path = "/ninja/charges/" if document == "ninja schema" else "/api/charges/"
    body = schema["paths"][path]["post"]["requestBody"]
    validator = OAS31Validator if schema["openapi"].startswith("3.1") else OAS30Validator
    root = {
        **body["content"]["application/json"]["schema"],
        "components": schema.get("components", {}),
    }

    assert body.get("required") is True
    assert validator(root).is_valid({"amount": 1000, "currency": "eur", "card": "tok_visa"})
    assert not validator(root).is_valid({"amount": 1000, "currency": "eur"})
    assert not validator(root).is_valid({"amount": 0, "currency": "eur", "card": "tok_visa"})
