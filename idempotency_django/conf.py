"""Settings for idempotency_django, read from the ``IDEMPOTENCY`` dict.

Every value is looked up when it is used, never cached at import, so that
``override_settings`` in tests and per-request overrides see the current value.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

MODES = ("commit", "atomic")
IN_FLIGHT_POLICIES = ("conflict", "wait")
ANONYMOUS_POLICIES = ("reject", "bypass")
STORE_ERROR_POLICIES = ("closed", "open")
LOG_KEY_FORMATS = ("plain", "hash")
DISCONNECT_POLICIES = ("finish", "release")
# RFC 9110's methods and RFC 5789's PATCH. A name outside them in METHODS is nearly always a
# typo ("GETT", "PSOT") that leaves the method it meant unprotected.
HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH")
SAFE_METHODS = ("GET", "HEAD", "OPTIONS", "TRACE")
# An HTTP header name (RFC 9110's token) that Django can find: request.headers spells every
# "_" as "-", and servers drop headers with underscores, so a name with one is never found.
HEADER_NAME = re.compile(r"[-!#$%&'*+.^`|~0-9A-Za-z]+")

DEFAULTS: dict[str, Any] = {
    "ENABLED": True,
    "HEADER": "Idempotency-Key",
    "REQUIRED": True,
    "METHODS": ("POST", "PATCH"),
    "MODE": "commit",
    "IN_FLIGHT": "conflict",
    "WAIT_SECONDS": 10.0,
    # Under "wait": how many requests of one process may wait for a duplicate at once; the
    # next one is answered 409 at once (docs/security.md, "Exhaustion").
    "MAX_WAITERS": 8,
    "RETRY_AFTER_SECONDS": 1,
    "LEASE_SECONDS": 10.0,
    "MAX_RUN_SECONDS": 300.0,
    "TTL_SECONDS": 24 * 60 * 60,
    "ACCOUNT": "idempotency_django.keys.default_account",
    # Principals other than users (a DRF authentication class's Merchant) as
    # "<app_label>.<model>:<pk>", not the bare pk a user has (opt-in: it moves their scopes).
    "NAMESPACE_PRINCIPALS": False,
    "ANONYMOUS": "reject",
    "ENDPOINT": "idempotency_django.keys.default_endpoint",
    # The request's tenant (a callable or its dotted path; None: one tenant), put into
    # every endpoint so that one user's keys in two organisations never meet.
    "TENANT": None,
    "FINGERPRINT": "idempotency_django.keys.default_fingerprint",
    "STORE_STATUSES": "idempotency_django.responses.is_definitive",
    "STORED_HEADERS": (),
    "MAX_RESPONSE_BYTES": 64 * 1024,
    # At most this many requests of one account in progress at once (None: no bound); more
    # are answered 429 before their claim (docs/security.md, "Exhaustion").
    "MAX_IN_FLIGHT_PER_ACCOUNT": None,
    # Stored responses at rest (codecs.py): a codec (None: the bytes as they are), its
    # Fernet keys (the first encrypts, all decrypt), and the redaction and replay hooks.
    "RESPONSE_CODEC": None,
    "ENCRYPTION_KEYS": (),
    "REDACT_RESPONSE": None,
    "REPLAY_HOOK": None,
    # With a codec: replay only responses sealed and bound to their own record (True once
    # reseal_idempotency_responses has bound the older ones: docs/stored-responses.md).
    "REQUIRE_BOUND_RESPONSES": False,
    # The admin: an account as people read it, and a search term to the accounts it names.
    "ACCOUNT_DISPLAY": "idempotency_django.admin.username_display",
    "ACCOUNT_SEARCH": "idempotency_django.admin.accounts_by_username",
    "DATABASE": None,
    # The record store (store/): a dotted path to a store class, and that store's options
    # (the Redis store's URL, KEY_PREFIX and timeouts: store/redis.py).
    "STORE": "idempotency_django.store.database.DatabaseStore",
    "STORE_OPTIONS": {},
    "ON_STORE_ERROR": "closed",
    "ON_DISCONNECT": "finish",
    "REPLAY_HEADER": "Idempotent-Replayed",
    "LOG_KEYS": "plain",
    # Measured at 10M records (benchmarks/RESULTS.md): 1,000 rows a batch doubled the paced
    # rate of 500 on PostgreSQL, where a batch's fixed cost (two round trips, the index
    # descent) was half its time; MariaDB/MySQL take at most 999 (purge.py).
    "PURGE_BATCH_SIZE": 1000,
    "PURGE_RATE": 25_000,
    "STALE_IN_PROGRESS_SECONDS": 60 * 60,
    # The health check (health.py): the bound on each of its round trips to the store, and
    # the purge lag (age of the oldest expired record still present) past which it fails.
    "HEALTH_TIMEOUT_SECONDS": 1.0,
    "HEALTH_MAX_PURGE_LAG_SECONDS": 24 * 60 * 60,
    "PROBLEM_TYPE_BASE": "urn:idempotency-django:problem:",
    # IdempotencyMiddleware leaves these URL names alone ("ns:*" is a whole namespace).
    "EXEMPT_URL_NAMES": ("admin:*",),
    # Metrics (and spans) from the signals: None, "prometheus", "opentelemetry", or a list
    # of both (docs/observability.md). Each needs its extra installed (E060).
    "METRICS": None,
    # One log line per protected request on the idempotency_django.requests logger.
    "LOG_REQUESTS": False,
}

METRICS_EXPORTERS = ("prometheus", "opentelemetry")


# The least value of each numeric setting (and of the per-view / per-task argument of the
# same name). Leases are renewed every third of themselves: under a second, renewals can't
# keep up with a busy database.
MINIMUMS: dict[str, float] = {
    "WAIT_SECONDS": 0,
    "MAX_WAITERS": 0,
    "RETRY_AFTER_SECONDS": 0,
    "LEASE_SECONDS": 1,
    "MAX_RUN_SECONDS": 0,
    "TTL_SECONDS": 0,
    "MAX_RESPONSE_BYTES": 0,
    "PURGE_BATCH_SIZE": 1,
    "PURGE_RATE": 0,
    "STALE_IN_PROGRESS_SECONDS": 0,
    "HEALTH_TIMEOUT_SECONDS": 0,
    "HEALTH_MAX_PURGE_LAG_SECONDS": 0,
}
# The most a request may wait for a duplicate (``WAIT_SECONDS``, ``wait_seconds=``): a waiting
# request holds a worker thread and its connections, and clients and proxies give up after
# 30 to 60 seconds, when the wait is for nobody.
MAX_WAIT_SECONDS = 60.0
# Settings where None is a value: records kept forever, no quota.
NULLABLE = ("TTL_SECONDS", "MAX_IN_FLIGHT_PER_ACCOUNT")
# The longest duration any setting, argument or command option may give: 100 years of 365
# days. Longer is "forever" in practice, and where it is not representable it fails at
# request time (now + a TTL past the year 9999 raises OverflowError). Within it, now + the
# bound fits every store: datetimes up to 9999 (the database columns, MariaDB's DATETIME
# included), Redis PX in milliseconds (3.2e12, far below 2**63) and the Lua scripts' doubles
# (exact below 2**53 ms), threading's TIMEOUT_MAX (292 years) for the heartbeat's sleep.
# TTL_SECONDS = None stays "forever". docs/settings.md ("Durations").
MAX_DURATION_SECONDS = 100 * 365 * 24 * 60 * 60
DURATIONS = (
    "WAIT_SECONDS",
    "RETRY_AFTER_SECONDS",
    "LEASE_SECONDS",
    "MAX_RUN_SECONDS",
    "TTL_SECONDS",
    "STALE_IN_PROGRESS_SECONDS",
    "HEALTH_TIMEOUT_SECONDS",
    "HEALTH_MAX_PURGE_LAG_SECONDS",
)
# The True/False settings: anything else is E014, and counts as True until fixed (the safe
# side of each: protection on, a key required, unbound responses refused).
SWITCHES = ("ENABLED", "REQUIRED", "REQUIRE_BOUND_RESPONSES")


def metrics_exporters(value: Any) -> tuple[str, ...] | None:
    """``METRICS`` as a tuple of exporters (empty: off), or ``None`` when it is not a
    valid value."""
    if value is None:
        return ()
    names = (value,) if isinstance(value, str) else value
    if not is_list_of_names(names) or not set(names) <= set(METRICS_EXPORTERS):
        return None
    return tuple(dict.fromkeys(names))


CHOICES: dict[str, tuple[str, ...]] = {
    "MODE": MODES,
    "IN_FLIGHT": IN_FLIGHT_POLICIES,
    "ANONYMOUS": ANONYMOUS_POLICIES,
    "ON_STORE_ERROR": STORE_ERROR_POLICIES,
    "LOG_KEYS": LOG_KEY_FORMATS,
    "ON_DISCONNECT": DISCONNECT_POLICIES,
}


def is_number(value: Any) -> bool:
    """A real number that a float can hold: not a bool, NaN or an infinity, and not an int
    too large to convert (``math.isfinite(10**400)`` raises rather than answers)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    return -sys.float_info.max <= value <= sys.float_info.max


def too_long(name: str, value: Any) -> bool:
    """Whether ``value`` is a number over ``MAX_DURATION_SECONDS`` for the duration ``name``."""
    return name in DURATIONS and is_number(value) and value > MAX_DURATION_SECONDS


def is_list_of_names(value: Any) -> bool:
    return isinstance(value, (list, tuple, set, frozenset)) and all(
        isinstance(item, str) for item in value
    )


def not_status_codes(value: Iterable[Any]) -> list[Any]:
    """The items of a ``STORE_STATUSES`` list that are not HTTP status codes (100-599);
    a code may be given as a string of digits."""
    wrong = []
    for item in value:
        code = item
        if isinstance(item, str) and item.strip().isdigit():
            code = int(item)
        if not isinstance(code, int) or isinstance(code, bool) or not 100 <= code <= 599:
            wrong.append(item)
    return wrong


def problem(name: str, value: Any) -> str | None:
    """What is wrong with ``value`` for the setting ``name`` (or the per-view or per-task
    argument of the same name), or ``None``. The one validation that system checks,
    ``@idempotent``, the DRF mixin and the task API share."""
    if name in CHOICES and value not in CHOICES[name]:
        return f"expected one of {', '.join(CHOICES[name])}"
    if name in NULLABLE and value is None:
        return None
    if name in MINIMUMS:
        least = MINIMUMS[name]
        if not is_number(value) or value < least:
            return f"expected a number of at least {least:g}"
        if too_long(name, value):
            forever = " (None keeps keys forever)" if name == "TTL_SECONDS" else ""
            return f"expected at most {MAX_DURATION_SECONDS} seconds (100 years){forever}"
    if name == "WAIT_SECONDS" and value > MAX_WAIT_SECONDS:
        return (
            f"expected at most {MAX_WAIT_SECONDS:g} seconds: a waiting request holds a worker, "
            "and its client has given up by then"
        )
    if name == "MAX_IN_FLIGHT_PER_ACCOUNT" and (
        isinstance(value, bool) or not isinstance(value, int) or value < 1
    ):
        return "expected None or a whole number of at least 1"
    if name in ("METHODS", "STORED_HEADERS", "EXEMPT_URL_NAMES") and not is_list_of_names(value):
        return "expected a list of names"
    if name == "METHODS":
        unknown = [method for method in value if method.upper() not in HTTP_METHODS]
        if unknown:
            return f"{unknown[0]!r} is not an HTTP method (one of {', '.join(HTTP_METHODS)})"
    if name == "METRICS" and metrics_exporters(value) is None:
        return f"expected None, one of {', '.join(METRICS_EXPORTERS)}, or a list of them"
    if name in (*SWITCHES, "NAMESPACE_PRINCIPALS", "LOG_REQUESTS") and not isinstance(value, bool):
        return "expected True or False"
    if name in ("HEADER", "REPLAY_HEADER") and not (
        isinstance(value, str) and HEADER_NAME.fullmatch(value)
    ):
        return "expected an HTTP header name (letters, digits, -, no spaces or underscores)"
    return None


def check_argument(name: str, value: Any, where: str) -> None:
    """Raise ``ImproperlyConfigured`` naming ``where`` (the view or task) for a bad value."""
    wrong = problem(name, value)
    if wrong is not None:
        raise ImproperlyConfigured(f"{where}: {name.lower()}={value!r}: {wrong}.")


def check_durations(given: Mapping[str, Any], where: str) -> None:
    """Hold a view's (or a task's) own ``lease_seconds``, ``ttl_seconds`` and
    ``max_run_seconds`` against each other and against the settings it leaves alone, as
    E005 and E006 hold the settings, naming the view. ``given`` holds the durations the
    view sets, already validated one by one (``check_argument``). A setting that is itself
    invalid is left to the system checks: this runs when a module is imported, and must not
    fail where ``manage.py check`` would report the setting."""
    values = {name: given.get(name.lower(), _valid_setting(name)) for name in _DURATIONS}

    def text(name: str) -> str:
        if name.lower() in given:
            return f"{name.lower()}={values[name]!r}"
        return f"{name} ({values[name]!r})"

    lease, ttl, max_run = (values[name] for name in _DURATIONS)
    if lease is _INVALID:
        return
    lease_given = "lease_seconds" in given
    if (lease_given or "ttl_seconds" in given) and ttl not in (None, _INVALID) and ttl < lease:
        raise ImproperlyConfigured(
            f"{where}: {text('TTL_SECONDS')} is shorter than {text('LEASE_SECONDS')}: a key "
            "must be kept at least as long as a claim on it can last."
        )
    if (lease_given or "max_run_seconds" in given) and max_run is not _INVALID and max_run < lease:
        raise ImproperlyConfigured(
            f"{where}: {text('MAX_RUN_SECONDS')} is shorter than {text('LEASE_SECONDS')}: "
            "make it longer than the slowest honest run."
        )


_DURATIONS = ("LEASE_SECONDS", "TTL_SECONDS", "MAX_RUN_SECONDS")
_INVALID: Any = object()


def setting_at_declaration(name: str) -> Any:
    """The setting ``name`` as a view's or task's declaration reads it, to refuse there what
    its request would refuse; ``None`` when the setting is itself invalid (left to the
    system checks, as ``check_durations`` leaves it)."""
    value = _valid_setting(name)
    return None if value is _INVALID else value


def _valid_setting(name: str) -> Any:
    try:
        value = conf.get(name)
    except ImproperlyConfigured:  # not a dict: E001
        return _INVALID
    return _INVALID if problem(name, value) is not None else value


def resolve_callable(value: Any, name: str) -> Callable[..., Any]:
    """Turn a callable or a dotted path into a callable, naming the setting when it fails."""
    if isinstance(value, str):
        try:
            value = import_string(value)
        except ImportError as exc:
            raise ImproperlyConfigured(
                f"IDEMPOTENCY {name}: cannot import {value!r}: {exc}"
            ) from exc
    if not callable(value):
        raise ImproperlyConfigured(f"IDEMPOTENCY {name}: {value!r} is not callable")
    return value  # type: ignore[no-any-return]


def status_predicate(value: Any, name: str = "STORE_STATUSES") -> Callable[[int], bool]:
    """``STORE_STATUSES`` may be a predicate, its dotted path, or an iterable of status codes."""
    if isinstance(value, Iterable) and not isinstance(value, str):
        items = list(value)
        wrong = not_status_codes(items)
        if wrong:
            raise ImproperlyConfigured(
                f"IDEMPOTENCY {name} holds {', '.join(map(repr, wrong))}: "
                "not an HTTP status code (100-599)."
            )
        codes = frozenset(int(code) for code in items)
        return codes.__contains__
    return resolve_callable(value, name)


class Settings:
    """Typed, late-bound view of ``settings.IDEMPOTENCY`` with defaults."""

    def raw(self) -> dict[str, Any]:
        user = getattr(settings, "IDEMPOTENCY", {})
        if not isinstance(user, dict):
            raise ImproperlyConfigured("The IDEMPOTENCY setting must be a dict.")
        return user

    def get(self, name: str) -> Any:
        if name not in DEFAULTS:
            raise AttributeError(name)
        return self.raw().get(name, DEFAULTS[name])

    def checked(self, name: str) -> Any:
        """The setting, refused as its system check refuses it. Read where a request is
        about to be claimed: a bad value then fails that request before any work runs,
        rather than change what protection means (an unknown ``ON_DISCONNECT`` acting as
        ``"release"``, a 0.1 s lease that renewals cannot keep) or fail only after the view
        ran, which would release the key for a second run (``STORED_HEADERS``)."""
        value = self.get(name)
        wrong = problem(name, value)
        if wrong is not None:
            raise ImproperlyConfigured(f"IDEMPOTENCY[{name!r}] is {value!r}: {wrong}.")
        return value

    @property
    def ENABLED(self) -> bool:
        """Only ``False`` turns protection off. Anything else that is not a bool (``"no"``,
        ``0``, ``None`` from an unset environment variable) is an error (E014) and keeps
        protection on until it is fixed: a typo never switches it off."""
        return self.get("ENABLED") is not False

    @property
    def HEADER(self) -> str:
        """The key's header; a name no request can carry (a space, an underscore) raises,
        before any claim, rather than leave every request keyless (E015)."""
        value = self.get("HEADER")
        wrong = problem("HEADER", value)
        if wrong is not None:
            raise ImproperlyConfigured(f"IDEMPOTENCY HEADER={value!r}: {wrong}.")
        return value  # type: ignore[no-any-return]

    def methods_at_import(self) -> frozenset[str]:
        """``METHODS``, upper-cased, for what is decided when a module is imported (which
        operations an ``IdempotentRouter`` wraps). A setting that cannot be read as a list of
        names counts as the default there, so that importing the URLconf never fails and
        ``manage.py check`` can report it (E001, E010); the requests then fail on it."""
        try:
            value = self.get("METHODS")
        except ImproperlyConfigured:
            value = DEFAULTS["METHODS"]
        if not is_list_of_names(value):
            value = DEFAULTS["METHODS"]
        return frozenset(method.upper() for method in value)

    @property
    def MAX_WAITERS(self) -> int:
        return int(self.checked("MAX_WAITERS"))

    @property
    def RETRY_AFTER_SECONDS(self) -> int:
        return int(self.get("RETRY_AFTER_SECONDS"))

    @property
    def MAX_RUN_SECONDS(self) -> float:
        return float(self.get("MAX_RUN_SECONDS"))

    @property
    def TTL_SECONDS(self) -> float | None:
        value = self.get("TTL_SECONDS")
        return None if value is None else float(value)

    @property
    def ACCOUNT(self) -> Callable[..., Any]:
        return resolve_callable(self.get("ACCOUNT"), "ACCOUNT")

    @property
    def NAMESPACE_PRINCIPALS(self) -> bool:
        """Only ``True`` turns it on: anything else (E030) keeps the scopes where they are."""
        return self.get("NAMESPACE_PRINCIPALS") is True

    @property
    def ANONYMOUS(self) -> str:
        return str(self.get("ANONYMOUS"))

    @property
    def ENDPOINT(self) -> Callable[..., Any]:
        return resolve_callable(self.get("ENDPOINT"), "ENDPOINT")

    @property
    def STORED_HEADERS(self) -> tuple[str, ...]:
        return tuple(self.get("STORED_HEADERS"))

    @property
    def MAX_RESPONSE_BYTES(self) -> int:
        return int(self.get("MAX_RESPONSE_BYTES"))

    @property
    def RESPONSE_CODEC(self) -> Any:
        """A codec, a codec class, its dotted path, or ``None``: see ``codecs.get_codec``."""
        return self.get("RESPONSE_CODEC")

    @property
    def ENCRYPTION_KEYS(self) -> Any:
        """Fernet keys, first one encrypting: validated by ``codecs.FernetCodec``."""
        return self.get("ENCRYPTION_KEYS")

    def optional_callable(self, name: str) -> Callable[..., Any] | None:
        """A hook setting (a callable or its dotted path), or ``None`` when unset."""
        value = self.get(name)
        return None if value is None else resolve_callable(value, name)

    @property
    def DATABASE(self) -> str | None:
        value = self.get("DATABASE")
        return None if value is None else str(value)

    @property
    def STORE(self) -> str:
        return str(self.get("STORE"))

    @property
    def LOG_KEYS(self) -> str:
        return str(self.get("LOG_KEYS"))

    @property
    def PURGE_BATCH_SIZE(self) -> int:
        return int(self.get("PURGE_BATCH_SIZE"))

    @property
    def PURGE_RATE(self) -> float:
        return float(self.get("PURGE_RATE"))

    @property
    def STALE_IN_PROGRESS_SECONDS(self) -> float:
        return float(self.get("STALE_IN_PROGRESS_SECONDS"))

    @property
    def REPLAY_HEADER(self) -> str:
        return str(self.get("REPLAY_HEADER"))

    @property
    def METRICS(self) -> tuple[str, ...]:
        """The exporters to feed: ``()`` when off, or when the value is invalid (E061)."""
        return metrics_exporters(self.get("METRICS")) or ()

    @property
    def LOG_REQUESTS(self) -> bool:
        return self.get("LOG_REQUESTS") is True

    @property
    def PROBLEM_TYPE_BASE(self) -> str:
        return str(self.get("PROBLEM_TYPE_BASE"))

    @property
    def EXEMPT_URL_NAMES(self) -> tuple[str, ...]:
        return tuple(self.get("EXEMPT_URL_NAMES"))


conf = Settings()
