"""Durations have an upper bound: 100 years (``conf.MAX_DURATION_SECONDS``).

A TTL, lease, max-run or wait longer than that cannot be added to the current time on
every store (``now + 10**12 s`` is past the year 9999: ``OverflowError`` on every request).
It is refused by a system check (E028) and where a view or task declares it; a request
that meets it anyway fails before its claim. Up to the bound, everything works on every
store: the claim, the completion, the replay and the heartbeat's renewal.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import RequestFactory
from django.utils import timezone

from idempotency_django.checks import check_settings
from idempotency_django.conf import (
    DURATIONS,
    MAX_DURATION_SECONDS,
    MAX_WAIT_SECONDS,
    check_argument,
    is_number,
)
from idempotency_django.core import claims, shell
from idempotency_django.decorators import idempotent
from idempotency_django.purge import parse_duration, purge_records
from idempotency_django.store.base import get_store
from idempotency_django.tasks import idempotent_task
from tests import records
from tests.conftest import Post, effects
from tests.models import SideEffect

HUGE = 10**12  # someone's "practically forever": past the year 9999 from now


def test_the_bound_is_a_hundred_years() -> None:
    assert MAX_DURATION_SECONDS == 100 * 365 * 24 * 3600


# -- the system check ------------------------------------------------------------------------


@pytest.mark.parametrize("name", DURATIONS)
@pytest.mark.parametrize("value", [HUGE, MAX_DURATION_SECONDS + 1, 1e300])
def test_e028_a_duration_over_a_hundred_years(settings: Any, name: str, value: float) -> None:
    settings.IDEMPOTENCY = {name: value, "MAX_RUN_SECONDS": MAX_DURATION_SECONDS}
    if name == "MAX_RUN_SECONDS":
        settings.IDEMPOTENCY = {name: value}
    messages = [m for m in check_settings() if m.id == "idempotency_django.E028"]

    assert len(messages) == 1
    assert name in messages[0].msg
    assert "100 years" in messages[0].msg
    assert messages[0].hint


@pytest.mark.parametrize("name", DURATIONS)
def test_e028_not_for_exactly_a_hundred_years(settings: Any, name: str) -> None:
    settings.IDEMPOTENCY = {name: MAX_DURATION_SECONDS, "MAX_RUN_SECONDS": MAX_DURATION_SECONDS}
    ids = [m.id for m in check_settings()]
    assert "idempotency_django.E028" not in ids
    assert "idempotency_django.E003" not in ids


def test_e028_hints_at_none_for_a_ttl_kept_forever(settings: Any) -> None:
    settings.IDEMPOTENCY = {"TTL_SECONDS": HUGE}
    [message] = [m for m in check_settings() if m.id == "idempotency_django.E028"]
    assert "None" in str(message.hint)


def test_a_number_too_large_for_a_float_is_not_a_number(settings: Any) -> None:
    """``math.isfinite(10**400)`` raises OverflowError: the check must answer, not crash."""
    assert not is_number(10**400)
    settings.IDEMPOTENCY = {"TTL_SECONDS": 10**400, "MAX_RESPONSE_BYTES": 10**400}
    ids = [m.id for m in check_settings()]
    assert ids.count("idempotency_django.E003") == 2


# -- where a view or a task declares it ------------------------------------------------------


@pytest.mark.parametrize(
    "argument", ["lease_seconds", "ttl_seconds", "max_run_seconds", "wait_seconds"]
)
def test_a_views_duration_over_the_bound_is_refused_naming_the_view(argument: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=rf"charge.*{argument}=.*100 years"):

        @idempotent(**{argument: HUGE})
        def charge(request: HttpRequest) -> HttpResponse:
            return HttpResponse()


def test_a_drf_views_duration_over_the_bound_is_refused_at_class_creation() -> None:
    from rest_framework.views import APIView

    from idempotency_django.drf import IdempotentMixin

    with pytest.raises(ImproperlyConfigured, match=r"Forever \(IdempotentMixin\): ttl_seconds="):

        class Forever(IdempotentMixin, APIView):
            idempotency_ttl_seconds = HUGE


def test_a_ninja_operations_duration_over_the_bound_is_refused_naming_it() -> None:
    from idempotency_django.ninja import idempotent as ninja_idempotent

    with pytest.raises(ImproperlyConfigured, match=r"ninja @idempotent on .*create.*100 years"):

        @ninja_idempotent(ttl_seconds=HUGE)
        def create(request: HttpRequest) -> dict[str, int]:
            return {}


@pytest.mark.parametrize("argument", ["lease_seconds", "ttl_seconds", "max_run_seconds"])
def test_a_tasks_duration_over_the_bound_is_refused_naming_it(argument: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=rf"Task 'receipt': {argument}="):
        idempotent_task(scope="s", key="message_id", name="receipt", **{argument: HUGE})


def test_check_argument_says_what_the_bound_is() -> None:
    with pytest.raises(ImproperlyConfigured) as raised:
        check_argument("TTL_SECONDS", HUGE, "@idempotent on charge")
    assert f"at most {MAX_DURATION_SECONDS} seconds (100 years)" in str(raised.value)
    assert "None keeps keys forever" in str(raised.value)


# -- a request that meets one anyway: refused before the claim, not a crash after it ---------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("name", ["TTL_SECONDS", "LEASE_SECONDS", "WAIT_SECONDS"])
@pytest.mark.parametrize("path", ["/effect/", "/async/"])
def test_a_request_under_a_duration_setting_over_the_bound_runs_nothing(
    settings: Any, alice: User, post: Post, name: str, path: str
) -> None:
    """Before the bound, ``TTL_SECONDS = 10**12`` raised ``OverflowError`` on every request;
    now the request is refused, naming the setting, before any claim or work (E028 said so
    at startup)."""
    settings.IDEMPOTENCY = {name: HUGE, "MAX_RUN_SECONDS": MAX_DURATION_SECONDS}
    with pytest.raises(ImproperlyConfigured, match=re.escape(f"IDEMPOTENCY[{name!r}]")):
        post(path, {})

    assert effects() == 0
    assert not records.exists()


# -- up to the bound, every store keeps it --------------------------------------------------


@idempotent(
    lease_seconds=MAX_DURATION_SECONDS,
    ttl_seconds=MAX_DURATION_SECONDS,
    max_run_seconds=MAX_DURATION_SECONDS,
    wait_seconds=MAX_WAIT_SECONDS,  # a policy bound of its own (E040)
)
def for_a_century(request: HttpRequest) -> HttpResponse:
    effect = SideEffect.objects.create(label="century")
    return JsonResponse({"effect": effect.pk}, status=201)


@pytest.mark.django_db(transaction=True)
def test_a_view_with_every_duration_at_the_bound_claims_completes_and_replays(
    alice: User,
) -> None:
    def send() -> Any:
        request = RequestFactory().post(
            "/century/", data="{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY="c1"
        )
        request.user = alice
        return for_a_century(request)

    first = send()
    again = send()

    assert first.status_code == 201
    assert again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert effects("century") == 1
    record = records.get()
    century = timedelta(seconds=MAX_DURATION_SECONDS)
    assert record.expires_at > timezone.now() + century - timedelta(days=1)


@pytest.mark.django_db(transaction=True)
def test_a_claim_leased_for_the_bound_is_renewed_by_the_heartbeats_statement() -> None:
    """The heartbeat renews with a statement timeout of a third of the lease: 33 years, which
    PostgreSQL's ``statement_timeout`` (an int of milliseconds: 24.8 days at most) and
    MariaDB's ``max_statement_time`` (a year) cannot take as they are."""
    policy = claims.ClaimPolicy(
        "default",
        lease=MAX_DURATION_SECONDS,
        ttl=MAX_DURATION_SECONDS,
        in_flight="conflict",
        wait_seconds=0,
        retry_after=1,
    )
    claim = shell.claim_or_replay(claims.Scope("1", "POST /x/", "k"), "f" * 64, policy)
    assert isinstance(claim, claims.Claim)
    records.update(lease_expires_at=timezone.now() + timedelta(seconds=5))

    renewed = get_store().renew(
        [(claim.scope, claim.token)],
        MAX_DURATION_SECONDS,
        MAX_DURATION_SECONDS / 3,
    )

    assert renewed == 1
    century = timedelta(seconds=MAX_DURATION_SECONDS)
    assert records.get().lease_expires_at > timezone.now() + century - timedelta(days=1)
    assert connection.vendor  # the renewal left the connection usable
    assert records.count() == 1


# -- the purge's ages ------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["36501d", "99999999999d", "5215w", "3153600001s"])
def test_a_purge_age_over_a_hundred_years_is_refused(text: str) -> None:
    """``99999999999d`` made ``timedelta()`` raise ``OverflowError``; ``36501d`` made
    ``now - older_than`` raise it: a traceback, not a usage error."""
    with pytest.raises(ValueError, match="longer than 100 years"):
        parse_duration(text)


@pytest.mark.django_db
@pytest.mark.parametrize("option", ["--older-than", "--stale-after"])
def test_the_purge_command_refuses_an_age_over_a_hundred_years(option: str) -> None:
    with pytest.raises(CommandError, match="longer than 100 years") as raised:
        call_command("purge_idempotency_keys", option, "40000d")
    assert raised.value.returncode == 2


@pytest.mark.django_db
@pytest.mark.database_store("the purge command (the Redis store has nothing to purge)")
@pytest.mark.parametrize("name", ["older_than", "stale_after"])
def test_the_purge_command_refuses_a_timedelta_over_a_hundred_years(name: str) -> None:
    with pytest.raises(CommandError, match="at most 100 years") as raised:
        call_command("purge_idempotency_keys", **{name: timedelta(days=40000)})
    assert raised.value.returncode == 2


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["older_than", "stale_after"])
def test_purge_records_refuses_an_age_over_a_hundred_years(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be at most 100 years"):
        purge_records(**{name: timedelta(days=40000)})


@pytest.mark.django_db
def test_the_purge_accepts_exactly_a_hundred_years() -> None:
    assert purge_records(older_than=parse_duration("36500d")).total == 0
