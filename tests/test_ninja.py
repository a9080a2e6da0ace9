"""The django-ninja adapter: the ``@idempotent`` contract on ninja operations, through
Django's test client (the whole stack: URLs, middleware, ninja's auth) and ninja's own
``TestClient``. Effects are counted in ``SideEffect`` rows."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.test import AsyncRequestFactory, Client, override_settings
from django.urls import resolve
from ninja import NinjaAPI
from ninja.responses import Status
from ninja.testing import TestClient

from idempotency_django.ninja import IdempotentRouter, auth_account, idempotent
from tests import records
from tests.conftest import effects
from tests.models import SideEffect
from tests.project.ninja_views import router
from tests.project.views import not_validation_failures
from tests.test_async import cancelled_at

# Transactional: the claim commits before the operation runs (commit mode, the default), as
# it does in production; inside a test's transaction it would run in atomic mode.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls("tests.project.ninja_urls")]

Send = Callable[..., Any]


@pytest.fixture
def send(client: Client) -> Send:
    """A JSON request to the ninja API as ``user`` (a bearer token naming the user)."""

    def go(
        path: str,
        body: Any,
        *,
        key: str | None = "k1",
        user: str | None = "alice",
        method: str = "post",
        **headers: str,
    ) -> Any:
        if key is not None:
            headers["Idempotency-Key"] = key
        if user is not None:
            headers["Authorization"] = f"Bearer {user}"
        if method == "get":
            return client.get(f"/ninja{path}", headers=headers)
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return getattr(client, method)(
            f"/ninja{path}", data=data, content_type="application/json", headers=headers
        )

    return go


def test_a_retry_replays_the_first_response_byte_for_byte(send: Send, alice: User) -> None:
    first = send("/r/effects/", {"amount": 100})
    again = send("/r/effects/", {"amount": 100})

    assert first.status_code == 201
    assert again.status_code == 201
    assert again.content == first.content
    assert again["Content-Type"] == first["Content-Type"]
    assert again["Location"] == first["Location"]
    assert again["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first
    assert "session-ish" in first.cookies  # the first caller's cookie is never replayed
    assert "session-ish" not in again.cookies
    assert effects("ninja-router") == 1


def test_a_reordered_body_is_the_same_request(send: Send, alice: User) -> None:
    send("/r/effects/", '{"amount": 1, "status": 201}')
    again = send("/r/effects/", '{ "status": 201,  "amount": 1.0 }')

    assert again["Idempotent-Replayed"] == "true"
    assert effects() == 1


def test_another_body_with_the_key_is_a_422_problem(send: Send, alice: User) -> None:
    send("/r/effects/", {"amount": 1})
    other = send("/r/effects/", {"amount": 2})

    assert other.status_code == 422
    assert other["Content-Type"] == "application/problem+json"
    assert other.json()["type"] == "urn:idempotency-django:problem:key-mismatch"
    assert effects() == 1


def test_a_missing_key_is_a_400_problem_and_nothing_runs(send: Send, alice: User) -> None:
    response = send("/r/effects/", {"amount": 1}, key=None)

    assert response.status_code == 400
    assert response.json()["type"] == "urn:idempotency-django:problem:key-missing"
    assert effects() == 0


@pytest.mark.parametrize("key", ["", " ", "x" * 256, "tab\tinside", '"unclosed'])
def test_a_malformed_key_is_a_400_problem(send: Send, alice: User, key: str) -> None:
    response = send("/r/effects/", {"amount": 1}, key=key)

    assert response.status_code == 400
    assert response["Content-Type"] == "application/problem+json"
    assert response.json()["type"] in (
        "urn:idempotency-django:problem:key-malformed",
        "urn:idempotency-django:problem:key-missing",
    )
    assert effects() == 0


def test_the_quoted_form_names_the_same_key(send: Send, alice: User) -> None:
    send("/r/effects/", {"amount": 1}, key="abc")
    again = send("/r/effects/", {"amount": 1}, key='"abc"')

    assert again["Idempotent-Replayed"] == "true"
    assert effects() == 1


def test_ninja_auth_refuses_before_the_claim(send: Send, alice: User) -> None:
    """A 401 (ninja's auth) claims no key: the same key, authenticated, runs."""
    unauthenticated = send("/r/effects/", {"amount": 1}, user="nobody")
    authenticated = send("/r/effects/", {"amount": 1})

    assert unauthenticated.status_code == 401
    assert authenticated.status_code == 201
    assert "Idempotent-Replayed" not in authenticated
    assert effects() == 1


# -- validation failures: stored by status, as a DRF serializer's 400 is (test_drf.py) -------


@pytest.mark.parametrize("path", ["/r/effects/", "/r/async/"], ids=["sync", "async"])
def test_a_validation_failure_is_stored_and_the_corrected_body_needs_a_new_key(
    send: Send, alice: User, path: str
) -> None:
    """ninja's 422 for invalid input is the key's answer, as DRF's 400 is: its retry is a
    replay, the corrected body with the same key a 422 ``key-mismatch``, a new key runs."""
    invalid = send(path, {"amount": "lots"})
    again = send(path, {"amount": "lots"})
    corrected = send(path, {"amount": 1})
    new_key = send(path, {"amount": 1}, key="k2")

    assert invalid.status_code == 422
    assert invalid["Content-Type"].startswith("application/json")  # ninja's own error body
    assert invalid.json()["detail"][0]["loc"] == ["body", "payload", "amount"]
    assert (again.status_code, again.content) == (422, invalid.content)
    assert again["Idempotent-Replayed"] == "true"
    assert corrected.status_code == 422
    assert corrected["Content-Type"] == "application/problem+json"
    assert corrected.json()["type"] == "urn:idempotency-django:problem:key-mismatch"
    assert new_key.status_code == 201
    assert effects() == 1


def test_store_statuses_without_validation_failures_lets_the_corrected_body_run(
    send: Send, alice: User, settings: Any
) -> None:
    settings.IDEMPOTENCY = {"STORE_STATUSES": not_validation_failures}

    invalid = send("/r/effects/", {"amount": "lots"})
    corrected = send("/r/effects/", {"amount": 1})

    assert invalid.status_code == 422
    assert corrected.status_code == 201
    assert "Idempotent-Replayed" not in corrected
    assert effects() == 1


def test_without_a_key_an_optional_operation_still_validates_its_input(
    send: Send, alice: User
) -> None:
    invalid = send("/r/optional/", {"amount": "lots"}, key=None)
    valid = send("/r/optional/", {"amount": 1}, key=None)

    assert invalid.status_code == 422
    assert valid.status_code == 201
    assert not records.exists()


def test_keys_belong_to_ninjas_authenticated_caller(send: Send, alice: User, bob: User) -> None:
    mine = send("/r/effects/", {"amount": 1}, user="alice")
    theirs = send("/r/effects/", {"amount": 1}, user="bob")

    assert "Idempotent-Replayed" not in theirs
    assert theirs.json()["effect"] != mine.json()["effect"]
    assert effects() == 2
    assert set([r.account for r in records.all()]) == {
        str(alice.pk),
        str(bob.pk),
    }


def test_a_token_returned_by_auth_scopes_keys_and_is_stored_hashed(send: Send) -> None:
    first = send("/token/", {"amount": 1}, user="tok_one")
    replay = send("/token/", {"amount": 1}, user="tok_one")
    other = send("/token/", {"amount": 1}, user="tok_two")

    assert replay["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in other
    assert first.status_code == other.status_code == 201
    assert effects("ninja-token") == 2
    accounts = list([r.account for r in records.all()])
    assert all(a.startswith("auth:") and "tok_" not in a for a in accounts)


def test_without_ninja_auth_the_django_user_is_the_account(client: Client, alice: User) -> None:
    headers = {"Idempotency-Key": "k1", "X-User": "alice"}
    body = json.dumps({"amount": 1})
    first = client.post("/ninja/session/", body, "application/json", headers=headers)
    again = client.post("/ninja/session/", body, "application/json", headers=headers)
    anonymous = client.post(
        "/ninja/session/", body, "application/json", headers={"Idempotency-Key": "k1"}
    )

    assert first.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert anonymous.status_code == 403
    assert anonymous.json()["type"] == "urn:idempotency-django:problem:anonymous"
    assert "auth=" in anonymous.json()["detail"]  # ninja's way in, not a decorator's order
    assert "outside @idempotent" not in anonymous.json()["detail"]
    assert effects("ninja-session") == 1


def test_an_http_error_is_stored_and_replayed(send: Send, alice: User) -> None:
    first = send("/r/effects/", {"amount": 1, "fail": "http-404"})
    again = send("/r/effects/", {"amount": 1, "fail": "http-404"})

    assert first.status_code == again.status_code == 404
    assert again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    assert effects() == 1


def test_a_views_own_400_is_stored_a_5xx_is_not(send: Send, alice: User) -> None:
    send("/r/effects/", {"amount": 1, "status": 400}, key="four")
    replayed = send("/r/effects/", {"amount": 1, "status": 400}, key="four")
    assert replayed.status_code == 400
    assert replayed["Idempotent-Replayed"] == "true"

    with pytest.raises(RuntimeError):
        send("/r/effects/", {"amount": 1, "fail": "raise"}, key="boom")
    assert not records.exists(key="boom")  # released
    assert effects() == 2


def test_an_unhandled_exception_releases_the_key_so_the_retry_runs(send: Send, alice: User) -> None:
    with pytest.raises(RuntimeError):
        send("/r/effects/", {"amount": 1, "fail": "raise"})
    retry = send("/r/effects/", {"amount": 1})  # the same key, a corrected request

    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry
    assert effects() == 2


def test_patch_is_protected_get_and_put_are_not(send: Send, alice: User) -> None:
    send("/r/effects/7", {"amount": 1}, method="patch")
    again = send("/r/effects/7", {"amount": 1}, method="patch")
    listing = send("/r/effects/", {}, key=None, method="get")

    assert again["Idempotent-Replayed"] == "true"
    assert listing.status_code == 200
    assert effects("ninja-patch-7") == 1


def test_the_key_is_optional_where_the_operation_says_so(send: Send, alice: User) -> None:
    send("/r/optional/", {"amount": 1}, key=None)
    send("/r/optional/", {"amount": 1}, key=None)
    send("/r/optional/", {"amount": 1}, key="once")
    again = send("/r/optional/", {"amount": 1}, key="once")

    assert again["Idempotent-Replayed"] == "true"
    assert effects("ninja-optional") == 3


def test_an_async_operation_is_protected(send: Send, alice: User) -> None:
    first = send("/r/async/", {"amount": 5})
    again = send("/r/async/", {"amount": 5})

    assert first.status_code == 201
    assert again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    assert effects("ninja-async") == 1


def test_an_unprotected_operation_runs_every_time(send: Send, alice: User) -> None:
    send("/plain/", {"amount": 1})
    send("/plain/", {"amount": 1})

    assert effects("ninja-plain") == 2
    assert not records.exists()


def test_the_global_switch_turns_it_off(send: Send, alice: User) -> None:
    with override_settings(IDEMPOTENCY={"ENABLED": False}):
        send("/r/effects/", {"amount": 1})
        send("/r/effects/", {"amount": 1})

    assert effects() == 2


# -- ninja's TestClient ------------------------------------------------------------------------


def test_ninjas_test_client_sees_the_same_contract(alice: User) -> None:
    client = TestClient(router, headers={"Authorization": "Bearer alice"})

    first = client.post("/effects/", json={"amount": 3}, headers={"Idempotency-Key": "t1"})
    again = client.post("/effects/", json={"amount": 3}, headers={"Idempotency-Key": "t1"})
    other = client.post("/effects/", json={"amount": 4}, headers={"Idempotency-Key": "t1"})
    missing = client.post("/effects/", json={"amount": 3})

    assert first.status_code == 201
    assert again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    assert other.status_code == 422
    assert other["Content-Type"] == "application/problem+json"
    assert missing.status_code == 400
    assert effects("ninja-router") == 1


def test_a_router_mounted_twice_protects_each_mount_with_its_api(alice: User) -> None:
    """ninja clones operations per mount: each clone renders with its own API."""
    template = IdempotentRouter()

    @template.post("/x/", response={201: dict[str, int]})
    def make(request: Any) -> Any:
        return Status(201, {"n": SideEffect.objects.create(label="twice").pk})

    headers = {"Idempotency-Key": "m1"}
    first = TestClient(template).post("/x/", json={}, headers=headers, user=alice)
    second = TestClient(template).post("/x/", json={}, headers=headers, user=alice)

    assert first.status_code == 201
    assert second.content == first.content
    assert second["Idempotent-Replayed"] == "true"  # one key, one account, one path
    assert effects("twice") == 1


# -- configuration -----------------------------------------------------------------------------


def test_a_bad_argument_fails_at_import_naming_the_operation() -> None:
    with pytest.raises(ImproperlyConfigured, match="mode='sometimes'"):

        @idempotent(mode="sometimes")
        def f(request: Any) -> None: ...

    with pytest.raises(ImproperlyConfigured, match="IdempotentRouter"):
        IdempotentRouter(idempotency={"in_flight": "maybe"})


def test_a_streaming_operation_is_refused() -> None:
    from ninja.streaming import JSONL

    api = NinjaAPI(urls_namespace="streaming-refused")
    with pytest.raises(ImproperlyConfigured, match="streaming"):

        @api.post("/s/", response=JSONL[int])
        @idempotent
        def stream(request: Any) -> Any:
            yield 1


def test_auth_account_names_the_caller() -> None:
    from django.http import HttpRequest

    request = HttpRequest()
    request.auth = True  # type: ignore[attr-defined]
    assert auth_account(request) is None  # names nobody: anonymous
    request.auth = b"secret"  # type: ignore[attr-defined]
    assert auth_account(request) == auth_account(request)
    assert "secret" not in str(auth_account(request))


def test_an_api_handler_for_idempotency_errors_answers_them(alice: User) -> None:
    """As a custom EXCEPTION_HANDLER does with the DRF mixin: the project's format."""
    from django.http import HttpRequest, JsonResponse

    from idempotency_django.exceptions import IdempotencyError

    custom = NinjaAPI(urls_namespace="custom-errors")

    @custom.exception_handler(IdempotencyError)
    def ours(request: HttpRequest, exc: IdempotencyError) -> JsonResponse:
        return JsonResponse({"error": exc.slug}, status=exc.status)

    @custom.post("/x/", response={201: dict[str, int]})
    @idempotent
    def make(request: Any) -> Any:
        return Status(201, {"n": SideEffect.objects.create(label="custom").pk})

    client = TestClient(custom)
    missing = client.post("/x/", json={}, user=alice)
    client.post("/x/", json={"a": 1}, headers={"Idempotency-Key": "c1"}, user=alice)
    mismatch = client.post("/x/", json={"a": 2}, headers={"Idempotency-Key": "c1"}, user=alice)

    assert (missing.status_code, missing.json()) == (400, {"error": "key-missing"})
    assert (mismatch.status_code, mismatch.json()) == (422, {"error": "key-mismatch"})
    assert effects("custom") == 1


@pytest.mark.database_store("ATOMIC_REQUESTS: the claim joins the request's database transaction")
def test_under_atomic_requests_the_operation_runs_once_in_the_request_transaction(
    send: Send, alice: User, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """ninja's view is inside the ATOMIC_REQUESTS transaction before the operation runs, so
    the claim cannot commit first: the lifecycle runs it in atomic mode (claim, work and
    outcome in that transaction). Single flight holds; a failure rolls all of it back. The
    warning's advice is the one that works for ninja (the docs' advice): the store on its own
    database, not ``non_atomic_requests``, which cannot reach ninja's view."""
    from django.db import connections

    from idempotency_django.core import transactions

    monkeypatch.setattr(transactions, "_warned", set())
    monkeypatch.setitem(connections["default"].settings_dict, "ATOMIC_REQUESTS", True)
    with caplog.at_level("WARNING", logger="idempotency_django"):
        first = send("/r/effects/", {"amount": 1})
    (warning,) = [r.getMessage() for r in caplog.records if "open transaction" in r.getMessage()]
    assert "a database alias of its own (IDEMPOTENCY 'DATABASE')" in warning
    assert "non_atomic_requests" not in warning
    again = send("/r/effects/", {"amount": 1})
    with pytest.raises(RuntimeError):
        send("/r/effects/", {"amount": 1, "fail": "raise"}, key="boom")

    assert first.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert effects() == 1  # the failed one's work rolled back with its claim
    assert not records.exists(key="boom")


def test_auth_account_names_a_model_by_label_and_a_user_by_pk(alice: User) -> None:
    from django.http import HttpRequest

    request = HttpRequest()
    request.auth = alice  # type: ignore[attr-defined]
    assert auth_account(request) == str(alice.pk)
    client = SideEffect.objects.create(label="an api client")
    request.auth = client  # type: ignore[attr-defined]
    assert auth_account(request) == f"tests.sideeffect:{client.pk}"


def test_a_project_account_setting_takes_precedence(send: Send, alice: User, bob: User) -> None:
    with override_settings(IDEMPOTENCY={"ACCOUNT": lambda request: "tenant-1"}):
        send("/r/effects/", {"amount": 1}, user="alice")
        bobs = send("/r/effects/", {"amount": 1}, user="bob")

    assert bobs["Idempotent-Replayed"] == "true"  # one tenant: one account
    assert list([r.account for r in records.all()]) == ["tenant-1"]


def test_an_operations_own_account_takes_precedence_over_ninjas_caller(
    send: Send, alice: User, bob: User
) -> None:
    """``account=`` on the operation: the key belongs to the team, not to whichever of its
    members ninja authenticated (``auth_account`` would give alice and bob one each)."""
    first = send("/team/", {"amount": 1}, user="alice", X_Team="team-7")
    bobs = send("/team/", {"amount": 1}, user="bob", X_Team="team-7")
    other_team = send("/team/", {"amount": 1}, user="bob", X_Team="team-8")

    assert first.status_code == 201
    assert bobs["Idempotent-Replayed"] == "true"
    assert bobs.content == first.content
    assert "Idempotent-Replayed" not in other_team
    assert effects("ninja-team") == 2
    assert sorted(r.account for r in records.all()) == ["team-7", "team-8"]


def test_an_async_operations_http_error_is_stored_and_the_switch_turns_it_off(
    send: Send, alice: User
) -> None:
    first = send("/r/async/", {"amount": 1, "fail": "http-404"})
    again = send("/r/async/", {"amount": 1, "fail": "http-404"})
    with override_settings(IDEMPOTENCY={"ENABLED": False}):
        send("/r/async/", {"amount": 2})
        send("/r/async/", {"amount": 2})

    assert first.status_code == again.status_code == 404
    assert again["Idempotent-Replayed"] == "true"
    assert effects("ninja-async") == 3


def test_decorate_view_decorators_stack_with_the_adapter(alice: User) -> None:
    """ninja applies decorate_view's decorators to each clone's run first: the adapter
    finds the operation beneath one that uses functools.wraps, and refuses one that
    doesn't (it could not protect the operation) when the router is mounted."""
    from django.views.decorators.cache import never_cache
    from ninja.decorators import decorate_view

    def opaque(run: Any) -> Any:
        return lambda request, *args, **kwargs: run(request, *args, **kwargs)

    wrapped, hidden = IdempotentRouter(), IdempotentRouter()

    @wrapped.post("/x/", response={201: dict[str, int]})
    @decorate_view(never_cache)
    def make(request: Any) -> Any:
        return Status(201, {"n": SideEffect.objects.create(label="cached").pk})

    @hidden.post("/x/", response={201: dict[str, int]})
    @decorate_view(opaque)
    def lost(request: Any) -> Any:
        return Status(201, {"n": 0})  # pragma: no cover - never mounted

    client = TestClient(wrapped)
    first = client.post("/x/", json={}, headers={"Idempotency-Key": "d1"}, user=alice)
    again = client.post("/x/", json={}, headers={"Idempotency-Key": "d1"}, user=alice)
    assert "no-cache" in first["Cache-Control"]
    assert again["Idempotent-Replayed"] == "true"
    assert effects("cached") == 1
    with pytest.raises(ImproperlyConfigured, match=r"functools\.wraps"):
        TestClient(hidden).post("/x/", json={}, headers={"Idempotency-Key": "d2"}, user=alice)


def test_an_older_ninja_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from ninja.operation import Operation

    monkeypatch.delattr(Operation, "clone")
    with pytest.raises(ImproperlyConfigured, match=r"django-ninja 1\.7"):

        @NinjaAPI(urls_namespace="old-ninja").post("/x/")
        @idempotent
        def make(request: Any) -> None: ...


def test_an_api_handler_keeps_retry_after() -> None:
    from types import SimpleNamespace

    from django.http import HttpRequest, JsonResponse

    from idempotency_django.exceptions import InFlight, KeyMismatch
    from idempotency_django.ninja import error_response

    custom = NinjaAPI(urls_namespace="retry-after")
    custom.add_exception_handler(
        InFlight, lambda request, exc: JsonResponse({"error": exc.slug}, status=409)
    )
    operation: Any = SimpleNamespace(api=custom)

    in_flight = error_response(operation, HttpRequest(), InFlight(retry_after=2))
    mismatch = error_response(operation, HttpRequest(), KeyMismatch())

    assert (in_flight.status_code, in_flight["Retry-After"]) == (409, "2")
    assert in_flight["Content-Type"] == "application/json"
    # No handler for KeyMismatch or IdempotencyError (only ninja's own for Exception):
    assert mismatch["Content-Type"] == "application/problem+json"


def test_a_router_leaves_other_methods_as_ninja_made_them(alice: User) -> None:
    """A streamed GET listing on an IdempotentRouter is fine; a streamed POST is refused."""
    from ninja.streaming import JSONL

    listing = IdempotentRouter()

    @listing.get("/stream/", response=JSONL[int])
    def stream(request: Any) -> Any:
        yield from (1, 2)

    with pytest.raises(ImproperlyConfigured, match="streaming"):

        @listing.post("/stream/", response=JSONL[int])
        def upload(request: Any) -> Any:
            yield 1  # pragma: no cover - refused before it runs

    response = TestClient(listing).get("/stream/")
    assert response.status_code == 200
    assert response.content.splitlines() == [b"1", b"2"]


def test_ninja_users_need_no_django_rest_framework() -> None:
    """``ninja.py`` and ``contract.py`` import neither DRF nor drf-spectacular."""
    import subprocess
    import sys

    child = """
import sys
sys.modules["rest_framework"] = None  # any import of it fails
sys.modules["drf_spectacular"] = None
import django
from django.conf import settings
settings.configure(
    INSTALLED_APPS=["django.contrib.auth", "django.contrib.contenttypes", "idempotency_django"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
)
django.setup()
from ninja import NinjaAPI
from idempotency_django.core import contract
from idempotency_django.ninja import IdempotentRouter
api, router = NinjaAPI(), IdempotentRouter()
router.post("/x/")(lambda request: {})
api.add_router("/", router)
schema = api.get_openapi_schema(path_prefix="/")
print(schema["paths"]["/x/"]["post"]["x-idempotency"]["header"])
"""
    result = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=60, check=False
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "Idempotency-Key"


def test_a_nested_idempotent_router_is_protected_a_nested_plain_one_is_not(
    alice: User,
) -> None:
    from ninja import Router

    outer, inner, plain = Router(), IdempotentRouter(), Router()

    @inner.post("/x/", response={201: dict[str, int]})
    def protected(request: Any) -> Any:
        return Status(201, {"n": SideEffect.objects.create(label="inner").pk})

    @plain.post("/y/", response={201: dict[str, int]})
    def unprotected(request: Any) -> Any:
        return Status(201, {"n": SideEffect.objects.create(label="plain").pk})

    outer.add_router("/in", inner)
    outer.add_router("/plain", plain)
    client = TestClient(outer)
    for path in ("/in/x/", "/in/x/", "/plain/y/", "/plain/y/"):
        client.post(path, json={}, headers={"Idempotency-Key": "n1"}, user=alice)

    assert effects("inner") == 1
    assert effects("plain") == 2


def test_the_middleware_leaves_ninja_operations_to_the_adapter(
    send: Send, alice: User, settings: Any
) -> None:
    """Project-wide middleware plus ninja: claimed once, after ninja's authentication (a
    claim in the middleware would see an anonymous caller and answer 403)."""
    settings.MIDDLEWARE = [
        *settings.MIDDLEWARE,
        "idempotency_django.middleware.IdempotencyMiddleware",
    ]
    first = send("/r/effects/", {"amount": 7})
    again = send("/r/effects/", {"amount": 7})

    assert first.status_code == 201
    assert again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert effects("ninja-router") == 1
    assert records.count() == 1


@pytest.mark.parametrize("on_disconnect", ["finish", "release"])
def test_an_async_operation_cancelled_as_it_returns_stores_its_response(
    send: Send, alice: User, settings: Any, on_disconnect: str
) -> None:
    """A client that goes away once the operation has run (its response rendered) does not
    release the key, under either policy: the retry is the replay."""
    settings.IDEMPOTENCY = {"ON_DISCONNECT": on_disconnect}
    request = AsyncRequestFactory().post(
        "/ninja/r/async/",
        data=json.dumps({"amount": 5}),
        content_type="application/json",
        headers={"Idempotency-Key": "k1", "Authorization": "Bearer alice"},
    )
    assert cancelled_at(resolve("/ninja/r/async/").func, request, "return")

    retry = send("/r/async/", {"amount": 5})
    assert retry.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.json() == {"effect": SideEffect.objects.get().pk, "amount": 5}
    assert effects("ninja-async") == 1


# --- plain operations under IdempotencyMiddleware: claimed after ninja's auth ---------------------


@pytest.fixture
def with_middleware(settings: Any) -> None:
    settings.MIDDLEWARE = [
        *settings.MIDDLEWARE,
        "idempotency_django.middleware.IdempotencyMiddleware",
    ]


@pytest.mark.parametrize(
    ("path", "label"), [("/mw/plain/", "ninja-mw-plain"), ("/mw/async/", "ninja-mw-async")]
)
def test_the_middleware_protects_a_plain_operation_after_ninjas_auth(
    send: Send, alice: User, bob: User, with_middleware: None, path: str, label: str
) -> None:
    """The middleware promises every view: a ninja operation with neither IdempotentRouter
    nor @idempotent is claimed too, scoped to ninja's authenticated caller (a claim in the
    middleware itself would see nobody: request.user is anonymous here)."""
    first = send(path, {"amount": 1})
    retry = send(path, {"amount": 1})
    other = send(path, {"amount": 2})
    bobs = send(path, {"amount": 1}, user="bob")
    refused = send(path, {"amount": 1}, user="mallory")  # ninja's auth refuses: no claim

    assert first.status_code == 201
    assert retry.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert other.status_code == 422
    assert bobs.status_code == 201
    assert "Idempotent-Replayed" not in bobs
    assert refused.status_code == 401
    assert effects(label) == 2  # alice once, bob once
    assert sorted([r.account for r in records.all()]) == sorted([str(alice.pk), str(bob.pk)])


def test_the_middleware_leaves_an_exempt_operation_alone(
    send: Send, alice: User, with_middleware: None
) -> None:
    send("/mw/exempt/", {"amount": 1})
    send("/mw/exempt/", {"amount": 1})

    assert effects("ninja-mw-exempt") == 2
    assert not records.exists()


def test_without_the_middleware_the_operation_is_as_ninja_made_it(
    alice: User, settings: Any
) -> None:
    """The middleware decides per request: once it has seen an operation, the operation
    still runs unprotected in a project (or a test) without the middleware."""
    headers = {"Idempotency-Key": "k1", "Authorization": "Bearer alice"}
    body = json.dumps({"amount": 1})
    middleware = settings.MIDDLEWARE
    settings.MIDDLEWARE = [*middleware, "idempotency_django.middleware.IdempotencyMiddleware"]
    protected = Client()
    for _ in range(2):
        protected.post("/ninja/mw/plain/", body, "application/json", headers=headers)
    settings.MIDDLEWARE = middleware
    unprotected = Client()
    for _ in range(2):
        unprotected.post("/ninja/mw/plain/", body, "application/json", headers=headers)

    assert effects("ninja-mw-plain") == 3
    assert records.count() == 1


def test_under_asgi_the_middleware_protects_a_plain_async_operation(
    alice: User, with_middleware: None
) -> None:
    from asgiref.sync import async_to_sync
    from django.test import AsyncClient

    async def send() -> Any:
        return await AsyncClient().post(
            "/ninja/mw/async/",
            data=json.dumps({"amount": 1}),
            content_type="application/json",
            headers={"Idempotency-Key": "k1", "Authorization": "Bearer alice"},
        )

    first = async_to_sync(send)()
    retry = async_to_sync(send)()

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert effects("ninja-mw-async") == 1
    assert records.get().account == str(alice.pk)
