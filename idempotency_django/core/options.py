"""The per-view and per-task options: one definition that every adapter builds.

Each field of ``Options`` is one option, with the setting it overrides and the adapters that
take it: ``@idempotent`` and ninja's adapter (``VIEW``), the DRF mixin's ``idempotency_*``
class attributes (``DRF``), ``@idempotent_task`` and ``claim_once`` (``TASK``). A value is
validated as its setting is, when the view or task is declared, naming it; what is left
out is read from the ``IDEMPOTENCY`` setting at request time, and kept per view until a
setting changes (``Resolved``). Adding an option is one field here, plus its docs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed

from idempotency_django.conf import (
    check_argument,
    check_durations,
    conf,
    resolve_callable,
    setting_at_declaration,
    status_predicate,
)
from idempotency_django.core import claims, shell
from idempotency_django.store.base import Store, check_store, get_store

VIEW = "view"  # @idempotent, and ninja's @idempotent and IdempotentRouter
DRF = "drf"  # IdempotentMixin's idempotency_<name> class attributes
TASK = "task"  # @idempotent_task and claim_once

_UNSET: Any = object()


def _option(
    setting: str | None,
    *where: str,
    default: Any = _UNSET,
    checked: bool = True,
    nullable: bool = False,
) -> Any:
    """A field of ``Options``: ``checked`` values are validated as their setting is;
    ``nullable``: ``None`` is a value (``ttl_seconds=None`` keeps keys forever), where for
    the others it means "not given" (a DRF attribute, a task argument left at ``None``)."""
    return field(
        default=default,
        metadata={
            "setting": setting,
            "where": frozenset(where),
            "checked": checked and setting is not None,
            "nullable": nullable,
        },
    )


@dataclass(frozen=True)
class Option:
    """One option, as ``Options`` declares it."""

    name: str
    setting: str | None  # the IDEMPOTENCY setting it overrides
    where: frozenset[str]  # the adapters that take it (VIEW, DRF, TASK)
    checked: bool
    nullable: bool

    @property
    def attribute(self) -> str:
        """Its name as an ``IdempotentMixin`` class attribute."""
        return f"idempotency_{self.name}"


@dataclass(frozen=True)
class Options:
    """One view's (or task's) own options; anything left unset falls back to the
    ``IDEMPOTENCY`` setting at request time."""

    required: bool = _option("REQUIRED", VIEW, DRF)
    methods: Iterable[str] = _option("METHODS", VIEW, DRF)
    mode: str = _option("MODE", VIEW, DRF, TASK)
    in_flight: str = _option("IN_FLIGHT", VIEW, DRF, TASK)
    wait_seconds: float = _option("WAIT_SECONDS", VIEW, DRF, TASK)
    lease_seconds: float = _option("LEASE_SECONDS", VIEW, DRF, TASK)
    ttl_seconds: float | None = _option("TTL_SECONDS", VIEW, DRF, TASK, nullable=True)
    max_run_seconds: float = _option("MAX_RUN_SECONDS", VIEW, DRF, TASK)
    max_response_bytes: int = _option("MAX_RESPONSE_BYTES", VIEW, DRF, TASK)
    # Callables take the request the adapter has: an HttpRequest, or DRF's Request.
    account: Callable[[Any], str | None] | str = _option("ACCOUNT", VIEW, checked=False)
    endpoint: Callable[[Any], str] | str = _option("ENDPOINT", VIEW, checked=False)
    fingerprint_fields: Sequence[str] | None = _option(None, VIEW, DRF, default=None, nullable=True)
    fingerprint: Callable[[Any], str | bytes | None] | str | None = _option(
        None, VIEW, default=None, nullable=True
    )
    store_statuses: Callable[[int], bool] | Iterable[int] | str = _option(
        "STORE_STATUSES", VIEW, DRF, checked=False
    )
    on_store_error: str = _option("ON_STORE_ERROR", VIEW, DRF)
    on_disconnect: str = _option("ON_DISCONNECT", VIEW)
    store: str | Store = _option("STORE", VIEW, DRF, TASK, checked=False)  # a path, or a store
    # Set by the DRF mixin from its get_idempotency_key hook: no adapter takes it by name.
    key: Callable[[Any], str | None] | None = _option(None, default=None, nullable=True)
    label: str = "@idempotent"  # names the view or task in errors and warnings
    # A client's requests (every adapter but the task API): MAX_IN_FLIGHT_PER_ACCOUNT
    # bounds them; a task is the project's own work, redelivered until it runs.
    requests: bool = True
    # The 403's detail: where the account comes from differs per adapter (set by each).
    anonymous_detail: str = (
        "Authenticate to use an Idempotency-Key on this endpoint. (If the view does "
        "authenticate, apply its authentication outside @idempotent, so that it runs first.)"
    )

    def __post_init__(self) -> None:
        for option in OPTIONS:
            value = getattr(self, option.name)
            if option.checked and value is not _UNSET:
                check_argument(str(option.setting), value, self.label)
        durations = {
            name: getattr(self, name)
            for name in ("lease_seconds", "ttl_seconds", "max_run_seconds")
            if getattr(self, name) is not _UNSET
        }
        if durations:
            check_durations(durations, self.label)
        if self.store_statuses is not _UNSET:
            try:
                status_predicate(self.store_statuses, "store_statuses")
            except (ImproperlyConfigured, TypeError, ValueError) as error:
                raise ImproperlyConfigured(f"{self.label}: {error}") from error
        if self.store is not _UNSET:
            # Its own mode, or the project's MODE: a store outside the database under
            # MODE "atomic" would fail every request it gets (``Resolved._policy``).
            own_mode = self.mode is not _UNSET
            mode = self.mode if own_mode else setting_at_declaration("MODE")
            check_store(self.store, mode, self.label, mode_given=own_mode)
        if self.fingerprint_fields is not None and self.fingerprint is not None:
            raise ImproperlyConfigured(
                f"{self.label}: give fingerprint_fields or fingerprint, not both"
            )

    @classmethod
    def given(cls, values: Mapping[str, Any], label: str, where: str, **fixed: Any) -> Options:
        """The options an adapter was given by name (keyword arguments, class attributes),
        validated naming ``label``; ``fixed`` are the adapter's own (hooks, defaults).
        An option left ``_UNSET``, or ``None`` where ``None`` is not a value, is not given."""
        accepted = {option.name: option for option in OPTIONS if where in option.where}
        unknown = sorted(set(values) - set(accepted))
        if unknown:
            raise ImproperlyConfigured(f"{label}: unknown argument {unknown[0]!r}")
        own = {
            name: value
            for name, value in values.items()
            if value is not _UNSET and (value is not None or accepted[name].nullable)
        }
        return cls(**{**own, **fixed, "label": label, "requests": where != TASK})

    def pick(self, name: str) -> Any:
        """The view's own value, or its setting."""
        value = getattr(self, name)
        return conf.get(str(BY_NAME[name].setting)) if value is _UNSET else value

    def checked(self, name: str) -> Any:
        """``pick``, with the setting refused as its system check refuses it (the view's
        own value was checked when it was declared): see ``conf.checked``."""
        value = getattr(self, name)
        return conf.checked(str(BY_NAME[name].setting)) if value is _UNSET else value

    def resolved(self) -> Resolved:
        """This view's settings, resolved on first use and kept until a setting changes
        (``setting_changed``: ``override_settings`` and pytest-django's ``settings`` send
        it), rather than looked up in ``settings.IDEMPOTENCY`` a score of times per request."""
        cached = self.__dict__.get("_resolved")
        if cached is None or cached.generation != _settings_generation:
            cached = Resolved(self, _settings_generation)
            object.__setattr__(self, "_resolved", cached)  # frozen: a cache, not a field
        return cached

    def protects(self, method: str | None) -> bool:
        """Whether a request of ``method`` is protected ("applies?"): the app is enabled
        and ``method`` is in ``methods`` (``METHODS``). The one answer for every adapter."""
        resolved = self.resolved()
        return resolved.enabled and (method or "").upper() in resolved.methods

    def policy(self) -> shell.Policy:
        return self.resolved().policy(claims.store_alias())

    def refuse_async_atomic(self) -> None:
        """An async view given ``mode="atomic"`` is refused where it is declared, naming it,
        by every adapter: Django has no async transactions, and running it in ``commit``
        mode instead would silently drop what its author asked for."""
        if self.mode == "atomic":
            raise ImproperlyConfigured(
                f"{self.label}: mode='atomic' on an async view: Django has no async "
                "transactions; async views run in 'commit' mode."
            )


OPTIONS: tuple[Option, ...] = tuple(
    Option(name=each.name, **each.metadata) for each in fields(Options) if each.metadata
)
BY_NAME = {option.name: option for option in OPTIONS}


def names(where: str) -> list[str]:
    """The options an adapter takes by name, in their order of declaration."""
    return [option.name for option in OPTIONS if where in option.where]


_settings_generation = 0


def _settings_changed(**kwargs: Any) -> None:
    global _settings_generation
    _settings_generation += 1


setting_changed.connect(_settings_changed, dispatch_uid="idempotency_django.core.options")


class Resolved:
    """One view's options merged with the ``IDEMPOTENCY`` setting, each read on first use
    (a task reads only what its policy needs): callables are imported then (a bad dotted
    path raises on every request, as before); the policy is built once per store alias.
    The alias itself is looked up per request (``claims.store_alias``): a database router
    may depend on the request (a tenant), so it is never cached."""

    def __init__(self, options: Options, generation: int) -> None:
        self.options = options
        self.generation = generation
        self._policies: dict[str, shell.Policy] = {}

    @cached_property
    def enabled(self) -> bool:
        return conf.ENABLED

    @cached_property
    def methods(self) -> frozenset[str]:
        return frozenset(m.upper() for m in self.options.checked("methods"))

    @cached_property
    def header(self) -> str:
        return conf.HEADER

    @cached_property
    def required(self) -> bool:
        # Only False lets a keyless request through unprotected (a non-bool setting is E014).
        return self.options.pick("required") is not False

    @cached_property
    def anonymous(self) -> str:
        return str(conf.ANONYMOUS)

    @cached_property
    def stored_headers(self) -> Any:
        return conf.checked("STORED_HEADERS")  # read after the work, by capture: refused before it

    @cached_property
    def account(self) -> Callable[..., Any]:
        return resolve_callable(self.options.pick("account"), "ACCOUNT")

    @cached_property
    def endpoint(self) -> Callable[..., Any]:
        return resolve_callable(self.options.pick("endpoint"), "ENDPOINT")

    @cached_property
    def tenant(self) -> Callable[..., Any] | None:
        return conf.optional_callable("TENANT")

    @cached_property
    def fingerprint(self) -> Callable[..., Any]:
        return resolve_callable(conf.get("FINGERPRINT"), "FINGERPRINT")

    @cached_property
    def body(self) -> Callable[..., Any] | None:
        body = self.options.fingerprint
        return resolve_callable(body, "fingerprint") if body is not None else None

    @cached_property
    def store_statuses(self) -> Callable[[int], bool]:
        return status_predicate(self.options.pick("store_statuses"))

    def policy(self, alias: str) -> shell.Policy:
        policy = self._policies.get(alias)
        if policy is None:
            policy = self._policies[alias] = self._policy(alias)
        return policy

    def _policy(self, alias: str) -> shell.Policy:
        """The per-run policy, each value the view's (or task's) own, or its setting refused
        as its system check refuses it: before the claim, not after the work. An own
        ``ttl_seconds=None`` keeps keys forever, as ``TTL_SECONDS = None`` does."""
        checked, label = self.options.checked, self.options.label
        ttl = checked("ttl_seconds")
        store = get_store(checked("store"))
        mode = str(checked("mode"))
        if mode == "atomic" and not store.transactional:
            raise ImproperlyConfigured(
                f"{label}: mode 'atomic' needs a store in the database (no transaction spans "
                f"{type(store).__name__} and the database): use MODE 'commit' with this store."
            )
        return shell.Policy(
            claiming=claims.ClaimPolicy(
                alias=alias,
                lease=float(checked("lease_seconds")),
                ttl=None if ttl is None else float(ttl),
                in_flight=str(checked("in_flight")),
                wait_seconds=float(checked("wait_seconds")),
                retry_after=int(conf.checked("RETRY_AFTER_SECONDS")),
                store=store,
                account_limit=(
                    conf.checked("MAX_IN_FLIGHT_PER_ACCOUNT") if self.options.requests else None
                ),
            ),
            mode=mode,
            max_run=float(checked("max_run_seconds")),
            max_response_bytes=int(checked("max_response_bytes")),
            on_store_error=str(checked("on_store_error")),
            on_disconnect=str(checked("on_disconnect")),
            label=label,
        )
