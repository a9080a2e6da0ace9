"""Bad input to the example API gets a clear 4xx problem, never a 5xx.

Every case of the fuzz's corpus (``tools/fuzz.py``: the inputs that were 500s, and one
of each class of odd input) on each endpoint — ``/charges/`` and ``/api/charges/`` under
gunicorn, ``/async/charges/`` under uvicorn — with the status and problem type it must get,
and no charge unless it is a documented success; then a short seeded fuzz through the same
servers with all of the fuzz's checks.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from tools.fuzz import (
    ASYNC,
    CORPUS,
    DRF,
    KINDS,
    PLAIN,
    Case,
    Request,
    check,
    plan,
    run_all,
    send,
)
from tools.server import (
    PROBLEM_JSON,
    Database,
    Server,
    new_amount,
)


@pytest.fixture
def target(
    request: pytest.FixtureRequest, server: Server, uvicorn_example: Callable[..., Server]
) -> Server:
    """The server for the test's ``path``: uvicorn for the async view, gunicorn otherwise."""
    path = request.node.callspec.params["path"]
    return uvicorn_example() if path == ASYNC else server


def _amounts(server: Server, path: str, amount: int) -> int:
    """How many of alice's charges are of ``amount`` (the tests' amounts are random)."""
    return sum(charge["amount"] == amount for charge in server.charges(path=path)["results"])


@pytest.mark.parametrize("path", [PLAIN, DRF, ASYNC])
@pytest.mark.parametrize("case", CORPUS, ids=[case.name for case in CORPUS])
def test_each_case_gets_its_answer(case: Case, path: str, target: Server, key: str) -> None:
    amount = new_amount()
    expected = case.expected(KINDS[path])

    answer = send(target.port, case.request(path, key, amount))

    assert answer.status_code == expected.status, (answer.status_code, answer.text)
    assert answer.headers.get("X-Content-Type-Options") == "nosniff"  # Django answered
    if expected.status >= 400:
        assert answer.headers["Content-Type"] == PROBLEM_JSON, answer.headers
        problem = answer.json()
        assert problem["type"] == expected.type, problem
        assert problem["status"] == expected.status, problem
        if expected.status in (400, 405, 413, 415):
            # A clear error: what is wrong with the request, in words or field by field.
            assert isinstance(problem.get("detail"), str) or isinstance(problem.get("errors"), dict)
    charged = _amounts(target, path, amount)
    assert charged == (1 if expected.status == 201 else 0), answer.text


@pytest.mark.parametrize("path", [PLAIN, DRF, ASYNC])
def test_a_method_the_endpoint_does_not_take_is_a_405_problem_with_allow(
    path: str, target: Server
) -> None:
    request = Request(b"PATCH", path.encode(), [(b"Authorization", b"Basic YWxpY2U6YWxpY2U=")])

    answer = send(target.port, request)

    assert answer.status_code == 405
    assert answer.headers["Content-Type"] == PROBLEM_JSON
    assert answer.json()["type"] == "urn:example-payments:method-not-allowed"
    assert set(answer.headers["Allow"].replace(" ", "").split(",")) >= {"GET", "POST"}


@pytest.mark.parametrize("path", [PLAIN, DRF, ASYNC])
def test_missing_credentials_are_a_401_problem(path: str, target: Server, key: str) -> None:
    request = Request(b"POST", path.encode(), [(b"Idempotency-Key", key.encode())], b"{}")

    answer = send(target.port, request)

    assert answer.status_code == 401
    assert answer.headers["Content-Type"] == PROBLEM_JSON
    assert answer.headers["WWW-Authenticate"].startswith("Basic")
    assert answer.json()["status"] == 401


def test_a_short_fuzz_finds_nothing(
    server: Server, uvicorn_example: Callable[..., Server], e2e_db: Database
) -> None:
    # Amounts of their own, and the database's other charges and keys left out of the checks.
    generator, scenarios = plan(random.Random(12), 80, corpus=False, amount_base=1_500_000_000)
    ports = {"gunicorn": server.port, "uvicorn": uvicorn_example().port}

    run_all(scenarios, ports, clients=4)

    violations = check(e2e_db, generator, scenarios, shared=True)
    assert not violations, "\n".join(f"{v.kind}: {v.detail}" for v in violations)
