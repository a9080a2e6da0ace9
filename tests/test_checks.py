from __future__ import annotations

from io import StringIO
from typing import TYPE_CHECKING, Any

import pytest
from django.core import checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from idempotency_django.checks import check_settings

if TYPE_CHECKING:
    from pytest_django import Settings

NOT_CALLABLE = "not a function"


def ids_for(settings: Settings, value: Any) -> list[str]:
    settings.IDEMPOTENCY = value
    return [message.id or "" for message in check_settings()]


def test_default_settings_produce_no_messages(settings: Settings) -> None:
    del settings.IDEMPOTENCY
    assert check_settings() == []


def test_empty_setting_produces_no_messages(settings: Settings) -> None:
    settings.IDEMPOTENCY = {}
    assert check_settings() == []


def test_a_valid_full_setting_produces_no_messages(settings: Settings) -> None:
    settings.IDEMPOTENCY = {
        "ENABLED": False,
        "MODE": "atomic",
        "IN_FLIGHT": "wait",
        "ANONYMOUS": "bypass",
        "ON_STORE_ERROR": "open",
        "WAIT_SECONDS": 0,
        "LEASE_SECONDS": 1,
        "TTL_SECONDS": 60,
        "MAX_RUN_SECONDS": 1.5,
        "ACCOUNT": "idempotency_django.keys.default_account",
        "STORE_STATUSES": [200, 201],
        "STORED_HEADERS": ["X-Request-Id"],
        "DATABASE": "default",
    }
    assert check_settings() == []


def test_every_message_has_an_id_and_a_hint(settings: Settings) -> None:
    settings.IDEMPOTENCY = {
        "NOPE": 1,
        "MODE": "x",
        "WAIT_SECONDS": -1,
        "LEASE_SECONDS": 0.5,
        "STORED_HEADERS": ["Set-Cookie"],
        "DATABASE": "nope",
        "ACCOUNT": "no.such.path",
    }
    messages = check_settings()
    assert len(messages) >= 7
    for message in messages:
        assert (message.id or "").startswith("idempotency_django.")
        assert message.hint


@pytest.mark.parametrize("value", [[], "MODE=atomic", None, ("MODE", "atomic")])
def test_e001_setting_is_not_a_dict(settings: Settings, value: object) -> None:
    settings.IDEMPOTENCY = value
    messages = check_settings()
    assert [message.id for message in messages] == ["idempotency_django.E001"]
    assert messages[0].level == checks.ERROR


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MODE", "transactional"),
        ("IN_FLIGHT", "block"),
        ("ANONYMOUS", "allow"),
        ("ON_STORE_ERROR", "ignore"),
        ("MODE", None),
    ],
)
def test_e002_unknown_choice(settings: Settings, name: str, value: object) -> None:
    settings.IDEMPOTENCY = {name: value}
    messages = check_settings()
    assert [message.id for message in messages] == ["idempotency_django.E002"]
    assert name in messages[0].msg


@pytest.mark.parametrize(
    "name",
    [
        "WAIT_SECONDS",
        "RETRY_AFTER_SECONDS",
        "LEASE_SECONDS",
        "MAX_RUN_SECONDS",
        "TTL_SECONDS",
        "MAX_RESPONSE_BYTES",
    ],
)
@pytest.mark.parametrize("value", [-1, "10", True, None])
def test_e003_not_a_number_of_zero_or_more(settings: Settings, name: str, value: object) -> None:
    if name == "TTL_SECONDS" and value is None:
        pytest.skip("TTL_SECONDS = None means 'keep forever' (W003)")
    ids = ids_for(settings, {name: value})
    assert ids == ["idempotency_django.E003"]


def test_e003_zero_is_allowed_where_no_other_check_applies(settings: Settings) -> None:
    assert ids_for(settings, {"WAIT_SECONDS": 0, "MAX_RESPONSE_BYTES": 0}) == []


@pytest.mark.parametrize("lease", [0, 0.5, 0.99])
def test_e004_lease_shorter_than_a_second(settings: Settings, lease: float) -> None:
    assert "idempotency_django.E004" in ids_for(settings, {"LEASE_SECONDS": lease})


def test_e004_not_for_a_one_second_lease(settings: Settings) -> None:
    assert "idempotency_django.E004" not in ids_for(settings, {"LEASE_SECONDS": 1})


def test_e005_ttl_shorter_than_lease(settings: Settings) -> None:
    ids = ids_for(settings, {"LEASE_SECONDS": 30, "TTL_SECONDS": 20, "MAX_RUN_SECONDS": 60})
    assert ids == ["idempotency_django.E005"]


def test_e006_max_run_shorter_than_lease(settings: Settings) -> None:
    ids = ids_for(settings, {"LEASE_SECONDS": 30, "MAX_RUN_SECONDS": 20})
    assert ids == ["idempotency_django.E006"]


def test_duration_checks_are_skipped_when_a_duration_is_not_a_number(settings: Settings) -> None:
    ids = ids_for(settings, {"LEASE_SECONDS": "30", "TTL_SECONDS": 1, "MAX_RUN_SECONDS": 1})
    assert ids == ["idempotency_django.E003"]


@pytest.mark.parametrize(
    "header", ["Set-Cookie", "set-cookie", "Authorization", "Cookie", "WWW-Authenticate"]
)
def test_e007_stored_headers_names_a_credential(settings: Settings, header: str) -> None:
    settings.IDEMPOTENCY = {"STORED_HEADERS": ("X-Request-Id", header)}
    messages = check_settings()
    assert [message.id for message in messages] == ["idempotency_django.E007"]
    assert header in messages[0].msg


def test_e008_database_is_not_an_alias(settings: Settings) -> None:
    assert ids_for(settings, {"DATABASE": "replica"}) == ["idempotency_django.E008"]


def test_e008_not_for_a_configured_alias(settings: Settings) -> None:
    assert ids_for(settings, {"DATABASE": "default"}) == []


@pytest.mark.parametrize("name", ["ACCOUNT", "ENDPOINT", "FINGERPRINT", "STORE_STATUSES"])
@pytest.mark.parametrize(
    "value",
    ["no_such_module.func", "idempotency_django.keys.no_such_function", "nodots", 42],
)
def test_e009_not_a_callable(settings: Settings, name: str, value: object) -> None:
    settings.IDEMPOTENCY = {name: value}
    messages = check_settings()
    assert [message.id for message in messages] == ["idempotency_django.E009"]
    assert name in str(messages[0].hint)


def test_e009_dotted_path_to_a_non_callable(settings: Settings) -> None:
    assert ids_for(settings, {"ACCOUNT": "tests.test_checks.NOT_CALLABLE"}) == [
        "idempotency_django.E009"
    ]


@pytest.mark.parametrize("value", [["200", "oops"], [None]])
def test_e009_store_statuses_with_a_bad_code(settings: Settings, value: object) -> None:
    assert ids_for(settings, {"STORE_STATUSES": value}) == ["idempotency_django.E009"]


def test_w001_unknown_key(settings: Settings) -> None:
    settings.IDEMPOTENCY = {"TTL": 60}
    messages = check_settings()
    assert [message.id for message in messages] == ["idempotency_django.W001"]
    assert messages[0].level == checks.WARNING
    assert "'TTL'" in messages[0].msg


def test_w001_once_per_unknown_key(settings: Settings) -> None:
    ids = ids_for(settings, {"TTL": 60, "LEASE": 5})
    assert ids == ["idempotency_django.W001", "idempotency_django.W001"]


def test_several_problems_are_all_reported(settings: Settings) -> None:
    ids = ids_for(settings, {"MODE": "x", "DATABASE": "nope", "ACCOUNT": 1, "EXTRA": 1})
    assert set(ids) == {
        "idempotency_django.W001",
        "idempotency_django.E002",
        "idempotency_django.E008",
        "idempotency_django.E009",
    }


@pytest.mark.parametrize("value", ["POST", 5])
def test_methods_that_are_not_a_list_of_method_names_are_reported(
    settings: Settings, value: object
) -> None:
    assert ids_for(settings, {"METHODS": value}) != []


@pytest.mark.parametrize("value", [5, (None,), "X-Request-Id"])
def test_stored_headers_that_are_not_a_list_of_names_are_reported(
    settings: Settings, value: object
) -> None:
    assert ids_for(settings, {"STORED_HEADERS": value}) != []


def test_check_command_fails_on_a_bad_setting(settings: Settings) -> None:
    settings.IDEMPOTENCY = {"MODE": "transactional"}
    with pytest.raises(SystemCheckError, match=r"idempotency_django\.E002"):
        call_command("check")


def test_check_command_passes_the_default_setting(settings: Settings) -> None:
    settings.IDEMPOTENCY = {}
    out = StringIO()
    call_command("check", tags=["idempotency_django"], stdout=out)
    assert "no issues" in out.getvalue()


def test_check_is_registered_under_its_tag() -> None:
    registered: list[object] = list(checks.registry.registry.get_checks())
    assert check_settings in registered
    assert checks.registry.registry.tag_exists("idempotency_django")


def test_w002_ttl_under_a_minute(settings: Settings) -> None:
    assert ids_for(settings, {"TTL_SECONDS": 30, "LEASE_SECONDS": 1}) == ["idempotency_django.W002"]


def test_w003_no_ttl_means_purge_finds_nothing(settings: Settings) -> None:
    assert ids_for(settings, {"TTL_SECONDS": None}) == ["idempotency_django.W003"]


def test_e011_idempotent_on_a_drf_view_method(settings: Any) -> None:
    from idempotency_django.checks import check_drf_views

    assert check_drf_views() == []  # the suite's own URLconf uses the mixin
    settings.ROOT_URLCONF = "tests.misuse_urls"
    errors = check_drf_views()

    assert [error.id for error in errors] == ["idempotency_django.E011"]
    assert "DecoratedAction.post" in errors[0].msg
    assert "IdempotentMixin" in (errors[0].hint or "")


def test_misspelled_drf_idempotency_configuration_is_an_error(settings: Any) -> None:
    """E020: a misspelled attribute or action on a routed DRF view protected nothing, and
    no request failed to say so."""
    from idempotency_django.checks import check_drf_view_attributes

    settings.ROOT_URLCONF = "tests.drf_typo_urls"
    errors = check_drf_view_attributes()

    assert {error.id for error in errors} == {"idempotency_django.E020"}
    messages = sorted(error.msg for error in errors)
    assert len(messages) == 3
    assert "PlainChargeViewSet has 'idempotency_mod'" in messages[0]
    assert "PlainChargeViewSet.idempotency_actions names 'craete'" in messages[1]
    assert "RefundViewSet.idempotency_actions names 'refnud'" in messages[2]
    assert not any("RightViewSet" in message for message in messages)


def test_the_check_command_reports_a_misspelled_action(settings: Any) -> None:
    settings.ROOT_URLCONF = "tests.drf_typo_urls"
    with pytest.raises(SystemCheckError, match=r"idempotency_django\.E020.*'craete'"):
        call_command("check")
