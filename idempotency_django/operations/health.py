"""The health check: is this process fit to take protected requests?

Three checks, each bounded in time and each a precise message when it fails:

- ``store``: one round trip to the store (the database's records table, or Redis's
  ``PING``), bounded by ``HEALTH_TIMEOUT_SECONDS`` (a statement timeout on PostgreSQL and
  MariaDB, a socket timeout on Redis): a store that is down or stalls fails it, and every
  claim would fail with it.
- ``heartbeat``: this process's lease renewals keep up (``Heartbeat.status``): a process
  whose heartbeat thread died, or whose renewals fail, lets the leases of views still
  running lapse, and a retry then runs the work a second time.
- ``purge_lag``: the oldest expired record still present expired less than
  ``HEALTH_MAX_PURGE_LAG_SECONDS`` ago (``Store.oldest_expired``, one index probe at any
  table size): a purge that has stopped or cannot keep up.

``idempotency_health_view`` answers them as JSON (200 when every check passes, 503
otherwise), for a readiness probe; ``manage.py idempotency_health`` prints the same JSON
and exits 1 when one fails, for deploy scripts. The shape and what each check means:
``docs/health.md``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from django.db import transaction
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe

from idempotency_django.conf import conf
from idempotency_django.core.heartbeat import heartbeat as process_heartbeat
from idempotency_django.store.base import ChecksHealth, Store, get_store, store_alias

logger = logging.getLogger("idempotency_django")

Status = Literal["ok", "fail"]


@dataclass(frozen=True)
class Check:
    """One check's verdict. ``value`` is its measure where it has one (the purge lag in
    seconds, the heartbeat's oldest renewal's age), for scripts that graph it."""

    name: str
    ok: bool
    message: str
    duration: float  # seconds this check took
    value: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "message": self.message,
            "duration": round(self.duration, 6),
            "value": None if self.value is None else round(self.value, 3),
        }


@dataclass(frozen=True)
class Report:
    store: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    @property
    def status(self) -> Status:
        return "ok" if self.ok else "fail"

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "store": self.store,
            "checks": [check.as_dict() for check in self.checks],
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)


def run_checks(
    *, store: Store | None = None, alias: str | None = None, detail: bool = True
) -> Report:
    """Run the three checks (``store``, ``heartbeat``, ``purge_lag``) and report them.

    ``detail``: put the store's own error text in the messages (the command, run by an
    operator); the view leaves it out (its answer may reach whoever can reach the probe:
    a driver's message names hosts and databases) and logs it instead.
    """
    store = (store if store is not None else get_store()).bind(alias or store_alias())
    timeout = max(0.001, float(conf.get("HEALTH_TIMEOUT_SECONDS")))
    max_lag = float(conf.get("HEALTH_MAX_PURGE_LAG_SECONDS"))
    report = Report(store=type(store).__name__)
    reachable = _timed(report, "store", lambda: _check_store(store, timeout, detail))
    _timed(report, "heartbeat", _check_heartbeat)
    if reachable:
        _timed(report, "purge_lag", lambda: _check_purge_lag(store, timeout, max_lag, detail))
    else:
        report.checks.append(
            Check("purge_lag", False, "not checked: the store did not answer", 0.0)
        )
    return report


def _timed(report: Report, name: str, run: Callable[[], tuple[bool, str, float | None]]) -> bool:
    started = time.perf_counter()
    ok, message, value = run()
    report.checks.append(Check(name, ok, message, time.perf_counter() - started, value))
    return ok


def _failure(store: Store, error: BaseException, timeout: float, detail: bool, what: str) -> str:
    """A store failure as one line: a timeout said as such, the failure's kind otherwise."""
    if _timed_out(error):
        message = f"{what} did not answer within {timeout:g} s (HEALTH_TIMEOUT_SECONDS)"
    else:
        kind = store.failure_kind(error)
        message = f"{what} failed ({kind}: {type(error).__name__})"
    logger.warning("Idempotency health check: %s: %s", message, error)
    store.reset()  # the next probe connects afresh, as the next claim would
    return f"{message}: {_first_line(error)}" if detail else f"{message}; the error is logged"


def _check_store(store: Store, timeout: float, detail: bool) -> tuple[bool, str, None]:
    try:
        if isinstance(store, ChecksHealth):
            store.ping(timeout)
        elif not store.usable():
            return False, "the store is not usable (its connection failed)", None
    except store.errors as error:
        return False, _failure(store, error, timeout, detail, "the store"), None
    return True, f"the store answered within {timeout:g} s", None


def _check_heartbeat() -> tuple[bool, str, float | None]:
    status = process_heartbeat.status()
    if status.alive and status.renewing == 0:
        return True, f"no claim of this process to renew ({status.claims} in flight)", None
    if status.alive:
        return (
            True,
            f"renewing {status.renewing} claim(s); the oldest renewal is "
            f"{status.renewal_age:.1f} s old",
            status.renewal_age,
        )
    if not status.thread_alive:
        return (
            False,
            f"the heartbeat thread is not running: {status.renewing} claim(s) of this "
            "process are not renewed, and their leases will lapse under running views",
            status.renewal_age,
        )
    return (
        False,
        f"{status.late} of {status.renewing} claim(s) of this process missed two "
        f"renewals (the oldest renewal is {status.renewal_age:.1f} s old): the store "
        "refuses or stalls the heartbeat's renewals",
        status.renewal_age,
    )


def _check_purge_lag(
    store: Store, timeout: float, max_lag: float, detail: bool
) -> tuple[bool, str, float | None]:
    if not store.needs_purge:
        return True, f"{type(store).__name__} expires its records itself: no purge lag", None
    try:
        if isinstance(store, ChecksHealth):
            with store.bounded_reads(timeout):
                oldest = store.oldest_expired()
        else:
            oldest = store.oldest_expired()
    except store.errors as error:
        return False, _failure(store, error, timeout, detail, "the purge lag's read"), None
    if oldest is None:
        return True, "no expired record is left to purge", 0.0
    lag = max(0.0, (timezone.now() - oldest).total_seconds())
    if lag > max_lag:
        return (
            False,
            f"the oldest expired record expired {lag:.0f} s ago, more than "
            f"HEALTH_MAX_PURGE_LAG_SECONDS ({max_lag:g} s): the purge is not running or "
            "cannot keep up",
            lag,
        )
    return True, f"the oldest expired record expired {lag:.0f} s ago", lag


def _timed_out(error: BaseException) -> bool:
    """Whether ``error`` is the time bound firing: PostgreSQL's query_canceled (57014),
    MariaDB's max_statement_time (1969), a Redis socket timeout."""
    seen: BaseException | None = error
    while seen is not None:
        if getattr(seen, "sqlstate", None) == "57014" or type(seen).__name__ == "TimeoutError":
            return True
        args = getattr(seen, "args", ())
        if args and args[0] == 1969:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@never_cache
@require_safe
@transaction.non_atomic_requests
def idempotency_health_view(request: HttpRequest) -> HttpResponse:
    """The health check as JSON for a readiness probe: 200 when every check passes, 503
    otherwise. Mount it where your probes look: ``path("health/idempotency/",
    idempotency_health_view)``. It reads no request data and needs no login, so that a
    probe can call it; its messages carry no store error text (that goes to the log)."""
    report = run_checks(detail=False)
    return HttpResponse(
        report.to_json(),
        status=200 if report.ok else 503,
        content_type="application/json",
    )
