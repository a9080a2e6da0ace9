from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse
from django.test import override_settings

from idempotency_django.conf import DEFAULTS, conf, resolve_callable, status_predicate
from idempotency_django.core import keys, responses
from idempotency_django.decorators import idempotent
from tests import records
from tests.conftest import Post, effects

if TYPE_CHECKING:
    from pytest_django import Settings


def custom_account(request: HttpRequest) -> str:
    return "tenant-1"


def custom_endpoint(request: HttpRequest) -> str:
    return "orders"


NOT_CALLABLE = 42


@pytest.fixture(params=["absent", "empty"])
def default_settings(request: pytest.FixtureRequest, settings: Settings) -> Settings:
    if request.param == "absent":
        del settings.IDEMPOTENCY
    else:
        settings.IDEMPOTENCY = {}
    return settings


def test_defaults(default_settings: Settings) -> None:
    assert conf.ENABLED is True
    assert conf.HEADER == "Idempotency-Key"
    assert conf.get("REQUIRED") is True
    assert sorted(conf.get("METHODS")) == ["PATCH", "POST"]
    assert conf.get("MODE") == "commit"
    assert conf.get("IN_FLIGHT") == "conflict"
    assert conf.get("WAIT_SECONDS") == 10.0
    assert conf.RETRY_AFTER_SECONDS == 1
    assert conf.get("LEASE_SECONDS") == 10.0
    assert conf.MAX_RUN_SECONDS == 300.0
    assert conf.TTL_SECONDS == 24 * 60 * 60
    assert conf.ACCOUNT is keys.default_account
    assert conf.ANONYMOUS == "reject"
    assert conf.ENDPOINT is keys.default_endpoint
    assert resolve_callable(conf.get("FINGERPRINT"), "FINGERPRINT") is keys.default_fingerprint
    assert status_predicate(conf.get("STORE_STATUSES")) is responses.is_definitive
    assert conf.STORED_HEADERS == ()
    assert conf.MAX_RESPONSE_BYTES == 64 * 1024
    assert conf.MAX_WAITERS == 8
    assert conf.get("MAX_IN_FLIGHT_PER_ACCOUNT") is None
    assert conf.DATABASE is None
    assert conf.get("ON_STORE_ERROR") == "closed"
    assert conf.REPLAY_HEADER == "Idempotent-Replayed"
    assert conf.PROBLEM_TYPE_BASE == "urn:idempotency-django:problem:"


def test_every_default_is_readable(default_settings: Settings) -> None:
    for name in DEFAULTS:
        assert conf.get(name) == DEFAULTS[name]


def test_get_rejects_unknown_names() -> None:
    with pytest.raises(AttributeError):
        conf.get("NOT_A_SETTING")


def test_settings_fixture_changes_are_seen_at_access_time(settings: Settings) -> None:
    settings.IDEMPOTENCY = {"MODE": "atomic"}
    assert conf.get("MODE") == "atomic"
    settings.IDEMPOTENCY = {"MODE": "commit", "TTL_SECONDS": 60}
    assert conf.get("MODE") == "commit"
    assert conf.TTL_SECONDS == 60.0


def test_override_settings_is_seen_and_undone(settings: Settings) -> None:
    settings.IDEMPOTENCY = {}
    assert conf.HEADER == "Idempotency-Key"
    with override_settings(IDEMPOTENCY={"HEADER": "X-Request-Key", "ENABLED": False}):
        assert conf.HEADER == "X-Request-Key"
        assert conf.ENABLED is False
    assert conf.HEADER == "Idempotency-Key"
    assert conf.ENABLED is True


def test_unset_keys_keep_their_defaults(settings: Settings) -> None:
    settings.IDEMPOTENCY = {"MODE": "atomic"}
    assert conf.get("IN_FLIGHT") == "conflict"
    assert conf.get("LEASE_SECONDS") == 10.0


def test_values_are_coerced_to_their_types(settings: Settings) -> None:
    settings.IDEMPOTENCY = {
        "RETRY_AFTER_SECONDS": 3.0,
        "STORED_HEADERS": ["X-Request-Id"],
        "DATABASE": "default",
    }
    assert conf.RETRY_AFTER_SECONDS == 3
    assert isinstance(conf.RETRY_AFTER_SECONDS, int)
    assert conf.STORED_HEADERS == ("X-Request-Id",)
    assert conf.DATABASE == "default"


def test_dotted_paths_resolve(settings: Settings) -> None:
    settings.IDEMPOTENCY = {
        "ACCOUNT": "tests.test_conf.custom_account",
        "ENDPOINT": "tests.test_conf.custom_endpoint",
    }
    assert conf.ACCOUNT is custom_account
    assert conf.ENDPOINT is custom_endpoint


def test_callables_are_used_as_given(settings: Settings) -> None:
    def fingerprint(request: HttpRequest, endpoint: str) -> str:
        return "f"

    settings.IDEMPOTENCY = {"ACCOUNT": custom_account, "FINGERPRINT": fingerprint}
    assert conf.ACCOUNT is custom_account
    assert resolve_callable(conf.get("FINGERPRINT"), "FINGERPRINT") is fingerprint


@pytest.mark.parametrize("name", ["ACCOUNT", "ENDPOINT"])
@pytest.mark.parametrize(
    "path", ["tests.test_conf.does_not_exist", "no_such_module.func", "nodots"]
)
def test_bad_dotted_path_names_the_path_and_setting(
    settings: Settings, name: str, path: str
) -> None:
    settings.IDEMPOTENCY = {name: path}
    with pytest.raises(ImproperlyConfigured) as excinfo:
        getattr(conf, name)
    assert path in str(excinfo.value)
    assert name in str(excinfo.value)


@pytest.mark.parametrize(
    "value", [NOT_CALLABLE, "tests.test_conf.NOT_CALLABLE"], ids=["value", "dotted-path"]
)
def test_non_callable_raises_improperly_configured(settings: Settings, value: object) -> None:
    settings.IDEMPOTENCY = {"ACCOUNT": value}
    with pytest.raises(ImproperlyConfigured) as excinfo:
        conf.ACCOUNT  # noqa: B018
    assert "ACCOUNT" in str(excinfo.value)
    assert "42" in str(excinfo.value)


def test_resolve_callable_names_the_given_name() -> None:
    with pytest.raises(ImproperlyConfigured, match=r"fingerprint.*no_such_module"):
        resolve_callable("no_such_module.func", "fingerprint")


@pytest.mark.parametrize(
    "codes", [[200, 201], (200, 201), {200, 201}, frozenset({200, 201}), range(200, 202)]
)
def test_status_predicate_accepts_an_iterable_of_codes(codes: object) -> None:
    predicate = status_predicate(codes)
    assert predicate(200) is True
    assert predicate(201) is True
    assert predicate(202) is False
    assert predicate(500) is False


def test_status_predicate_accepts_code_strings() -> None:
    predicate = status_predicate(["200", "422"])
    assert predicate(422) is True
    assert predicate(400) is False


def test_status_predicate_accepts_a_callable_and_a_dotted_path() -> None:
    def only_created(status: int) -> bool:
        return status == 201

    assert status_predicate(only_created) is only_created
    assert status_predicate("idempotency_django.responses.is_definitive") is (
        responses.is_definitive
    )


def test_store_statuses_setting_accepts_an_iterable_of_codes(settings: Settings) -> None:
    settings.IDEMPOTENCY = {"STORE_STATUSES": [200, 201, 500]}
    predicate = status_predicate(conf.get("STORE_STATUSES"))
    assert predicate(500) is True
    assert predicate(404) is False


@pytest.mark.parametrize("value", [["MODE", "atomic"], "MODE=atomic", ("MODE",), None])
def test_non_dict_setting_raises_improperly_configured(settings: Settings, value: object) -> None:
    settings.IDEMPOTENCY = value
    with pytest.raises(ImproperlyConfigured, match="IDEMPOTENCY"):
        conf.get("MODE")
    with pytest.raises(ImproperlyConfigured):
        conf.raw()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("LEASE_SECONDS", 0.5),
        ("LEASE_SECONDS", -1),
        ("WAIT_SECONDS", float("nan")),
        ("TTL_SECONDS", "1d"),
        ("MODE", "fast"),
        ("REQUIRED", "yes"),
        ("METHODS", "POST"),
    ],
)
def test_check_argument_names_the_view_and_the_argument(name: str, value: object) -> None:
    from idempotency_django.conf import check_argument

    with pytest.raises(ImproperlyConfigured) as raised:
        check_argument(name, value, "@idempotent on charge")
    assert "@idempotent on charge" in str(raised.value)
    assert name.lower() in str(raised.value)


@pytest.mark.parametrize(
    ("name", "value"),
    [("LEASE_SECONDS", 1), ("TTL_SECONDS", None), ("MODE", "atomic"), ("METHODS", ["PUT"])],
)
def test_check_argument_accepts_what_the_setting_accepts(name: str, value: object) -> None:
    from idempotency_django.conf import check_argument

    check_argument(name, value, "@idempotent on charge")


# -- settings that would switch protection off without a word -------------


@pytest.mark.parametrize("value", ["no", "false", 0, None, ""])
def test_only_false_turns_protection_off(settings: Settings, value: object) -> None:
    settings.IDEMPOTENCY = {"ENABLED": value}
    assert conf.ENABLED is True
    settings.IDEMPOTENCY = {"ENABLED": False}
    assert conf.ENABLED is False


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("value", [0, None, ""])
def test_a_falsy_non_bool_enabled_keeps_the_view_protected(
    settings: Settings, alice: User, post: Post, value: object
) -> None:
    """E014 reports it; until it is fixed a retry is still a replay, never a second run."""
    settings.IDEMPOTENCY = {"ENABLED": value}
    post("/effect/", {})
    retry = post("/effect/", {})

    assert retry["Idempotent-Replayed"] == "true"
    assert effects() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("value", [0, None, ""])
def test_a_falsy_non_bool_required_still_requires_a_key(
    settings: Settings, alice: User, post: Post, value: object
) -> None:
    settings.IDEMPOTENCY = {"REQUIRED": value}
    response = post("/effect/", {}, key=None)

    assert response.status_code == 400
    assert effects() == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("header", ["Idempotency Key", "Idempotency_Key"])
def test_a_header_no_request_can_carry_fails_before_the_view_runs(
    settings: Settings, alice: User, post: Post, header: str
) -> None:
    """Not a keyless request run unprotected (REQUIRED=False) or a 400 blaming the client:
    the view does not run, and the error names the setting (E015 reports it at startup)."""
    settings.IDEMPOTENCY = {"HEADER": header, "REQUIRED": False}
    with pytest.raises(ImproperlyConfigured, match=re.escape(f"HEADER={header!r}")):
        post("/effect/", {}, HTTP_IDEMPOTENCY_KEY="k1")

    assert effects() == 0


@pytest.mark.parametrize(
    ("codes", "named"), [([200, 999], "999"), (["abc"], "'abc'"), ([True], "True")]
)
def test_status_predicate_names_what_is_not_a_status_code(codes: object, named: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=rf"STORE_STATUSES holds {re.escape(named)}"):
        status_predicate(codes)


def test_a_views_store_statuses_that_are_not_codes_are_refused_naming_the_view() -> None:
    with pytest.raises(ImproperlyConfigured, match=r"@idempotent on .*\.view: .*999"):

        @idempotent(store_statuses=[201, 999])
        def view(request: HttpRequest) -> HttpResponse:
            return HttpResponse()


@pytest.mark.parametrize("methods", [["GETT"], ["POST", "PSOT"]])
def test_a_views_unknown_method_is_refused_naming_the_view(methods: list[str]) -> None:
    with pytest.raises(ImproperlyConfigured, match=rf"@idempotent on .*\.view: .*{methods[-1]!r}"):

        @idempotent(methods=methods)
        def view(request: HttpRequest) -> HttpResponse:
            return HttpResponse()


def test_a_views_methods_in_any_case_are_accepted() -> None:
    @idempotent(methods=["post", "Put"])
    def view(request: HttpRequest) -> HttpResponse:
        return HttpResponse()


# -- a view's durations against each other and the settings (E005, E006 per view) -----------


@pytest.mark.parametrize(
    ("setting", "arguments", "message"),
    [
        ({}, {"ttl_seconds": 5}, r"ttl_seconds=5 is shorter than LEASE_SECONDS \(10\.0\)"),
        (
            {"TTL_SECONDS": 20, "MAX_RUN_SECONDS": 60},
            {"lease_seconds": 30},
            r"TTL_SECONDS \(20\) is shorter than lease_seconds=30",
        ),
        ({}, {"ttl_seconds": 5, "lease_seconds": 6}, "ttl_seconds=5 is shorter than lease"),
        ({}, {"max_run_seconds": 5}, "max_run_seconds=5 is shorter than LEASE_SECONDS"),
        ({}, {"lease_seconds": 400}, r"MAX_RUN_SECONDS \(300\.0\) is shorter than lease"),
    ],
)
def test_a_views_ttl_or_max_run_below_its_lease_is_refused_naming_the_view(
    settings: Settings, setting: dict[str, Any], arguments: dict[str, Any], message: str
) -> None:
    settings.IDEMPOTENCY = setting
    with pytest.raises(ImproperlyConfigured, match=message) as raised:

        @idempotent(**arguments)
        def charge(request: HttpRequest) -> HttpResponse:
            return HttpResponse()

    assert "@idempotent on " in str(raised.value)
    assert "charge" in str(raised.value)


@pytest.mark.parametrize(
    "arguments",
    [
        {"ttl_seconds": 10},
        {"ttl_seconds": 5, "lease_seconds": 5},
        {"ttl_seconds": None},
        {"lease_seconds": 2, "max_run_seconds": 2},
        {"max_run_seconds": 10},
    ],
)
def test_a_views_durations_that_fit_are_accepted(arguments: dict[str, Any]) -> None:
    @idempotent(**arguments)
    def charge(request: HttpRequest) -> HttpResponse:
        return HttpResponse()


@pytest.mark.parametrize(
    "setting", ["oops", {"LEASE_SECONDS": "10"}, {"LEASE_SECONDS": -1, "MAX_RUN_SECONDS": "x"}]
)
def test_a_bad_setting_is_left_to_the_checks_when_a_view_is_decorated(
    settings: Settings, setting: object
) -> None:
    """Decorating happens on import; an invalid setting must not fail there, or
    ``manage.py check`` could not report it (E001, E003)."""
    settings.IDEMPOTENCY = setting

    @idempotent(ttl_seconds=5)
    def charge(request: HttpRequest) -> HttpResponse:
        return HttpResponse()


def test_a_drf_views_ttl_below_the_lease_is_refused_at_class_creation() -> None:
    from rest_framework.views import APIView

    from idempotency_django.drf import IdempotentMixin

    with pytest.raises(ImproperlyConfigured, match=r"ShortTTL \(IdempotentMixin\): ttl_seconds=5"):

        class ShortTTL(IdempotentMixin, APIView):
            idempotency_ttl_seconds = 5


def test_a_ninja_operations_ttl_below_the_lease_is_refused_naming_it() -> None:
    from idempotency_django.ninja import idempotent as ninja_idempotent

    with pytest.raises(ImproperlyConfigured, match=r"ninja @idempotent on .*create.*ttl_seconds"):

        @ninja_idempotent(ttl_seconds=5)
        def create(request: HttpRequest) -> dict[str, int]:
            return {}


def test_a_tasks_ttl_below_the_lease_is_refused_naming_it() -> None:
    from idempotency_django.tasks import idempotent_task

    with pytest.raises(ImproperlyConfigured, match=r"Task 'receipt': ttl_seconds=5"):
        idempotent_task(scope="s", key="message_id", name="receipt", ttl_seconds=5)


# -- a bad setting met by a request: refused before the claim, never after the work ---------

REFUSED_AT_REQUEST_TIME = [
    # Read by the capture, after the view: the failure released the key, and the retry
    # ran the view a second time.
    {"STORED_HEADERS": 5},
    {"MAX_RESPONSE_BYTES": "1MB"},
    # An unknown ON_DISCONNECT acted as "release"; a 0.1 s lease cannot be renewed in time.
    {"ON_DISCONNECT": "finsh"},
    {"LEASE_SECONDS": 0.1},
    {"MODE": "atomc"},
    {"IN_FLIGHT": "wiat"},
    {"ON_STORE_ERROR": "opne"},
    {"RETRY_AFTER_SECONDS": "1"},
    {"TTL_SECONDS": "1d"},
    # Protected nothing: every POST ran unprotected.
    {"METHODS": ["GETT"]},
]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", ["/effect/", "/async/"])
@pytest.mark.parametrize("setting", REFUSED_AT_REQUEST_TIME, ids=lambda setting: str(setting))
def test_a_setting_its_check_refuses_fails_the_request_before_the_view_runs(
    settings: Settings, alice: User, post: Post, path: str, setting: dict[str, Any]
) -> None:
    settings.IDEMPOTENCY = setting
    (name,) = setting
    for _attempt in range(2):
        with pytest.raises(ImproperlyConfigured, match=re.escape(f"IDEMPOTENCY[{name!r}]")):
            post(path, {})

    assert effects() == 0
    assert not records.exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.urls("tests.project.middleware_urls")
def test_the_middleware_refuses_a_methods_setting_that_protects_nothing(
    settings: Settings, alice: User, post: Post
) -> None:
    settings.MIDDLEWARE = [
        *settings.MIDDLEWARE,
        "idempotency_django.middleware.IdempotencyMiddleware",
    ]
    settings.IDEMPOTENCY = {"METHODS": ["GETT"]}
    with pytest.raises(ImproperlyConfigured, match=r"IDEMPOTENCY\['METHODS'\].*'GETT'"):
        post("/mw/plain/", {"amount": 1})

    assert effects() == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "setting", [{"MAX_RESPONSE_BYTES": "1MB"}, {"ON_STORE_ERROR": "opne"}, {"LEASE_SECONDS": 0.1}]
)
def test_a_task_fails_before_its_work_on_a_setting_its_check_refuses(
    settings: Settings, setting: dict[str, Any]
) -> None:
    from idempotency_django.tasks import claim_once

    settings.IDEMPOTENCY = setting
    ran = []
    with pytest.raises(ImproperlyConfigured), claim_once("receipts", "msg-1"):
        ran.append(1)

    assert ran == []
    assert not records.exists()
