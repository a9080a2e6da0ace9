"""``IdempotencyMiddleware``: every unsafe request protected, through Django's test client.

The views in ``tests/project/middleware_views.py`` are not decorated: whatever protection they get
is the middleware's. Each execution writes one ``SideEffect`` row, counted as a user counts
charges. Runs on SQLite, and on PostgreSQL and MariaDB with ``DATABASE_URL``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth.models import User
from django.db import connections
from django.test import AsyncClient, AsyncRequestFactory, Client
from django.urls import resolve
from rest_framework.authtoken.models import Token

from idempotency_django.middleware import IdempotencyMiddleware
from tests import records
from tests.conftest import Post, effects
from tests.project import middleware_views
from tests.test_async import cancelled_at
from tests.test_lifecycle import connection_killed_before, is_completion

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.urls("tests.project.middleware_urls"),
]

MIDDLEWARE = "idempotency_django.middleware.IdempotencyMiddleware"


@pytest.fixture(autouse=True)
def middleware(settings: Any) -> None:
    settings.MIDDLEWARE = [*settings.MIDDLEWARE, MIDDLEWARE]


def problem(response: Any) -> dict[str, Any]:
    assert response["Content-Type"] == "application/problem+json"
    return json.loads(response.content)  # type: ignore[no-any-return]


# --- the contract on a plain view -------------------------------------------------------------


def test_a_plain_view_runs_once_and_the_retry_is_replayed(alice: User, post: Post) -> None:
    first = post("/mw/plain/", {"amount": 1})
    retry = post("/mw/plain/", {"amount": 1})

    assert first.status_code == retry.status_code == 201
    assert "Idempotent-Replayed" not in first
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert effects("mw_plain") == 1
    assert records.get().account == str(alice.pk)


def test_another_body_with_the_same_key_is_a_422(alice: User, post: Post) -> None:
    post("/mw/plain/", {"amount": 1})
    other = post("/mw/plain/", {"amount": 2})

    assert other.status_code == 422
    assert problem(other)["status"] == 422
    assert effects("mw_plain") == 1


def test_a_missing_key_is_a_400_where_required(alice: User, post: Post, settings: Any) -> None:
    missing = post("/mw/plain/", {"amount": 1}, key=None)

    assert missing.status_code == 400
    assert problem(missing)["status"] == 400
    assert effects("mw_plain") == 0

    settings.IDEMPOTENCY = {"REQUIRED": False}
    assert post("/mw/plain/", {"amount": 1}, key=None).status_code == 201
    assert post("/mw/plain/", {"amount": 1}, key=None).status_code == 201
    assert effects("mw_plain") == 2
    assert not records.exists()


def test_a_malformed_key_and_an_anonymous_caller_are_refused(post: Post, alice: User) -> None:
    assert post("/mw/plain/", {"amount": 1}, key="").status_code == 400
    assert post("/mw/plain/", {"amount": 1}, key="x" * 256).status_code == 400
    assert post("/mw/plain/", {"amount": 1}, user=None).status_code == 403
    assert effects("mw_plain") == 0


def test_the_anonymous_403_speaks_of_the_middleware(post: Post, alice: User) -> None:
    """No decorator here to move: the detail says where the middleware finds the user."""
    refused = post("/mw/plain/", {"amount": 1}, user=None)

    assert refused.status_code == 403
    detail = problem(refused)["detail"]
    assert "IdempotencyMiddleware" in detail
    assert "outside @idempotent" not in detail


def test_a_duplicate_while_the_first_runs_is_a_409(
    alice: User, post: Post, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The duplicate is sent from inside the first request's view, while that one holds
    its claim: the in-flight case, without threads (those are in the concurrency tests)."""
    duplicates: list[Any] = []

    def send_duplicate() -> None:
        duplicates.append(post("/mw/plain/", {"amount": 1}))

    monkeypatch.setattr(middleware_views, "DURING", [send_duplicate])
    first = post("/mw/plain/", {"amount": 1})

    assert first.status_code == 201
    [duplicate] = duplicates
    assert duplicate.status_code == 409
    assert duplicate["Retry-After"].isdigit()
    assert problem(duplicate)["status"] == 409
    assert effects("mw_plain") == 1


def test_a_class_based_view_is_protected(alice: User, post: Post) -> None:
    first = post("/mw/class/", {"amount": 1})
    retry = post("/mw/class/", {"amount": 1})

    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert effects("mw_class") == 1


def test_get_is_untouched(alice: User, client: Client) -> None:
    headers = {
        "Idempotency-Key": "k1",
        "Authorization": f"Token {Token.objects.create(user=alice)}",
    }
    first = client.get("/mw/viewset/", headers=headers)
    second = client.get("/mw/viewset/", headers=headers)

    assert first.status_code == second.status_code == 200
    assert "Idempotent-Replayed" not in second
    assert not records.exists()


def test_methods_setting_decides_what_is_protected(alice: User, post: Post, settings: Any) -> None:
    settings.IDEMPOTENCY = {"METHODS": ["PATCH"]}
    post("/mw/plain/", {"amount": 1})
    post("/mw/plain/", {"amount": 1})
    assert effects("mw_plain") == 2
    assert not records.exists()

    first = post("/mw/plain/", {"amount": 1}, method="patch")
    retry = post("/mw/plain/", {"amount": 1}, method="patch")
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert effects("mw_plain") == 3


def test_the_global_switch_turns_the_middleware_off(alice: User, post: Post, settings: Any) -> None:
    settings.IDEMPOTENCY = {"ENABLED": False}
    post("/mw/plain/", {"amount": 1})
    post("/mw/plain/", {"amount": 1}, key=None)

    assert effects("mw_plain") == 2
    assert not records.exists()


# --- exemptions -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "label"), [("/mw/exempt/", "mw_exempt"), ("/mw/exempt-class/", "mw_exempt_class")]
)
def test_an_exempt_view_is_untouched(alice: User, post: Post, path: str, label: str) -> None:
    first = post(path, {"amount": 1})
    retry = post(path, {"amount": 1})
    without_key = post(path, {"amount": 1}, key=None)

    assert first.status_code == retry.status_code == without_key.status_code == 201
    assert "Idempotent-Replayed" not in retry
    assert effects(label) == 3
    assert not records.exists()


def test_an_exempt_handler_of_a_class_based_view_is_untouched(alice: User, post: Post) -> None:
    post("/mw/class/", {"amount": 1}, method="patch")
    post("/mw/class/", {"amount": 1}, method="patch", key=None)
    assert effects("mw_class_exempt_patch") == 2
    assert post("/mw/class/", {"amount": 1}, key=None).status_code == 400  # post: protected
    assert not records.exists()


def test_an_exempt_viewset_action_is_untouched(alice: User, client: Client) -> None:
    send, token = assert_untouched_by_the_middleware(client, alice, "/mw/viewset/ping/")

    assert effects("mw_viewset_ping") == 2
    send("/mw/viewset/", token)  # create, on the same viewset: still protected
    assert send("/mw/viewset/", token)["Idempotent-Replayed"] == "true"


@pytest.mark.parametrize(
    ("exempt", "path"),
    [(["mw-named"], "/mw/named/"), (["mwns:n"], "/mw/ns/plain/"), (["mwns:*"], "/mw/ns/plain/")],
)
def test_exempt_url_names(
    alice: User, post: Post, settings: Any, exempt: list[str], path: str
) -> None:
    assert post(path, {"amount": 1}, key=None).status_code == 400  # protected by default

    settings.IDEMPOTENCY = {"EXEMPT_URL_NAMES": exempt}
    post(path, {"amount": 1})
    post(path, {"amount": 1})
    assert post(path, {"amount": 1}, key=None).status_code == 201
    assert effects("mw_named") == 3
    assert not records.exists()


def test_a_namespace_pattern_does_not_exempt_a_name_that_only_starts_like_it(
    alice: User, post: Post, settings: Any
) -> None:
    settings.IDEMPOTENCY = {"EXEMPT_URL_NAMES": ["mw:*", "mw-name"]}
    assert post("/mw/named/", {"amount": 1}, key=None).status_code == 400


def test_the_admin_is_exempt_by_default(admin_user: User, client: Client, settings: Any) -> None:
    """The admin's forms send no key: protected, every save would be a 400."""
    client.force_login(admin_user)
    add = client.post("/admin/auth/group/add/", {"name": "editors"})
    assert add.status_code == 302
    assert not records.exists()

    settings.IDEMPOTENCY = {"EXEMPT_URL_NAMES": []}
    refused = client.post("/admin/auth/group/add/", {"name": "writers"})
    assert refused.status_code == 400


# --- protected once, never twice ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "label"),
    [
        ("/mw/decorated/", "effect"),
        ("/mw/decorated-class/", "class_based"),
        ("/mw/decorated-async/", "async"),
    ],
)
def test_a_decorated_view_is_protected_once(alice: User, post: Post, path: str, label: str) -> None:
    """Protected twice, the decorator would find the middleware's claim on its own key and
    answer the very first request 409."""
    first = post(path, {"amount": 1})
    retry = post(path, {"amount": 1})

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert effects(label) == 1
    assert records.count() == 1


def test_a_decorated_view_keeps_its_own_options_under_the_middleware(
    alice: User, post: Post
) -> None:
    """The decorator, not the middleware, claims a view it protects: its own options apply.
    Here only ``amount`` makes the request; claimed by the middleware with the defaults, the
    retry with another note would be a 422 instead of the replay."""
    first = post("/mw/decorated-fields/", {"amount": 1, "note": "first"})
    retry = post("/mw/decorated-fields/", {"amount": 1, "note": "second"})

    assert first.status_code == 201
    assert retry.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert effects("fields") == 1
    assert records.count() == 1


# --- nested layers of one scope: the outer claim governs, the inner layer runs once ---------------


@pytest.mark.parametrize(
    ("path", "label"),
    [
        ("/mw/wrapped/", "mw_wrapped"),  # @idempotent under a decorator without functools.wraps
        ("/mw/calls-charge/", "mw_charge"),  # an undecorated view calling an @idempotent function
        ("/mw/wrapped-calls-charge/", "mw_charge"),  # both: three layers of one scope
    ],
)
def test_an_inner_idempotent_layer_runs_once_under_the_middlewares_claim(
    alice: User, post: Post, monkeypatch: pytest.MonkeyPatch, path: str, label: str
) -> None:
    """The middleware claims the request, then meets ``@idempotent`` inside the view, for the
    same account, endpoint and key. Claimed again, the inner layer would find the outer's
    claim and answer 409 to every attempt, forever."""
    duplicates: list[Any] = []
    monkeypatch.setattr(
        middleware_views, "DURING", [lambda: duplicates.append(post(path, {"amount": 1}))]
    )
    first = post(path, {"amount": 1})
    monkeypatch.setattr(middleware_views, "DURING", [])
    retry = post(path, {"amount": 1})

    assert first.status_code == 201
    assert "Idempotent-Replayed" not in first
    [duplicate] = duplicates  # sent while the first held its claim
    assert duplicate.status_code == 409
    assert problem(duplicate)["type"].endswith("in-flight")
    assert retry.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert effects(label) == 1
    assert records.count() == 1


def test_a_second_inner_call_under_one_claim_is_refused(alice: User, post: Post) -> None:
    """Once: the same key's work is not done twice because a view calls it twice."""
    first = post("/mw/calls-charge-twice/", {"amount": 1})
    retry = post("/mw/calls-charge-twice/", {"amount": 1})

    assert json.loads(first.content) == {"first": 201, "second": 409}
    assert retry["Idempotent-Replayed"] == "true"
    assert effects("mw_charge") == 1


def test_under_asgi_a_second_inner_call_under_one_claim_is_refused(alice: User) -> None:
    """The async path keeps the rule too: an async view calling an async ``@idempotent``
    function twice under the middleware's claim does its work once."""
    first = apost("/mw/async-calls-charge-twice/", {"amount": 1})
    retry = apost("/mw/async-calls-charge-twice/", {"amount": 1})

    assert json.loads(first.content) == {"first": 201, "second": 409}
    assert retry["Idempotent-Replayed"] == "true"
    assert effects("mw_async_charge") == 1


def test_an_inner_layer_of_another_scope_holds_its_own_claim(alice: User, post: Post) -> None:
    """An inner function that scopes its key apart (its own endpoint) claims its own record.
    When the outer outcome is not stored (a 5xx releases the outer key), the retry runs the
    view again, and the inner work is replayed from its own record, not redone."""
    failed = post("/mw/calls-another-scope/", {"amount": 1}, X_Outer_Status="503")
    assert failed.status_code == 503
    assert list([r.endpoint for r in records.all()]) == ["charge-of-its-own"]

    first = post("/mw/calls-another-scope/", {"amount": 1})
    retry = post("/mw/calls-another-scope/", {"amount": 1})

    assert first.status_code == 201
    assert first["Idempotent-Replayed"] == "true"  # the inner function's stored outcome
    assert retry["Idempotent-Replayed"] == "true"
    assert effects("mw_own_scope") == 1
    assert effects("mw_outer") == 2
    assert records.count() == 2


def test_a_drf_view_with_the_mixin_is_protected_once(alice: User, client: Client) -> None:
    token = Token.objects.create(user=alice).key
    send = token_post(client)
    first = send("/mw/mixin/", token)
    retry = send("/mw/mixin/", token)

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert effects("mw_mixin") == 1
    assert records.count() == 1


# --- DRF views: claimed after DRF's authentication ------------------------------------------


def token_post(client: Client) -> Callable[..., Any]:
    def send(path: str, token: str | None, body: Any = None, key: str = "k1") -> Any:
        headers = {"Idempotency-Key": key}
        if token is not None:
            headers["Authorization"] = f"Token {token}"
        return client.post(
            path,
            data=json.dumps({"amount": 1} if body is None else body),
            content_type="application/json",
            headers=headers,
        )

    return send


def assert_untouched_by_the_middleware(
    client: Client, alice: User, path: str
) -> tuple[Callable[..., Any], str]:
    """POST ``path`` twice with alice's DRF token: both run (no replay) and nothing is
    stored. Returns the sender and the token, for more requests."""
    send = token_post(client)
    token = Token.objects.create(user=alice).key
    first = send(path, token)
    retry = send(path, token)
    assert first.status_code == retry.status_code == 201
    assert "Idempotent-Replayed" not in retry
    assert not records.exists()
    return send, token


@pytest.mark.parametrize(
    ("path", "label"),
    [
        ("/mw/drf/", "mw_drf"),
        ("/mw/viewset/", "mw_viewset"),
        ("/mw/api-function/", "mw_api_function"),
    ],
)
def test_drf_views_are_scoped_to_the_token_user(
    alice: User, bob: User, client: Client, path: str, label: str
) -> None:
    """No X-User header: to the middleware's own request both callers are anonymous (a
    claim there would be refused, or shared). The claim happens after DRF's token
    authentication, so each user gets their own response for the same key."""
    send = token_post(client)
    alices, bobs = Token.objects.create(user=alice).key, Token.objects.create(user=bob).key

    first_alice = send(path, alices)
    first_bob = send(path, bobs)
    retry_alice = send(path, alices)
    retry_bob = send(path, bobs)

    assert first_alice.status_code == first_bob.status_code == 201
    assert json.loads(first_alice.content)["user"] == "alice"
    assert json.loads(first_bob.content)["user"] == "bob"
    assert retry_alice.content == first_alice.content
    assert retry_bob.content == first_bob.content
    assert retry_alice["Idempotent-Replayed"] == retry_bob["Idempotent-Replayed"] == "true"
    assert effects(label) == 2
    assert sorted([r.account for r in records.all()]) == sorted([str(alice.pk), str(bob.pk)])


def test_an_exempt_drf_view_is_untouched(alice: User, client: Client) -> None:
    assert_untouched_by_the_middleware(client, alice, "/mw/exempt-drf/")

    assert effects("mw_exempt_drf") == 2


def test_drf_refuses_an_unauthenticated_request_before_any_claim(
    alice: User, client: Client
) -> None:
    refused = token_post(client)("/mw/drf/", None)

    assert refused.status_code == 401
    assert effects("mw_drf") == 0
    assert not records.exists()


def test_drf_errors_through_the_middleware(alice: User, client: Client) -> None:
    send = token_post(client)
    token = Token.objects.create(user=alice).key

    invalid = send("/mw/drf/", token, {"amount": "many"})
    again = send("/mw/drf/", token, {"amount": "many"})
    mismatch = send("/mw/drf/", token, {"amount": 2})
    missing = client.post(
        "/mw/drf/", data="{}", content_type="application/json", HTTP_AUTHORIZATION=f"Token {token}"
    )

    assert invalid.status_code == 400  # DRF's validation error: definitive, stored
    assert again["Idempotent-Replayed"] == "true"
    assert mismatch.status_code == 422
    assert missing.status_code == 400
    assert problem(missing)["status"] == 400
    assert effects("mw_drf") == 0


# --- decorators a URLconf wraps around a view: the callback Django resolved always runs ------


@pytest.mark.parametrize(
    ("path", "status", "label"),
    [
        ("/mw/staff-drf/", 302, "mw_drf"),  # staff_member_required: to the admin's login
        ("/mw/forbidden-drf/", 403, "mw_drf"),
        ("/mw/forbidden-viewset/", 403, "mw_viewset"),
    ],
)
def test_a_decorator_wrapped_around_a_drf_view_in_the_urlconf_refuses_keyed_requests(
    alice: User, client: Client, path: str, status: int, label: str
) -> None:
    """The middleware runs the callback Django resolved, wrapper included: a non-staff
    caller's keyed POST never reaches the DRF view, and nothing is claimed for it."""
    send = token_post(client)
    token = Token.objects.create(user=alice).key

    keyed = send(path, token)
    retry = send(path, token)
    unkeyed = client.post(
        path, data="{}", content_type="application/json", HTTP_AUTHORIZATION=f"Token {token}"
    )

    assert keyed.status_code == retry.status_code == unkeyed.status_code == status
    assert effects(label) == 0
    assert not records.exists()


def test_a_decorator_wrapped_around_a_drf_view_runs_on_every_request(
    alice: User, bob: User, client: Client
) -> None:
    """Claimed after the wrapper and after DRF's token authentication: each user's retry
    is replayed from their own record, and the wrapper ran for every request."""
    send = token_post(client)
    alices, bobs = Token.objects.create(user=alice).key, Token.objects.create(user=bob).key

    first = send("/mw/counted-drf/", alices)
    other = send("/mw/counted-drf/", bobs)
    retry = send("/mw/counted-drf/", alices)

    assert first.status_code == other.status_code == 201
    assert first["X-Wrapper"] == retry["X-Wrapper"] == "ran"
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert json.loads(other.content)["user"] == "bob"
    assert effects("mw_drf") == 2
    assert effects("mw_wrapper") == 3
    assert sorted(r.account for r in records.all()) == sorted([str(alice.pk), str(bob.pk)])


def test_staff_member_required_around_a_drf_view_lets_staff_through(
    alice: User, client: Client
) -> None:
    alice.is_staff = True
    alice.save()
    token = Token.objects.create(user=alice).key

    def send() -> Any:
        return client.post(
            "/mw/staff-drf/",
            data=json.dumps({"amount": 1}),
            content_type="application/json",
            headers={"Idempotency-Key": "k1", "Authorization": f"Token {token}", "X-User": "alice"},
        )

    first, retry = send(), send()

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert effects("mw_drf") == 1


def test_the_plain_view_path_runs_the_decorator_the_urlconf_wrapped_around_it(
    alice: User, post: Post
) -> None:
    refused = post("/mw/forbidden-plain/", {"amount": 1})

    assert refused.status_code == 403
    assert refused.content == b"forbidden by the URLconf"
    assert effects("mw_plain") == 0


def test_the_plain_view_path_runs_the_decorator_the_urlconf_wrapped(
    alice: User, post: Post
) -> None:
    """The plain path protects the resolved callback: its wrapper runs inside the claim,
    and a replay is answered before it, from the first run's record."""
    first = post("/mw/counted-plain/", {"amount": 1})
    retry = post("/mw/counted-plain/", {"amount": 1})

    assert first.status_code == 201
    assert first["X-Wrapper"] == "ran"
    assert retry["Idempotent-Replayed"] == "true"
    assert effects("mw_plain") == 1
    assert effects("mw_wrapper") == 1


@pytest.mark.parametrize("path", ["/mw/forbidden-drf/", "/mw/async-forbidden-drf/"])
def test_under_asgi_a_decorator_wrapped_around_a_drf_view_refuses(alice: User, path: str) -> None:
    token = Token.objects.create(user=alice).key

    async def send(key: str | None) -> Any:
        headers = {"Authorization": f"Token {token}"}
        if key is not None:
            headers["Idempotency-Key"] = key
        return await AsyncClient().post(
            path, data=json.dumps({"amount": 1}), content_type="application/json", headers=headers
        )

    assert async_to_sync(send)("k1").status_code == 403
    assert async_to_sync(send)(None).status_code == 403
    assert effects("mw_drf") == 0
    assert not records.exists()


def test_under_asgi_a_decorator_wrapped_around_a_drf_view_runs_on_every_request(
    alice: User,
) -> None:
    token = Token.objects.create(user=alice).key

    async def send() -> Any:
        return await AsyncClient().post(
            "/mw/counted-drf/",
            data=json.dumps({"amount": 1}),
            content_type="application/json",
            headers={"Idempotency-Key": "k1", "Authorization": f"Token {token}"},
        )

    first = async_to_sync(send)()
    retry = async_to_sync(send)()

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert first["X-Wrapper"] == retry["X-Wrapper"] == "ran"
    assert effects("mw_drf") == 1
    assert effects("mw_wrapper") == 2


# --- ATOMIC_REQUESTS ---------------------------------------------------------------------------


@pytest.fixture
def atomic_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(connections["default"].settings_dict, "ATOMIC_REQUESTS", True)


@pytest.mark.parametrize("path", ["/mw/plain/", "/mw/class/"])
def test_under_atomic_requests_a_view_that_raises_after_writing_commits_nothing(
    alice: User, post: Post, client: Client, atomic_requests: None, path: str
) -> None:
    client.raise_request_exception = False
    crashed = post(path, {"amount": 1, "raise": True})

    assert crashed.status_code == 500
    assert effects() == 0  # the write rolled back with the request's transaction
    assert not records.exists()  # and the key was released

    retry = post(path, {"amount": 1, "raise": True})
    assert retry.status_code == 500  # it ran again (the key was free), and failed again
    assert effects() == 0


def test_under_atomic_requests_the_work_commits_and_is_replayed(
    alice: User, post: Post, atomic_requests: None
) -> None:
    first = post("/mw/plain/", {"amount": 1})
    retry = post("/mw/plain/", {"amount": 1})

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert effects("mw_plain") == 1


def test_under_atomic_requests_the_view_runs_in_the_request_transaction(
    alice: User, post: Post, atomic_requests: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []
    monkeypatch.setattr(
        middleware_views, "DURING", [lambda: seen.append(connections["default"].in_atomic_block)]
    )
    post("/mw/plain/", {"amount": 1})
    assert seen == [True]


def test_a_view_opted_out_of_atomic_requests_stays_out(
    alice: User, post: Post, atomic_requests: None
) -> None:
    first = post("/mw/non-atomic/", {"amount": 1})
    retry = post("/mw/non-atomic/", {"amount": 1})

    assert json.loads(first.content)["in_atomic"] is False
    assert retry["Idempotent-Replayed"] == "true"
    assert effects("mw_non_atomic") == 1


@pytest.mark.database_store("the completion inside ATOMIC_REQUESTS' transaction, killed by SQL")
def test_a_2xx_is_never_given_for_work_that_rolled_back(
    alice: User, post: Post, atomic_requests: None
) -> None:
    """The completion is written inside the request's transaction; when it fails, the
    work rolls back with it and the client gets a 503, not the view's 201."""
    with connection_killed_before(is_completion) as killed:
        lost = post("/mw/plain/", {"amount": 1})

    assert killed
    assert lost.status_code == 503
    assert effects() == 0
    assert not records.exists()

    retry = post("/mw/plain/", {"amount": 1})
    again = post("/mw/plain/", {"amount": 1})
    assert retry.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert effects() == 1


def test_a_drf_view_under_atomic_requests_rolls_back_and_releases(
    alice: User, client: Client, atomic_requests: None
) -> None:
    client.raise_request_exception = False
    token = Token.objects.create(user=alice).key
    send = token_post(client)
    crashed = send("/mw/viewset/", token, {"crash": True})

    assert crashed.status_code == 500
    assert effects() == 0
    assert not records.exists()


# --- async (ASGI) -------------------------------------------------------------------------------


def apost(path: str, body: dict[str, Any], key: str | None = "k1", user: str = "alice") -> Any:
    headers = {"X-User": user}
    if key is not None:
        headers["Idempotency-Key"] = key

    async def send() -> Any:
        return await AsyncClient().post(
            path, data=json.dumps(body), content_type="application/json", headers=headers
        )

    return async_to_sync(send)()


@pytest.mark.parametrize(
    ("path", "label"),
    [
        ("/mw/async/", "mw_async"),
        ("/mw/plain/", "mw_plain"),
        ("/mw/decorated-async/", "async"),
        ("/mw/decorated/", "effect"),
    ],
)
def test_under_asgi_views_are_protected_once(alice: User, path: str, label: str) -> None:
    first = apost(path, {"amount": 1})
    retry = apost(path, {"amount": 1})
    mismatch = apost(path, {"amount": 2})
    missing = apost(path, {"amount": 1}, key=None)

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert mismatch.status_code == 422
    assert missing.status_code == 400
    assert effects(label) == 1


def test_under_asgi_a_drf_view_is_scoped_after_drf_auth(alice: User, bob: User) -> None:
    tokens = {user.username: Token.objects.create(user=user).key for user in (alice, bob)}

    async def send(user: str) -> Any:
        return await AsyncClient().post(
            "/mw/drf/",
            data=json.dumps({"amount": 1}),
            content_type="application/json",
            headers={"Idempotency-Key": "k1", "Authorization": f"Token {tokens[user]}"},
        )

    first = async_to_sync(send)("alice")
    other = async_to_sync(send)("bob")
    retry = async_to_sync(send)("alice")

    assert json.loads(first.content)["user"] == "alice"
    assert json.loads(other.content)["user"] == "bob"
    assert retry.content == first.content
    assert retry["Idempotent-Replayed"] == "true"
    assert effects("mw_drf") == 2


def test_under_asgi_a_failing_async_view_releases_its_key(alice: User) -> None:
    async def send() -> Any:
        client = AsyncClient(raise_request_exception=False)
        return await client.post(
            "/mw/async/",
            data=json.dumps({"amount": 1, "raise": True}),
            content_type="application/json",
            headers={"Idempotency-Key": "k1", "X-User": "alice"},
        )

    assert async_to_sync(send)().status_code == 500
    assert not records.exists()
    assert effects("mw_async") == 1  # no transaction around an async view: the row stays


def test_an_async_view_under_wsgi_is_protected(alice: User, post: Post) -> None:
    first = post("/mw/async/", {"amount": 1})
    retry = post("/mw/async/", {"amount": 1})

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert effects("mw_async") == 1


def test_an_async_view_under_atomic_requests_gets_djangos_own_error(
    alice: User, post: Post, client: Client, atomic_requests: None
) -> None:
    """Django refuses ATOMIC_REQUESTS on an async view; the middleware lets it say so
    rather than run the view outside the transaction the project asked for."""
    client.raise_request_exception = False
    refused = post("/mw/async/", {"amount": 1})

    assert refused.status_code == 500
    assert effects() == 0
    assert not records.exists()


def test_under_asgi_an_async_view_under_atomic_requests_gets_djangos_own_error(
    alice: User, atomic_requests: None
) -> None:
    async def send() -> Any:
        return await AsyncClient(raise_request_exception=False).post(
            "/mw/async/",
            data=json.dumps({"amount": 1}),
            content_type="application/json",
            headers={"Idempotency-Key": "k1", "X-User": "alice"},
        )

    assert async_to_sync(send)().status_code == 500
    assert effects() == 0
    assert not records.exists()


def held_and_duplicate_under_asgi(alice: User, path: str, view: Any) -> tuple[Any, Any]:
    """The middleware in async mode, called as Django's ASGI handler calls it, with ``view``
    for ``path``: a first request parked in ``async_hold`` on the event loop, a duplicate
    sent on the same loop meanwhile, then the first let go. Their answers, in that order."""

    async def get_response(request: Any) -> Any:  # pragma: no cover - process_view answers
        raise AssertionError("the view middleware answers protected requests")

    middleware = IdempotencyMiddleware(get_response)

    async def send() -> Any:
        request = AsyncRequestFactory().post(
            path,
            data=json.dumps({"hold": True}),
            content_type="application/json",
            headers={"Idempotency-Key": "k1"},
        )
        request.user = alice
        request.resolver_match = resolve(path)
        return await middleware.process_view(request, view, (), {})

    async def scenario() -> tuple[Any, Any]:
        middleware_views.async_hold.entered = asyncio.Event()
        middleware_views.async_hold.release = asyncio.Event()
        first = asyncio.ensure_future(send())
        await asyncio.wait_for(middleware_views.async_hold.entered.wait(), timeout=20)
        duplicate = await asyncio.wait_for(send(), timeout=20)
        middleware_views.async_hold.release.set()
        return await asyncio.wait_for(first, timeout=20), duplicate

    try:
        return async_to_sync(scenario)()
    finally:
        middleware_views.async_hold.entered = middleware_views.async_hold.release = None


def test_under_asgi_a_duplicate_of_a_running_async_view_is_a_409(alice: User) -> None:
    """The middleware in async mode, called as Django's ASGI handler calls it: the first
    request parks inside its view on the event loop, and the duplicate is answered on the
    same loop meanwhile, so the claim never blocked the loop."""
    first, duplicate = held_and_duplicate_under_asgi(
        alice, "/mw/async/", middleware_views.async_plain
    )

    assert duplicate.status_code == 409
    assert problem(duplicate)["status"] == 409
    assert first.status_code == 201
    assert effects("mw_async") == 1


@pytest.mark.parametrize("on_disconnect", ["finish", "release"])
def test_under_asgi_an_async_view_cancelled_as_it_returns_stores_its_response(
    alice: User, settings: Any, on_disconnect: str
) -> None:
    """The middleware's async path: a client that goes away once the view has run does not
    release the key, under either policy; the retry is the replay."""
    settings.IDEMPOTENCY = {"ON_DISCONNECT": on_disconnect}

    async def get_response(request: Any) -> Any:  # pragma: no cover - process_view answers
        raise AssertionError("the view middleware answers protected requests")

    middleware = IdempotencyMiddleware(get_response)
    request = AsyncRequestFactory().post(
        "/mw/async/", data="{}", content_type="application/json", headers={"Idempotency-Key": "k1"}
    )
    request.user = alice
    request.resolver_match = resolve("/mw/async/")

    def view(request: Any) -> Any:
        return middleware.process_view(request, middleware_views.async_plain, (), {})

    assert cancelled_at(view, request, "return")

    retry = apost("/mw/async/", {})
    assert retry.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert effects("mw_async") == 1


@pytest.mark.parametrize(
    ("path", "label"),
    [
        ("/mw/async-wrapped/", "mw_async_wrapped"),
        ("/mw/async-calls-charge/", "mw_async_charge"),
    ],
)
def test_under_asgi_an_inner_idempotent_layer_runs_once_under_the_middlewares_claim(
    alice: User, path: str, label: str
) -> None:
    """The middleware in async mode, called as Django's ASGI handler calls it: the first
    request parks inside the inner ``@idempotent`` layer, a duplicate is answered 409
    meanwhile on the same loop; once the first has completed, a retry through the whole
    ASGI stack is a replay."""
    first, duplicate = held_and_duplicate_under_asgi(alice, path, resolve(path).func)
    retry = apost(path, {"hold": True})

    assert first.status_code == 201
    assert duplicate.status_code == 409
    assert problem(duplicate)["type"].endswith("in-flight")
    assert retry.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert effects(label) == 1
    assert records.count() == 1
