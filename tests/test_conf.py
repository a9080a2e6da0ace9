from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest
from django.test import override_settings

from idempotency_django import keys, responses
from idempotency_django.conf import DEFAULTS, conf, resolve_callable, status_predicate

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
    assert conf.MAX_RESPONSE_BYTES == 1024 * 1024
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
