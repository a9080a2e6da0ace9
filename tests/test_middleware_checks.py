"""System checks for ``IdempotencyMiddleware``'s place in ``MIDDLEWARE`` (E012, E013, W004),
for its setting, ``EXEMPT_URL_NAMES`` (E010), and for DRF views a decorator hides from it (E027)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.wsgi import WSGIHandler
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import Client

from idempotency_django.checks import check_hidden_drf_views, check_middleware, check_settings

if TYPE_CHECKING:
    from pytest_django import Settings

IDEMPOTENCY = "idempotency_django.middleware.IdempotencyMiddleware"
SESSIONS = "django.contrib.sessions.middleware.SessionMiddleware"
AUTH = "django.contrib.auth.middleware.AuthenticationMiddleware"
CSRF = "django.middleware.csrf.CsrfViewMiddleware"
COMMON = "django.middleware.common.CommonMiddleware"


def ids(settings: Settings, middleware: list[str], **idempotency: object) -> list[str]:
    settings.MIDDLEWARE = middleware
    settings.IDEMPOTENCY = idempotency
    return [message.id or "" for message in check_middleware()]


def test_last_after_auth_and_csrf_is_clean(settings: Settings) -> None:
    assert ids(settings, [SESSIONS, CSRF, AUTH, COMMON, IDEMPOTENCY]) == []


def test_without_the_middleware_nothing_is_checked(settings: Settings) -> None:
    assert ids(settings, [CSRF]) == []


def test_before_authentication_is_an_error(settings: Settings) -> None:
    assert ids(settings, [SESSIONS, IDEMPOTENCY, AUTH]) == ["idempotency_django.E012"]


def test_before_a_middleware_with_process_view_is_an_error(settings: Settings) -> None:
    settings.MIDDLEWARE = [SESSIONS, AUTH, IDEMPOTENCY, COMMON, CSRF]
    [message] = check_middleware()
    assert message.id == "idempotency_django.E013"
    assert CSRF in message.msg
    assert COMMON not in message.msg  # no process_view: its order does not matter


def test_both_errors_at_once(settings: Settings) -> None:
    assert ids(settings, [IDEMPOTENCY, SESSIONS, CSRF, AUTH]) == [
        "idempotency_django.E012",
        "idempotency_django.E013",
    ]


def test_an_unimportable_middleware_is_left_to_django(settings: Settings) -> None:
    assert ids(settings, [SESSIONS, AUTH, IDEMPOTENCY, "no.such.Middleware"]) == []


def test_no_authentication_middleware_warns_with_the_default_account(settings: Settings) -> None:
    assert ids(settings, [IDEMPOTENCY]) == ["idempotency_django.W004"]
    assert ids(settings, [IDEMPOTENCY], ACCOUNT="tests.test_conf.custom_account") == []


def test_exempt_url_names_must_be_a_list_of_names(settings: Settings) -> None:
    settings.IDEMPOTENCY = {"EXEMPT_URL_NAMES": "admin:*"}
    assert [m.id for m in check_settings()] == ["idempotency_django.E010"]
    settings.IDEMPOTENCY = {"EXEMPT_URL_NAMES": ["admin:*", "webhooks"]}
    assert check_settings() == []


@pytest.mark.django_db(databases="__all__")  # Django 6.1 checks every database
def test_the_check_command_reports_the_order(settings: Settings) -> None:
    settings.MIDDLEWARE = [SESSIONS, IDEMPOTENCY, AUTH]
    with pytest.raises(SystemCheckError, match=r"idempotency_django\.E012"):
        call_command("check")


# --- refused when the server starts, not only by the checks it does not run ---------------------


@pytest.mark.parametrize("handler", [WSGIHandler, ASGIHandler])
def test_the_server_refuses_to_start_before_a_middleware_with_process_view(
    settings: Settings, handler: type
) -> None:
    settings.MIDDLEWARE = [SESSIONS, AUTH, IDEMPOTENCY, COMMON, CSRF]
    with pytest.raises(ImproperlyConfigured, match="CsrfViewMiddleware") as refused:
        handler()
    assert COMMON not in str(refused.value)  # no process_view: its order does not matter


@pytest.mark.django_db
def test_a_keyed_post_without_a_csrf_token_is_never_served(settings: Settings) -> None:
    """Listed before CsrfViewMiddleware, the middleware would answer the view itself and
    the CSRF check would never run: a forged POST with a key would get 201."""
    settings.MIDDLEWARE = [SESSIONS, AUTH, IDEMPOTENCY, CSRF]
    settings.ROOT_URLCONF = "tests.project.middleware_urls"
    client = Client(enforce_csrf_checks=True)
    with pytest.raises(ImproperlyConfigured, match="process_view"):
        client.post("/mw/plain/", {"amount": 1}, headers={"Idempotency-Key": "k1"})


@pytest.mark.parametrize(
    "middleware",
    [
        pytest.param([SESSIONS, CSRF, AUTH, COMMON, IDEMPOTENCY], id="last"),
        pytest.param([SESSIONS, AUTH, IDEMPOTENCY, COMMON], id="before-no-process-view"),
        pytest.param([SESSIONS, AUTH, IDEMPOTENCY, "no.such.Middleware"], id="unimportable"),
    ],
)
def test_a_safe_order_starts(settings: Settings, middleware: list[str]) -> None:
    settings.MIDDLEWARE = [path for path in middleware if path != "no.such.Middleware"]
    WSGIHandler()
    ASGIHandler()


def test_the_shipped_settings_start(settings: Settings) -> None:
    """The test settings and the example project with the middleware last start; so does
    the live-test project, as its own process (its URLs are the example project's)."""
    from example_project import settings as example
    from tests.project import settings as test_settings

    for middleware in (
        [*test_settings.MIDDLEWARE, IDEMPOTENCY],
        [*example.MIDDLEWARE, IDEMPOTENCY],
    ):
        settings.MIDDLEWARE = middleware
        WSGIHandler()
    started = subprocess.run(
        [sys.executable, "-c", "from django.core.wsgi import get_wsgi_application as g; g()"],
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.project.middleware_live_settings"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert started.returncode == 0, started.stderr


def test_a_decorator_that_hides_a_drf_view_from_the_middleware_is_an_error(
    settings: Settings,
) -> None:
    settings.ROOT_URLCONF = "tests.project.middleware_hidden_urls"
    settings.MIDDLEWARE = [SESSIONS, AUTH, IDEMPOTENCY]

    [message] = check_hidden_drf_views()

    assert message.id == "idempotency_django.E027"
    assert "'hidden/'" in message.msg
    assert "TokenChargeView" in message.msg


def test_hidden_drf_views_are_checked_only_under_the_middleware(settings: Settings) -> None:
    settings.ROOT_URLCONF = "tests.project.middleware_hidden_urls"
    settings.MIDDLEWARE = [SESSIONS, AUTH]

    assert check_hidden_drf_views() == []


@pytest.mark.django_db(databases="__all__")  # Django 6.1 checks every database
def test_the_hidden_drf_view_check_is_registered(settings: Settings) -> None:
    settings.ROOT_URLCONF = "tests.project.middleware_hidden_urls"
    settings.MIDDLEWARE = [SESSIONS, AUTH, IDEMPOTENCY]

    with pytest.raises(SystemCheckError, match="E027"):
        call_command("check")
