from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from io import StringIO
from typing import TYPE_CHECKING, Any

import pytest
from django.core import checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.urls import clear_url_caches

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


@pytest.mark.database_store("MODE atomic, which a check refuses with the Redis store")
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
        "MAX_WAITERS",
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


@pytest.mark.parametrize(
    "value", [[999], ["abc"], [200, 99], ["200", "oops"], [None], [True], [201.5]]
)
def test_e017_store_statuses_with_a_bad_code_names_it(settings: Settings, value: list[Any]) -> None:
    settings.IDEMPOTENCY = {"STORE_STATUSES": value}
    messages = check_settings()

    assert [message.id for message in messages] == ["idempotency_django.E017"]
    bad = [item for item in value if item not in (200, "200")]
    assert ", ".join(map(repr, bad)) in messages[0].msg
    assert "status code" in messages[0].msg


def test_e017_not_for_codes_as_numbers_or_strings(settings: Settings) -> None:
    assert ids_for(settings, {"STORE_STATUSES": [100, "201", 422, 599]}) == []


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


@pytest.mark.django_db(databases="__all__")  # Django 6.1 checks every database
def test_check_command_fails_on_a_bad_setting(settings: Settings) -> None:
    settings.IDEMPOTENCY = {"MODE": "transactional"}
    with pytest.raises(SystemCheckError, match=r"idempotency_django\.E002"):
        call_command("check")


@pytest.mark.django_db(databases="__all__")  # Django 6.1 checks every database
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
    settings.ROOT_URLCONF = "tests.project.misuse_urls"
    errors = check_drf_views()

    assert [error.id for error in errors] == ["idempotency_django.E011"]
    assert "DecoratedAction.post" in errors[0].msg
    assert "IdempotentMixin" in (errors[0].hint or "")


@pytest.mark.parametrize("name", ["ENABLED", "REQUIRED", "REQUIRE_BOUND_RESPONSES"])
@pytest.mark.parametrize("value", ["no", "false", "False", 0, 1, None, ""])
def test_e014_a_switch_that_is_not_a_bool(settings: Settings, name: str, value: object) -> None:
    settings.IDEMPOTENCY = {name: value}
    messages = check_settings()

    assert [message.id for message in messages] == ["idempotency_django.E014"]
    assert messages[0].level == checks.ERROR
    assert f"{name!r}] is {value!r}" in messages[0].msg


@pytest.mark.parametrize("name", ["HEADER", "REPLAY_HEADER"])
@pytest.mark.parametrize(
    "value", ["Idempotency Key", "Idempotency_Key", "Idempotency-Key:", "", "Clé", None, 5]
)
def test_e015_a_header_name_no_request_can_carry(
    settings: Settings, name: str, value: object
) -> None:
    settings.IDEMPOTENCY = {name: value}
    messages = check_settings()

    assert [message.id for message in messages] == ["idempotency_django.E015"]
    assert repr(value) in messages[0].msg


@pytest.mark.parametrize("value", ["X-Idempotency-Key", "idempotency-key", "Key.v2"])
def test_e015_not_for_a_valid_header_name(settings: Settings, value: str) -> None:
    assert ids_for(settings, {"HEADER": value, "REPLAY_HEADER": value}) == []


@pytest.mark.parametrize("methods", [["GETT"], ["POST", "PSOT"], ("PATCH", "")])
def test_e016_a_method_that_is_not_an_http_method(settings: Settings, methods: list[str]) -> None:
    settings.IDEMPOTENCY = {"METHODS": methods}
    messages = check_settings()

    assert [message.id for message in messages] == ["idempotency_django.E016"]
    assert repr(methods[-1]) in messages[0].msg


def test_e016_not_for_methods_in_any_case(settings: Settings) -> None:
    assert ids_for(settings, {"METHODS": ["post", "Patch", "PUT", "DELETE"]}) == []


@pytest.mark.parametrize("methods", [["GET", "POST"], ["post", "options"]])
def test_w005_a_safe_method(settings: Settings, methods: list[str]) -> None:
    settings.IDEMPOTENCY = {"METHODS": methods}
    messages = check_settings()

    assert [message.id for message in messages] == ["idempotency_django.W005"]
    assert messages[0].level == checks.WARNING


@pytest.mark.parametrize(
    ("name", "example"),
    [
        ("METHODS", '["POST", "PATCH"]'),
        ("STORED_HEADERS", '["X-Request-Id"]'),
        ("EXEMPT_URL_NAMES", '["admin:*", "login"]'),
    ],
)
def test_e010_hint_gives_an_example_of_the_setting_itself(
    settings: Settings, name: str, example: str
) -> None:
    settings.IDEMPOTENCY = {name: 5}
    (message,) = check_settings()

    assert message.id == "idempotency_django.E010"
    assert example in (message.hint or "")
    if name != "METHODS":
        assert "POST" not in (message.hint or "")


@pytest.fixture
def fresh_ninja_urlconf(settings: Any) -> Iterator[None]:
    """ROOT_URLCONF = tests.project.ninja_check_urls, imported (and its router built) anew by the
    check, as ``manage.py check`` imports it in a new process."""
    sys.modules.pop("tests.project.ninja_check_urls", None)
    settings.ROOT_URLCONF = "tests.project.ninja_check_urls"
    yield
    sys.modules.pop("tests.project.ninja_check_urls", None)
    clear_url_caches()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("oops", "idempotency_django.E001"),
        ({"METHODS": 5}, "idempotency_django.E010"),
        ({"METHODS": [5]}, "idempotency_django.E010"),
        ({"METHODS": ["GETT"]}, "idempotency_django.E016"),
        ({"TTL_SECONDS": 5}, "idempotency_django.E005"),
    ],
)
@pytest.mark.django_db(databases="__all__")  # Django 6.1 checks every database
def test_check_with_a_ninja_router_reports_a_bad_setting_instead_of_crashing(
    settings: Any, fresh_ninja_urlconf: None, value: object, expected: str
) -> None:
    settings.IDEMPOTENCY = value
    with pytest.raises(SystemCheckError, match=re.escape(expected)):
        call_command("check")


def test_a_router_built_under_a_bad_methods_setting_protects_the_default_methods(
    settings: Any, fresh_ninja_urlconf: None
) -> None:
    settings.IDEMPOTENCY = {"METHODS": 5}
    import tests.project.ninja_check_urls as urls

    operation = urls.router.path_operations["/charges/"].operations[0]
    assert operation.__dict__.get("_run_decorators")  # the POST operation is wrapped


# -- a worker's settings: no ROOT_URLCONF, no MIDDLEWARE, no TEMPLATES ... ---------

WORKER_MAY_LACK = [
    "ROOT_URLCONF",
    "MIDDLEWARE",
    "TEMPLATES",
    "AUTHENTICATION_BACKENDS",
    "STATIC_URL",
    "SECRET_KEY",
    "REST_FRAMEWORK",
    "IDEMPOTENCY",
]


@pytest.mark.django_db(databases="__all__")  # Django 6.1 checks every database
def test_check_passes_without_root_urlconf(settings: Any) -> None:
    """A Celery worker's settings module: Django skips its own URL checks, so must we, or
    ``celery worker`` and every ``manage.py`` command fail to start."""
    del settings.ROOT_URLCONF
    out = StringIO()
    call_command("check", stdout=out)
    assert "no issues" in out.getvalue()


def test_manage_py_check_starts_with_a_worker_settings_module() -> None:
    """In a process of its own, as ``celery worker`` or ``manage.py`` starts."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.project.worker_settings"}
    done = subprocess.run(
        [sys.executable, "-m", "django", "check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "no issues" in done.stdout


@pytest.mark.parametrize("name", WORKER_MAY_LACK)
def test_every_check_of_ours_runs_without_a_setting_a_worker_may_lack(
    settings: Any, name: str
) -> None:
    ours = [
        check
        for check in checks.registry.registry.get_checks()
        if check.__module__.startswith("idempotency_django.")
    ]
    assert len(ours) >= 4  # settings, DRF views, middleware, codecs
    delattr(settings, name)
    for check in ours:
        assert check(app_configs=None) == []


def test_misspelled_drf_idempotency_configuration_is_an_error(settings: Any) -> None:
    """E018: a misspelled attribute or action on a routed DRF view protected nothing, and
    no request failed to say so."""
    from idempotency_django.checks import check_drf_view_attributes

    settings.ROOT_URLCONF = "tests.project.drf_typo_urls"
    errors = check_drf_view_attributes()

    assert {error.id for error in errors} == {"idempotency_django.E018"}
    messages = sorted(error.msg for error in errors)
    assert len(messages) == 3
    assert "PlainChargeViewSet has 'idempotency_mod'" in messages[0]
    assert "PlainChargeViewSet.idempotency_actions names 'craete'" in messages[1]
    assert "RefundViewSet.idempotency_actions names 'refnud'" in messages[2]
    assert not any("RightViewSet" in message for message in messages)


@pytest.mark.django_db(databases="__all__")  # Django 6.1 checks every database
def test_the_check_command_reports_a_misspelled_action(settings: Any) -> None:
    settings.ROOT_URLCONF = "tests.project.drf_typo_urls"
    with pytest.raises(SystemCheckError, match=r"idempotency_django\.E018.*'craete'"):
        call_command("check")


# -- W031: ON_STORE_ERROR "open" says what it gives up -----------------------------------------


def test_w030_fail_open_in_the_setting(settings: Settings) -> None:
    from idempotency_django.checks import check_fail_open

    assert check_fail_open() == []  # the default, "closed", and no view of its own
    settings.IDEMPOTENCY = {"ON_STORE_ERROR": "open"}
    (warning,) = check_fail_open()

    assert warning.id == "idempotency_django.W031"
    assert warning.level == checks.WARNING
    assert "'open'" in warning.msg
    assert "runs it again" in (warning.hint or "")
    assert "SILENCED_SYSTEM_CHECKS" in (warning.hint or "")


def test_w030_fail_open_on_a_view_of_its_own(settings: Settings) -> None:
    """A decorated function view (once, however many routes) and a DRF view; the view
    that keeps the default is not named."""
    from idempotency_django.checks import check_fail_open

    settings.ROOT_URLCONF = "tests.project.fail_open_urls"
    clear_url_caches()
    try:
        warnings = check_fail_open()
    finally:
        clear_url_caches()

    assert [warning.id for warning in warnings] == ["idempotency_django.W031"] * 2
    named = sorted(warning.msg.split(" has ")[0] for warning in warnings)
    assert named == [
        "tests.project.fail_open_urls.OpenView",
        "tests.project.fail_open_urls.opens",
    ]


@pytest.mark.django_db(databases="__all__")  # Django 6.1 checks every database
def test_w030_is_registered(settings: Settings) -> None:
    settings.IDEMPOTENCY = {"ON_STORE_ERROR": "open"}
    output = StringIO()
    call_command("check", stderr=output, stdout=output)

    assert "idempotency_django.W031" in output.getvalue()
