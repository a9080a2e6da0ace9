"""Who shares a key's scope: principals that are not users, a user's deleted account,
tenants, guests, and accounts that name nobody. Every test counts runs where they happen
(``SideEffect`` rows) and reads what the client is answered."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import transaction
from django.test import Client, RequestFactory

from idempotency_django.checks import check_settings
from idempotency_django.core import accounts, keys
from idempotency_django.downstream import downstream_key, downstream_key_for
from idempotency_django.exceptions import AnonymousNotAllowed
from idempotency_django.models import IdempotencyRecord
from idempotency_django.tasks import claim_once
from tests import records
from tests.conftest import ON_REDIS, effects
from tests.models import SideEffect
from tests.project.factories import UserFactory
from tests.project.scope_views import Merchant

pytestmark = [pytest.mark.urls("tests.project.scope_urls"), pytest.mark.django_db(transaction=True)]

JSON = "application/json"


def refund(client: Client, caller: dict[str, str], amount: int = 5, key: str = "refund-1") -> Any:
    return client.post(
        "/refunds/",
        data=json.dumps({"amount": amount}),
        content_type=JSON,
        headers={"Idempotency-Key": key, **caller},
    )


# -- principals that are not users ----------------------------------------------------------


def test_a_merchant_and_the_user_with_its_pk_never_share_keys(
    alice: User, client: Client, settings: Any
) -> None:
    """A DRF authentication class returns a Merchant: merchant 7 and user 7 are two callers.
    Namespaced, each runs its own refund; neither is replayed the other's."""
    settings.IDEMPOTENCY = {"NAMESPACE_PRINCIPALS": True}

    by_user = refund(client, {"X-User": "alice"})
    by_merchant = refund(client, {"X-Merchant": str(alice.pk)})
    merchant_retry = refund(client, {"X-Merchant": str(alice.pk)})

    assert by_user.status_code == by_merchant.status_code == 201
    assert by_user.json()["by"] == "User"
    assert by_merchant.json()["by"] == "Merchant"
    assert "Idempotent-Replayed" not in by_merchant
    assert merchant_retry["Idempotent-Replayed"] == "true"
    assert merchant_retry.json() == by_merchant.json()
    assert effects() == 2
    assert {record.account for record in records.all()} == {
        str(alice.pk),
        f"tests.project.scope_views.Merchant:{alice.pk}",
    }


def test_without_namespaces_a_merchant_is_its_bare_pk_and_a_warning_says_so(
    alice: User, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """The default keeps existing scopes where they are (namespacing moves them): the
    collision stays, and the log names the setting that ends it, once per class."""
    with caplog.at_level(logging.WARNING, logger="idempotency_django"):
        refund(client, {"X-Merchant": "99999"})
        refund(client, {"X-Merchant": "99998"})

    assert {record.account for record in records.all()} == {"99999", "99998"}
    warnings = [r.getMessage() for r in caplog.records if "NAMESPACE_PRINCIPALS" in r.getMessage()]
    assert len(warnings) == 1
    assert "tests.project.scope_views.Merchant" in warnings[0]


def test_principal_account_names_models_by_label_and_others_by_class(
    alice: User, settings: Any
) -> None:
    settings.IDEMPOTENCY = {"NAMESPACE_PRINCIPALS": True}
    effect = SideEffect.objects.create(label="a model that is not the user model")

    assert keys.principal_account(alice) == str(alice.pk)
    assert keys.principal_account(effect) == f"tests.sideeffect:{effect.pk}"
    assert keys.principal_account(Merchant(7)) == "tests.project.scope_views.Merchant:7"
    assert keys.principal_account(Merchant(None)) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("namespaced", [True, False])
def test_a_principal_without_a_primary_key_is_anonymous_not_account_none(
    client: Client, settings: Any, namespaced: bool
) -> None:
    """``str(None)`` was the account "None", shared by every such principal."""
    settings.IDEMPOTENCY = {"NAMESPACE_PRINCIPALS": namespaced}
    request = RequestFactory().post("/")
    request.user = Merchant(None)  # type: ignore[arg-type,assignment]

    assert keys.default_account(request) is None


# -- a deleted user's records ---------------------------------------------------------------


@pytest.fixture
def namespaced(settings: Any) -> None:
    settings.IDEMPOTENCY = {"NAMESPACE_PRINCIPALS": True}


def pay(client: Client, username: str, amount: int, key: str = "pay-1") -> Any:
    return client.post(
        "/payments/",
        data=json.dumps({"amount": amount}),
        content_type=JSON,
        headers={"Idempotency-Key": key, "X-User": username},
    )


@pytest.mark.database_store("the Redis store's keys are digests: an account's are not found")
def test_a_new_user_with_a_deleted_users_pk_inherits_none_of_its_keys(
    client: Client, namespaced: None
) -> None:
    """A primary key can come back (a natural key, an import): the newcomer's first request
    with a key the deleted user had used runs, rather than get the other's replay or 422."""
    old = UserFactory(username="old")
    pk = old.pk
    assert pay(client, "old", 10).status_code == 201
    with claim_once(str(pk), "task-of-scope-pk") as run:  # a task whose scope is that pk
        run.result = "done"

    old.delete()
    User.objects.create(pk=pk, username="new")
    response = pay(client, "new", 99)

    assert response.status_code == 201
    assert "Idempotent-Replayed" not in response
    assert effects() == 2
    # The task whose scope happens to be that pk keeps its record.
    assert sorted((r.endpoint, r.state) for r in records.all(account=str(pk))) == [
        ("POST /payments/", "completed"),
        ("task", "completed"),
    ]


@pytest.mark.database_store("the Redis store's keys are digests: an account's are not found")
def test_a_user_deletion_that_rolls_back_keeps_the_records(
    client: Client, namespaced: None
) -> None:
    user = UserFactory(username="kept")
    assert pay(client, "kept", 10).status_code == 201

    def delete_then_roll_back() -> None:
        with transaction.atomic():
            user.delete()
            raise RuntimeError("the deletion is rolled back")

    with pytest.raises(RuntimeError):
        delete_then_roll_back()

    retry = pay(client, "kept", 10)
    assert retry["Idempotent-Replayed"] == "true"
    assert effects() == 1


@pytest.mark.django_db(transaction=True, databases=["default", "store"])
@pytest.mark.database_store("a store in a second database alias")
def test_with_the_store_in_its_own_database_a_rolled_back_deletion_keeps_the_records(
    client: Client, settings: Any
) -> None:
    """There the records' deletion is not in the user's transaction: it waits for its
    commit, and a deletion that rolls back leaves the user's retries their replay."""
    settings.IDEMPOTENCY = {"NAMESPACE_PRINCIPALS": True, "DATABASE": "store"}
    user = UserFactory(username="kept")
    assert pay(client, "kept", 10).status_code == 201

    def delete_then_roll_back() -> None:
        with transaction.atomic():
            user.delete()
            raise RuntimeError("the deletion is rolled back")

    with pytest.raises(RuntimeError):
        delete_then_roll_back()
    kept = pay(client, "kept", 10)
    User.objects.get(username="kept").delete()
    after = IdempotencyRecord.objects.using("store").count()

    assert kept["Idempotent-Replayed"] == "true"
    assert effects() == 1
    assert after == 0  # committed, the deletion takes the records


@pytest.mark.database_store("the Redis store's keys are digests: an account's are not found")
@pytest.mark.parametrize(
    "idempotency",
    [
        pytest.param({}, id="not-namespaced"),
        pytest.param(
            {"NAMESPACE_PRINCIPALS": True, "ACCOUNT": "tests.test_scopes.own_account"},
            id="own-account",
        ),
    ],
)
def test_where_a_bare_pk_may_not_be_a_user_deleting_one_keeps_every_record(
    client: Client, settings: Any, idempotency: dict[str, Any]
) -> None:
    """Without namespaces merchant 7 shares user 7's account, and a project's own ACCOUNT
    may name anything "7": deleting user 7 there must not let their retries run again."""
    settings.IDEMPOTENCY = idempotency
    user = UserFactory(username="someone")
    assert pay(client, "someone", 10).status_code == 201

    user.delete()

    assert len(records.all()) == 1


def own_account(request: Any) -> str | None:
    return keys.default_account(request)


def test_forget_account_deletes_an_accounts_records_but_tasks(alice: User, client: Client) -> None:
    if ON_REDIS:
        pytest.skip("the Redis store's keys are digests: an account's are not found")
    assert pay(client, "alice", 10).status_code == 201
    assert pay(client, "alice", 10, key="pay-2").status_code == 201
    with claim_once(str(alice.pk), "k") as run:
        run.result = "done"

    assert accounts.forget_account(str(alice.pk)) == 2
    assert [r.endpoint for r in records.all()] == ["task"]
    assert pay(client, "alice", 10).status_code == 201  # runs again: the record is gone
    assert effects() == 3


# -- tenants --------------------------------------------------------------------------------


def pay_in(client: Client, amount: int, host: str = "testserver", **headers: str) -> Any:
    return client.post(
        "/payments/",
        data=json.dumps({"amount": amount}),
        content_type=JSON,
        headers={"Idempotency-Key": "invoice-1", "X-User": "alice", **headers},
        HTTP_HOST=host,
    )


@pytest.fixture
def tenant_hosts(settings: Any) -> None:
    settings.ALLOWED_HOSTS = [".example.com"]


def test_a_user_in_two_tenants_by_host_gets_one_run_in_each(
    alice: User, client: Client, settings: Any, tenant_hosts: None
) -> None:
    settings.IDEMPOTENCY = {"TENANT": "idempotency_django.keys.request_host"}

    in_a = pay_in(client, 10, host="a.example.com")
    in_b = pay_in(client, 10, host="B.Example.com:8443")
    retry_in_a = pay_in(client, 10, host="a.example.com:443")

    assert in_a.status_code == in_b.status_code == 201
    assert "Idempotent-Replayed" not in in_b
    assert in_b.json()["host"] == "B.Example.com:8443"
    assert retry_in_a["Idempotent-Replayed"] == "true"
    assert retry_in_a.json() == in_a.json()
    assert effects() == 2
    assert sorted(r.endpoint for r in records.all()) == [
        "tenant:a.example.com POST /payments/",
        "tenant:b.example.com POST /payments/",
    ]


def test_a_user_in_two_tenants_by_header_gets_one_run_in_each(
    alice: User, client: Client, settings: Any
) -> None:
    settings.IDEMPOTENCY = {"TENANT": keys.tenant_header("X-Org")}

    in_a = pay_in(client, 10, **{"X-Org": "acme"})
    in_b = pay_in(client, 10, **{"X-Org": "globex inc"})
    retry_in_b = pay_in(client, 10, **{"X-Org": "globex inc"})
    untenanted = pay_in(client, 10)

    assert in_a.status_code == in_b.status_code == untenanted.status_code == 201
    assert retry_in_b["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in untenanted
    assert effects() == 3
    assert sorted(r.endpoint for r in records.all()) == [
        "POST /payments/",
        "tenant:acme POST /payments/",
        "tenant:globex%20inc POST /payments/",
    ]


def test_the_drf_mixin_puts_the_tenant_into_its_scope_too(
    alice: User, client: Client, settings: Any
) -> None:
    settings.IDEMPOTENCY = {"TENANT": keys.tenant_header("X-Org")}

    in_a = refund(client, {"X-User": "alice", "X-Org": "acme"})
    in_b = refund(client, {"X-User": "alice", "X-Org": "globex"})
    retry_in_a = refund(client, {"X-User": "alice", "X-Org": "acme"})

    assert in_a.status_code == in_b.status_code == 201
    assert "Idempotent-Replayed" not in in_b
    assert retry_in_a["Idempotent-Replayed"] == "true"
    assert effects() == 2


def test_a_disallowed_host_is_refused_before_any_claim(
    alice: User, client: Client, settings: Any
) -> None:
    settings.IDEMPOTENCY = {"TENANT": "idempotency_django.keys.request_host"}
    settings.ALLOWED_HOSTS = ["a.example.com"]

    response = pay_in(client, 10, host="evil.example.org")

    assert response.status_code == 400
    assert effects() == 0
    assert records.all() == []


def test_tenant_endpoints_never_meet() -> None:
    assert keys.tenant_endpoint("POST /x", None) == "POST /x"
    assert keys.tenant_endpoint("POST /x", "") == "POST /x"
    assert keys.tenant_endpoint("POST /x", 7) == "tenant:7 POST /x"
    # A tenant holding a space cannot pass for another tenant's endpoint.
    assert keys.tenant_endpoint("POST /x", "a POST") != keys.tenant_endpoint("POST POST /x", "a")


def test_downstream_keys_outside_a_protected_view_are_per_tenant(
    alice: User, settings: Any
) -> None:
    settings.IDEMPOTENCY = {"TENANT": keys.tenant_header("X-Org")}
    factory = RequestFactory()

    def derived(org: str) -> str:
        request = factory.post("/pay/", headers={"Idempotency-Key": "k1", "X-Org": org})
        request.user = alice
        return downstream_key_for(request, "charge")

    assert derived("acme") != derived("globex")
    assert derived("acme") == downstream_key(
        "k1", "charge", str(alice.pk), endpoint="tenant:acme POST /pay/"
    )


@pytest.mark.parametrize(
    ("changes", "sign"),
    [
        pytest.param({"INSTALLED_APPS": ["django_tenants"]}, "django_tenants", id="app"),
        pytest.param({"MIDDLEWARE": ["app.middleware.TenantMiddleware"]}, "Tenant", id="mw"),
        pytest.param({"ALLOWED_HOSTS": [".example.com"]}, "'.example.com'", id="subdomains"),
    ],
)
def test_w030_a_project_that_looks_multi_tenant(
    settings: Any, monkeypatch: pytest.MonkeyPatch, changes: dict[str, list[str]], sign: str
) -> None:
    from django.conf import settings as django_settings

    for name, values in changes.items():  # not installed: the check reads the setting only
        monkeypatch.setattr(django_settings, name, [*getattr(django_settings, name), *values])

    warned = [m for m in check_settings() if m.id == "idempotency_django.W030"]

    assert len(warned) == 1
    assert sign in warned[0].msg
    settings.IDEMPOTENCY = {"TENANT": "idempotency_django.keys.request_host"}
    assert [m for m in check_settings() if m.id == "idempotency_django.W030"] == []


def test_w030_not_for_a_project_that_does_not_look_multi_tenant() -> None:
    assert [m for m in check_settings() if m.id == "idempotency_django.W030"] == []


def test_e009_a_tenant_that_cannot_be_imported(settings: Any) -> None:
    settings.IDEMPOTENCY = {"TENANT": "nowhere.tenant"}

    assert [m.id for m in check_settings() if "TENANT" in m.msg] == ["idempotency_django.E009"]


@pytest.mark.django_db(transaction=True, databases="__all__")  # Django 6.1 checks every database
def test_e030_namespace_principals_not_a_bool(settings: Any) -> None:
    settings.IDEMPOTENCY = {"NAMESPACE_PRINCIPALS": "yes"}

    assert [m.id for m in check_settings() if m.id == "idempotency_django.E030"] == [
        "idempotency_django.E030"
    ]
    with pytest.raises(Exception, match="E030"):
        call_command("check")


# -- guests ---------------------------------------------------------------------------------


def checkout(client: Client, **headers: str) -> Any:
    return client.post(
        "/guest-checkout/",
        data=json.dumps({"amount": 10}),
        content_type=JSON,
        headers={"Idempotency-Key": "order-1042", **headers},
    )


def test_a_guests_downstream_key_needs_an_account_the_guest_holds(
    client: Client, settings: Any
) -> None:
    """Two guests who send ``order-1042`` would get one downstream key: the provider would
    refuse one, or replay it the other's payment. Without an account it is refused (403)."""
    settings.IDEMPOTENCY = {"ANONYMOUS": "bypass"}

    first_guest = checkout(client)
    second_guest = checkout(client)

    assert first_guest.status_code == second_guest.status_code == 403


def test_guests_with_their_own_token_get_downstream_keys_of_their_own(
    client: Client, settings: Any
) -> None:
    settings.IDEMPOTENCY = {"ANONYMOUS": "bypass"}

    first_guest = checkout(client, **{"X-Guest-Token": "cart-a"})
    first_retry = checkout(client, **{"X-Guest-Token": "cart-a"})
    second_guest = checkout(client, **{"X-Guest-Token": "cart-b"})

    assert first_guest.status_code == second_guest.status_code == 201
    assert first_guest.json()["downstream_key"] == first_retry.json()["downstream_key"]
    assert first_guest.json()["downstream_key"] != second_guest.json()["downstream_key"]


def test_downstream_key_for_an_anonymous_request_is_refused_without_an_account() -> None:
    request = RequestFactory().post("/orders/", headers={"Idempotency-Key": "order-1042"})

    with pytest.raises(AnonymousNotAllowed, match="account="):
        downstream_key_for(request, "charge")
    assert downstream_key_for(request, "charge", account="guest:cart-a") == downstream_key(
        "order-1042", "charge", "guest:cart-a", endpoint="POST /orders/"
    )


# -- accounts that name nobody --------------------------------------------------------------


def nobody_empty(request: Any) -> str:
    return ""


def nobody_spaces(request: Any) -> str:
    return "  "


def nobody_none_text(request: Any) -> str:
    return str(getattr(request, "missing_pk", None))


@pytest.mark.parametrize("account", [nobody_empty, nobody_spaces, nobody_none_text])
def test_an_account_of_empty_or_none_text_is_refused_as_anonymous(
    alice: User, client: Client, settings: Any, account: Any
) -> None:
    settings.IDEMPOTENCY = {"ACCOUNT": account}

    response = pay(client, "alice", 10)

    assert response.status_code == 403
    assert response.json()["type"] == "urn:idempotency-django:problem:anonymous"
    assert effects() == 0
    assert records.all() == []


@pytest.mark.parametrize("account", [nobody_empty, nobody_none_text])
def test_with_anonymous_bypass_such_a_request_runs_unprotected_never_in_a_shared_account(
    alice: User, client: Client, settings: Any, account: Any
) -> None:
    settings.IDEMPOTENCY = {"ACCOUNT": account, "ANONYMOUS": "bypass"}

    first = pay(client, "alice", 10)
    second = pay(client, "alice", 10)

    assert first.status_code == second.status_code == 201
    assert "Idempotent-Replayed" not in second
    assert records.all() == []
