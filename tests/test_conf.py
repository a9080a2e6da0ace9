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
    assert conf.REQUIRED is True
    assert sorted(conf.METHODS) == ["PATCH", "POST"]
    assert conf.MODE == "commit"
    assert conf.IN_FLIGHT == "conflict"
    assert conf.WAIT_SECONDS == 10.0
    assert conf.RETRY_AFTER_SECONDS == 1
    assert conf.LEASE_SECONDS == 10.0
    assert conf.MAX_RUN_SECONDS == 300.0
    assert conf.TTL_SECONDS == 24 * 60 * 60
    assert conf.ACCOUNT is keys.default_account
    assert conf.ANONYMOUS == "reject"
    assert conf.ENDPOINT is keys.default_endpoint
    assert conf.FINGERPRINT is keys.default_fingerprint
    assert conf.STORE_STATUSES is responses.is_definitive
    assert conf.STORED_HEADERS == ()
    assert conf.MAX_RESPONSE_BYTES == 1024 * 1024
    assert conf.DATABASE is None
    assert conf.ON_STORE_ERROR == "closed"
    assert conf.REPLAY_HEADER == "Idempotent-Replayed"
    assert conf.PROBLEM_TYPE_BASE == "urn:idempotency-django:problem:"


def test_every_default_has_a_property(default_settings: Settings) -> None:
    for name in DEFAULTS:
        assert hasattr(type(conf), name)
        assert conf.get(name) == DEFAULTS[name]


def test_get_rejects_unknown_names() -> None:
    with pytest.raises(AttributeError):
        conf.get("NOT_A_SETTING")


def test_settings_fixture_changes_are_seen_at_access_time(settings: Settings) -> None:
    settings.IDEMPOTENCY = {"MODE": "atomic"}
    assert conf.MODE == "atomic"
    settings.IDEMPOTENCY = {"MODE": "commit", "TTL_SECONDS": 60}
    assert conf.MODE == "commit"
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
    assert conf.IN_FLIGHT == "conflict"
    assert conf.LEASE_SECONDS == 10.0


def test_values_are_coerced_to_their_types(settings: Settings) -> None:
    settings.IDEMPOTENCY = {
        "METHODS": ["post", "Put"],
        "WAIT_SECONDS": 2,
        "RETRY_AFTER_SECONDS": 3.0,
        "STORED_HEADERS": ["X-Request-Id"],
        "DATABASE": "default",
    }
    assert sorted(conf.METHODS) == ["POST", "PUT"]
    assert conf.WAIT_SECONDS == 2.0
    assert isinstance(conf.WAIT_SECONDS, float)
    assert conf.RETRY_AFTER_SECONDS == 3
    assert isinstance(conf.RETRY_AFTER_SECONDS, int)
    assert conf.STORED_HEADERS == ("X-Request-Id",)
    assert conf.DATABASE == "default"


def test_dotted_paths_resolve(settings: Settings) -> None:
    settings.IDEMPOTENCY = {
        "ACCOUNT": "tests.test_conf.custom_account",
        "ENDPOINT": "tests.test_conf.custom_endpoint",
        "STORE_STATUSES": "idempotency_django.responses.is_definitive",
    }
    assert conf.ACCOUNT is custom_account
    assert conf.ENDPOINT is custom_endpoint
    assert conf.STORE_STATUSES is responses.is_definitive


def test_callables_are_used_as_given(settings: Settings) -> None:
    def fingerprint(request: HttpRequest, endpoint: str) -> str:
        return "f"

    settings.IDEMPOTENCY = {"ACCOUNT": custom_account, "FINGERPRINT": fingerprint}
    assert conf.ACCOUNT is custom_account
    assert conf.FINGERPRINT is fingerprint


@pytest.mark.parametrize("name", ["ACCOUNT", "ENDPOINT", "FINGERPRINT", "STORE_STATUSES"])
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
    predicate = conf.STORE_STATUSES
    assert predicate(500) is True
    assert predicate(404) is False


@pytest.mark.parametrize("value", [["MODE", "atomic"], "MODE=atomic", ("MODE",), None])
def test_non_dict_setting_raises_improperly_configured(settings: Settings, value: object) -> None:
    settings.IDEMPOTENCY = value
    with pytest.raises(ImproperlyConfigured, match="IDEMPOTENCY"):
        conf.MODE  # noqa: B018
    with pytest.raises(ImproperlyConfigured):
        conf.raw()
