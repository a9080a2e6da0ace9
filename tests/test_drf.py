"""``IdempotentMixin``: the decision table through Django REST framework views."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connections
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from idempotency_django.models import IdempotencyRecord
from tests import records
from tests.conftest import effects
from tests.project.views import gate, not_validation_failures
from tools.threads import start_together

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def api(alice: User) -> APIClient:
    client = APIClient()
    client.force_authenticate(alice)
    return client


def post(client: APIClient, path: str, body: Any, key: str | None = "k1", **headers: str) -> Any:
    if key is not None:
        headers["Idempotency-Key"] = key
    return client.post(
        path, data=json.dumps(body), content_type="application/json", headers=headers
    )


@pytest.mark.parametrize(
    ("first", "retry"),
    [
        ("/api/slash-optional", "/api/slash-optional/"),
        ("/api/slash-optional/refund/", "/api/slash-optional/refund"),
    ],
)
def test_a_retry_that_differs_only_in_the_trailing_slash_is_replayed(
    api: APIClient, first: str, retry: str
) -> None:
    """A router with ``trailing_slash="/?"``: one route takes both paths."""
    original = post(api, first, {"amount": 5})
    again = post(api, retry, {"amount": 5})

    assert original.status_code == again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == original.content
    assert effects() == 1


def test_actions_of_one_router_a_slash_apart_keep_their_own_keys(api: APIClient) -> None:
    create = post(api, "/api/slash-optional", {"amount": 5})
    refund = post(api, "/api/slash-optional/refund", {"amount": 5})

    assert create.status_code == refund.status_code == 201
    assert "Idempotent-Replayed" not in refund
    assert effects("drf") == effects("drf-refund") == 1


def test_create_runs_once_and_replays_the_rendered_response(api: APIClient) -> None:
    first = post(api, "/api/charges/", {"amount": 5})
    retry = post(api, "/api/charges/", {"amount": 5})

    assert first.status_code == retry.status_code == 201
    assert retry.content == first.content
    assert retry["Content-Type"] == first["Content-Type"] == "application/json"
    assert retry["Location"] == first["Location"]
    assert retry["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first
    assert effects("drf") == 1


def test_the_negotiated_content_type_is_stored(api: APIClient) -> None:
    first = api.post(
        "/api/charges/",
        data=json.dumps({"amount": 6}),
        content_type="application/json",
        headers={"Idempotency-Key": "csv", "Accept": "text/csv"},
    )
    retry = api.post(
        "/api/charges/",
        data=json.dumps({"amount": 6}),
        content_type="application/json",
        headers={"Idempotency-Key": "csv", "Accept": "text/csv"},
    )

    assert first["Content-Type"] == "text/csv; charset=utf-8"
    assert retry["Content-Type"] == first["Content-Type"]
    assert retry.content == first.content
    assert retry["Idempotent-Replayed"] == "true"


def test_validation_error_is_a_stored_400(api: APIClient) -> None:
    first = post(api, "/api/charges/", {"amount": 0})
    retry = post(api, "/api/charges/", {"amount": 0})

    assert first.status_code == retry.status_code == 400
    assert retry.content == first.content
    assert retry["Idempotent-Replayed"] == "true"


def test_the_corrected_body_of_a_validation_error_needs_a_new_key(api: APIClient) -> None:
    """The serializer's 400 is the key's answer, as ninja's 422 is (test_ninja.py): the
    corrected body with the same key is a 422 ``key-mismatch``; a new key runs."""
    invalid = post(api, "/api/charges/", {"amount": 0})
    corrected = post(api, "/api/charges/", {"amount": 5})
    new_key = post(api, "/api/charges/", {"amount": 5}, key="k2")

    assert invalid.status_code == 400
    assert corrected.status_code == 422
    assert corrected["Content-Type"] == "application/problem+json"
    assert json.loads(corrected.content)["type"] == "urn:idempotency-django:problem:key-mismatch"
    assert new_key.status_code == 201
    assert effects("drf") == 1


def test_store_statuses_without_validation_failures_lets_the_corrected_body_run(
    api: APIClient, settings: Any
) -> None:
    settings.IDEMPOTENCY = {"STORE_STATUSES": not_validation_failures}

    invalid = post(api, "/api/charges/", {"amount": 0})
    corrected = post(api, "/api/charges/", {"amount": 5})

    assert invalid.status_code == 400
    assert corrected.status_code == 201
    assert "Idempotent-Replayed" not in corrected
    assert effects("drf") == 1


def test_5xx_api_exception_releases_the_key(api: APIClient) -> None:
    first = post(api, "/api/charges/", {"amount": 5, "unavailable": True})
    retry = post(api, "/api/charges/", {"amount": 5, "unavailable": True})

    assert first.status_code == retry.status_code == 503
    assert "Idempotent-Replayed" not in retry
    assert effects("drf") == 2
    assert not records.exists()


def test_unexpected_exception_releases_the_key(api: APIClient) -> None:
    api.raise_request_exception = False
    assert post(api, "/api/charges/", {"amount": 5, "crash": True}).status_code == 500
    assert not records.exists()
    assert post(api, "/api/charges/", {"amount": 5}).status_code == 201


def test_errors_are_problem_json_with_the_default_exception_handler(api: APIClient) -> None:
    post(api, "/api/charges/", {"amount": 5})
    mismatch = post(api, "/api/charges/", {"amount": 6})
    missing = post(api, "/api/charges/", {"amount": 6}, key=None)
    malformed = post(api, "/api/charges/", {"amount": 6}, key="")

    assert mismatch.status_code == 422
    assert mismatch["Content-Type"] == "application/problem+json"
    assert json.loads(mismatch.content)["type"] == "urn:idempotency-django:problem:key-mismatch"
    assert missing.status_code == 400
    assert json.loads(missing.content)["type"] == "urn:idempotency-django:problem:key-missing"
    assert malformed.status_code == 400
    assert effects("drf") == 1


def test_errors_go_through_a_custom_exception_handler(api: APIClient, settings: Any) -> None:
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "EXCEPTION_HANDLER": "tests.project.drf_views.custom_exception_handler",
    }
    post(api, "/api/charges/", {"amount": 5})
    mismatch = post(api, "/api/charges/", {"amount": 6})

    assert mismatch.status_code == 422
    assert mismatch["Content-Type"] == "application/json"
    assert json.loads(mismatch.content)["error"]["code"] == "key-mismatch"


def test_in_flight_409_keeps_retry_after_through_a_custom_handler(
    api: APIClient, alice: User, settings: Any
) -> None:
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "EXCEPTION_HANDLER": "tests.project.drf_views.custom_exception_handler",
    }
    post(api, "/api/charges/", {"amount": 5})
    records.update(state=IdempotencyRecord.State.IN_PROGRESS)
    from datetime import timedelta

    from django.utils import timezone

    records.update(lease_expires_at=timezone.now() + timedelta(seconds=30))
    response = post(api, "/api/charges/", {"amount": 5})

    assert response.status_code == 409
    assert response["Retry-After"] == "1"
    assert json.loads(response.content)["error"]["code"] == "in-flight"


def test_only_the_configured_actions_are_protected(api: APIClient) -> None:
    post(api, "/api/charges/refund/", {})
    refund_retry = post(api, "/api/charges/refund/", {})
    post(api, "/api/charges/note/", {}, key=None)
    post(api, "/api/charges/note/", {}, key=None)

    assert refund_retry["Idempotent-Replayed"] == "true"
    assert effects("drf-refund") == 1
    assert effects("drf-note") == 2


def test_unauthenticated_request_never_claims_a_key(db: None) -> None:
    response = post(APIClient(), "/api/charges/", {"amount": 5})

    assert response.status_code in (401, 403)
    assert not records.exists()


def test_throttled_request_never_claims_a_key(api: APIClient) -> None:
    from django.core.cache import cache

    cache.clear()
    first = post(api, "/api/throttled/", {}, key="a")
    throttled = post(api, "/api/throttled/", {}, key="b")

    assert first.status_code == 201
    assert throttled.status_code == 429
    assert list([r.key for r in records.all()]) == ["a"]


@pytest.mark.parametrize("scheme", ["token", "basic", "session"])
def test_the_account_is_the_drf_authenticated_user(
    alice: User, bob: User, scheme: str, client: Any
) -> None:
    def as_user(user: User) -> APIClient:
        api = APIClient()
        if scheme == "token":
            api.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
        elif scheme == "basic":
            user.set_password("pw")
            user.save()
            credentials = base64.b64encode(f"{user.username}:pw".encode()).decode()
            api.credentials(HTTP_AUTHORIZATION=f"Basic {credentials}")
        else:
            api.credentials(HTTP_X_USER=user.username)  # the test middleware's "session"
        return api

    for_alice = post(as_user(alice), "/api/charges/", {"amount": 5})
    for_bob = post(as_user(bob), "/api/charges/", {"amount": 5})

    assert for_alice.status_code == for_bob.status_code == 201
    assert "Idempotent-Replayed" not in for_bob
    assert set([r.account for r in records.all()]) == {
        str(alice.pk),
        str(bob.pk),
    }


def test_a_hook_overrides_one_piece(api: APIClient) -> None:
    post(api, "/api/tenant/", {}, **{"X-Tenant": "t1"})
    same_tenant = post(api, "/api/tenant/", {}, **{"X-Tenant": "t1"})
    other_tenant = post(api, "/api/tenant/", {}, **{"X-Tenant": "t2"})

    assert same_tenant["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in other_tenant
    assert effects("drf-tenant") == 2
    assert set([r.account for r in records.all()]) == {"t1", "t2"}


def test_one_options_per_class_until_a_class_attribute_changes(
    api: APIClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default ``get_idempotency_options`` is built once per class (its hooks call the
    view serving the request), and again when a class attribute changes, in place too."""
    from tests.project.drf_views import TenantView

    first, second = TenantView(), TenantView()
    options = first.get_idempotency_options()
    assert second.get_idempotency_options() is options

    monkeypatch.setattr(TenantView, "idempotency_in_flight", "conflict")
    changed = first.get_idempotency_options()
    assert changed is not options
    assert changed.in_flight == "conflict"

    monkeypatch.setattr(TenantView, "idempotency_methods", ["POST"])
    listed = first.get_idempotency_options()
    TenantView.idempotency_methods.append("PUT")  # type: ignore[union-attr]
    assert first.get_idempotency_options() is not listed
    assert list(first.get_idempotency_options().methods) == ["POST", "PUT"]


def test_shared_options_call_the_hooks_of_the_view_serving_each_request(
    api: APIClient,
) -> None:
    """Requests served one after the other by one class's shared options: each account is
    its own request's (the tenant header read by that request's view)."""
    for tenant in ("t1", "t2", "t3", "t1"):
        post(api, "/api/tenant/", {}, **{"X-Tenant": tenant})

    assert effects("drf-tenant") == 3
    assert set([r.account for r in records.all()]) == {"t1", "t2", "t3"}


def test_get_is_not_protected(api: APIClient) -> None:
    response = api.get("/api/charges/", headers={"Idempotency-Key": "k"})

    assert response.status_code == 200
    assert not records.exists()


@pytest.mark.concurrency
def test_concurrent_duplicates_run_the_view_once(alice: User) -> None:
    token = Token.objects.create(user=alice).key

    def charge() -> Any:
        api = APIClient()
        api.credentials(HTTP_AUTHORIZATION=f"Token {token}")
        try:
            return post(api, "/api/charges/", {"amount": 5, "gate": True})
        finally:
            connections.close_all()

    results, threads = start_together(6, charge)
    losers = [results.get(timeout=20) for _ in range(5)]
    gate.release.set()
    for thread in threads:
        thread.join(timeout=30)
    winner = results.get(timeout=5)

    assert [r.status_code for r in losers] == [409] * 5
    assert winner.status_code == 201
    assert effects("drf") == 1


# --- configuration that would protect nothing is refused when the class is created ----------


@pytest.mark.parametrize(
    ("attribute", "value"),
    [
        ("idempotency_mod", "atomic"),  # idempotency_mode
        ("idempotency_action", {"create"}),  # idempotency_actions
        ("get_idempotency_acount", lambda self, request: "tenant"),  # the account hook
    ],
)
def test_a_misspelled_idempotency_attribute_is_refused_at_class_creation(
    attribute: str, value: Any
) -> None:
    from django.core.exceptions import ImproperlyConfigured
    from rest_framework.viewsets import ViewSet

    from idempotency_django.drf import IdempotentMixin

    with pytest.raises(ImproperlyConfigured, match=rf"Charges: unknown attribute '{attribute}'"):
        type("Charges", (IdempotentMixin, ViewSet), {attribute: value, "__module__": __name__})


@pytest.mark.parametrize(
    ("bases", "actions", "match"),
    [
        ("viewset", "create", "give a set of action names"),  # "update" in "partial_update"
        ("apiview", {"post"}, "an APIView has none"),  # self.action is always None there
    ],
)
def test_idempotency_actions_that_would_protect_nothing_are_refused(
    bases: str, actions: Any, match: str
) -> None:
    from django.core.exceptions import ImproperlyConfigured
    from rest_framework.views import APIView
    from rest_framework.viewsets import ViewSet

    from idempotency_django.drf import IdempotentMixin

    base = ViewSet if bases == "viewset" else APIView
    with pytest.raises(ImproperlyConfigured, match=match):
        type("Charges", (IdempotentMixin, base), {"idempotency_actions": actions})


@pytest.mark.django_db
def test_the_anonymous_403_speaks_of_drf_authentication() -> None:
    """A view that lets anonymous callers through: the key has no account to belong to,
    and the detail points at DRF's authentication, not at a decorator's order."""
    from rest_framework.permissions import AllowAny
    from rest_framework.response import Response
    from rest_framework.test import APIRequestFactory
    from rest_framework.views import APIView

    from idempotency_django.drf import IdempotentMixin

    class OpenCharges(IdempotentMixin, APIView):
        authentication_classes: list[Any] = []
        permission_classes = [AllowAny]

        def post(self, request: Any) -> Response:
            raise AssertionError("an anonymous key never runs the view")

    request = APIRequestFactory().post(
        "/open/", {"amount": 1}, format="json", HTTP_IDEMPOTENCY_KEY="k1"
    )
    refused = OpenCharges.as_view()(request)

    assert refused.status_code == 403
    detail = json.loads(refused.content)["detail"]
    assert "authentication_classes" in detail
    assert "outside @idempotent" not in detail
