"""What every store shares: the interface, the record's states, and the failure kinds.

The I/O shell (``shell.py``) and the heartbeat (``heartbeat.py``) talk to a store only
through ``Store``; each store keeps records its own way and translates its own errors into
the failure kinds below, so that the one failure policy applies to every store. The one
definition of which records are *in use*, *expired* (absent) and *lapsed* lives here, as
Python predicates over a ``Snapshot`` and as ``Q``: an in-progress record with a live lease
is in use whatever its TTL says, and is never taken over or deleted. Choosing and writing a
store: ``docs/stores.md``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Collection, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any, ClassVar, Final, Literal, Protocol, TypeAlias, TypeVar, runtime_checkable

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import router
from django.db.models import Expression, Q
from django.utils.module_loading import import_string

from idempotency_django.conf import conf
from idempotency_django.models import IdempotencyRecord

State = IdempotencyRecord.State

FailureKind = Literal["unreachable", "contention", "other"]
"""``unreachable``: refused or lost connection (the only kind that may fail open);
``contention``: a concurrent duplicate is in the way (409); ``other``: 503."""


class StoreError(Exception):
    """A store's failure in store-neutral terms, for stores whose client's errors mean
    nothing to Django (the Redis store raises it; the database store raises Django's
    ``DatabaseError``, which its ``failure_kind`` classifies). ``kind`` is what the
    lifecycle's policy goes by."""

    def __init__(self, message: str, kind: FailureKind) -> None:
        super().__init__(message)
        self.kind: FailureKind = kind


def never() -> datetime:
    """The expiry of records kept forever (``TTL_SECONDS = None``): a date every backend can
    store, naive when the project runs with ``USE_TZ = False`` (MariaDB and SQLite reject
    an aware datetime there)."""
    value = datetime(9999, 12, 31, tzinfo=dt_timezone.utc)
    return value if settings.USE_TZ else value.replace(tzinfo=None)


def expiry(now: datetime, ttl: float | None) -> datetime:
    return never() if ttl is None else now + timedelta(seconds=ttl)


def store_alias() -> str:
    """The database alias of the store's records (and, for a store outside the database,
    the alias whose transactions the work runs in)."""
    return conf.DATABASE or router.db_for_write(IdempotencyRecord)


# -- what a store is given: a scope, a claim's write, a completion ---------------------------


@dataclass(frozen=True)
class Scope:
    """A record's key: the idempotency key within its account and endpoint."""

    account: str
    endpoint: str
    key: str

    def lookup(self) -> dict[str, str]:
        """The scope as keyword arguments (signals, log records, ORM filters)."""
        return {"account": self.account, "endpoint": self.endpoint, "key": self.key}


@dataclass(frozen=True)
class Write:
    """What a claim or a take-over writes: a record in progress under ``token``.

    The times are the engine's, on the app's clock: ``created_at``, and the lease and TTL
    counted from it. A store that keeps its own clock writes the durations from its own now
    (``lease``, ``ttl``); one that does not, the moments (``lease_expires_at``,
    ``expires_at``).
    """

    scope: Scope
    token: str
    fingerprint: str
    created_at: datetime
    lease: timedelta
    ttl: timedelta | None  # None: the record is kept forever

    @property
    def lease_expires_at(self) -> datetime:
        return self.created_at + self.lease

    @property
    def expires_at(self) -> datetime:
        return never() if self.ttl is None else self.created_at + self.ttl


@dataclass(frozen=True)
class Completion:
    """What a completion writes over its claim: the outcome, and its TTL counted from
    ``completed_at`` (the engine's now, on the app's clock)."""

    status: int
    headers: Sequence[tuple[str, str]]
    body: bytes | None  # None: completed without a storable body (streamed or too large)
    completed_at: datetime
    ttl: timedelta | None  # None: the record is kept forever

    @property
    def expires_at(self) -> datetime:
        return never() if self.ttl is None else self.completed_at + self.ttl


def duration(seconds: float | None) -> timedelta | None:
    """A lease's or TTL's seconds as a ``Write`` or ``Completion`` holds them."""
    return None if seconds is None else timedelta(seconds=seconds)


# -- the one definition of "in use", "absent" and "lapsed" ------------------------------------

Now: TypeAlias = datetime | Expression
"""The moment a definition is taken at: a time on the app's clock (a ``Snapshot`` moved onto
it, SQLite), or the database's own clock in SQL (``database.DatabaseNow``)."""


def in_use_q(now: Now) -> Q:
    """In progress under a live lease: its view may be running right now."""
    return Q(state=State.IN_PROGRESS, lease_expires_at__gt=now)


def expired_q(now: Now, expired_by: Now | None = None) -> Q:
    """Past its TTL and not in use: the key counts as absent, and the purge may delete it.

    ``expired_by``: only records that expired by then (the purge's ``--older-than``).
    """
    return Q(expires_at__lte=now if expired_by is None else expired_by) & ~in_use_q(now)


def lapsed_q(now: Now) -> Q:
    """In progress with a lease that nobody renews any more: its worker died or lost the
    store. The same request may take it over; a different one is told 422."""
    return Q(state=State.IN_PROGRESS) & (
        Q(lease_expires_at__lte=now) | Q(lease_expires_at__isnull=True)
    )


@dataclass(frozen=True)
class Snapshot:
    """What a loser reads of the record it lost to: never the body unless it replays. Its
    lease and expiry are on the reading process's clock: a store that keeps them on its
    own clock moves them by the difference it read in the same round trip."""

    pk: Any  # the database's primary key; the Redis store's record key
    state: str
    token: str
    fingerprint: str
    lease_expires_at: datetime | None
    expires_at: datetime
    response_status: int | None
    stored: Stored | None = None  # loaded only when it will be replayed


@dataclass(frozen=True)
class Stored:
    status: int
    headers: list[tuple[str, str]]
    body: bytes | None  # None: completed without a storable body (streamed or too large)


def stored(status: Any, headers: Any, body: Any) -> Stored:
    if isinstance(headers, str):  # a JSON column that a CASE turned into text (MariaDB)
        headers = json.loads(headers)
    return Stored(
        status=int(status),
        headers=[(str(name), str(value)) for name, value in headers],
        body=None if body is None else bytes(body),
    )


CLAIMED: Final = "claimed"
"""What ``claim_or_read`` answers when this call inserted the record: the key is ours."""

ClaimOrRead: TypeAlias = Literal["claimed"] | Snapshot | None
"""``CLAIMED``; or the record the claim lost to; or ``None``: it lost to a record that was
gone again when read (released or taken over in between), a race to try again."""


class Store(Protocol):
    """What the engine needs of a store: ``docs/stores.md``, "Writing another store".

    A store works on one database alias (``alias``): the database store keeps its records
    there; a store outside the database ignores it. ``get_store()`` answers a store that
    follows ``store_alias()`` (the setting, the routers) at each call; ``bind(alias)`` one
    bound to ``alias`` for good, which the engine takes once per view and alias.
    """

    errors: ClassVar[tuple[type[BaseException], ...]]  # what a failing call raises
    transactional: ClassVar[bool]  # a claim can live in the work's transaction
    needs_purge: ClassVar[bool]  # expired records stay until purge_idempotency_keys

    @property
    def alias(self) -> str:
        """The database alias this store works on."""
        ...

    def bind(self, alias: str) -> Store:
        """This store, working on ``alias``."""
        ...

    def claim_or_read(self, write: Write) -> ClaimOrRead:
        """Insert ``write`` if its scope is absent, else read the record in the way."""
        ...

    def claim(self, write: Write) -> bool:
        """Insert ``write`` if its scope is absent: True when this call inserted it."""
        ...

    def read_stored(self, pk: Any) -> Stored | None:
        """The stored response of the completed record ``pk`` (``None``: not completed)."""
        ...

    def take_over(self, record: Snapshot, write: Write) -> bool:
        """Replace ``record`` if it is still the same and expired or lapsed."""
        ...

    def complete(self, scope: Scope, token: str, completion: Completion) -> bool:
        """Store the outcome, if ``token`` still holds the claim in progress."""
        ...

    def is_completed(self, scope: Scope, token: str) -> bool:
        """Whether ``token``'s claim of ``scope`` completed (a resent completion)."""
        ...

    def release(self, scope: Scope, token: str) -> int:
        """Delete the claim in progress, if ``token`` still holds it: how many deleted."""
        ...

    def renew(self, claims: Sequence[tuple[Scope, str]], lease: float, timeout: float) -> int:
        """Push each claim's lease to ``lease`` s from now, within ``timeout`` s: how many."""
        ...

    def oldest_expired(self) -> datetime | None:
        """The oldest expiry past which a record is still present (``None``: none)."""
        ...

    def failure_kind(self, error: BaseException) -> FailureKind:
        """What one of ``errors`` means for the failure policy."""
        ...

    def in_transaction(self) -> bool:
        """Whether a call now would run inside an open transaction (never retried)."""
        ...

    def reset(self) -> None:
        """Drop the connection, so that the next call opens a new one."""
        ...

    def usable(self) -> bool:
        """Whether the connection still works (closes it when it does not)."""
        ...


S = TypeVar("S")


class Bindable:
    """``alias`` and ``bind`` for a store class: a store bound to an alias is a shallow
    copy of the unbound one (``get_store``'s), made once per alias and kept. The unbound
    store follows ``store_alias()`` at each call, so that a test's or a router's change is
    seen; the engine binds once per view and alias, and pays nothing per request."""

    _alias: str | None = None
    _bound: dict[str, Any]

    @property
    def alias(self) -> str:
        return store_alias() if self._alias is None else self._alias

    def bind(self: S, alias: str) -> S:
        this: Any = self
        if this._alias == alias:
            return self
        root = this._root if this._alias is not None else this
        bound = root.__dict__.setdefault("_bound", {})
        found: S | None = bound.get(alias)
        if found is None:
            copied: Any = copy.copy(root)
            copied._alias, copied._root = alias, root
            found = bound[alias] = copied
        return found


@runtime_checkable
class BoundsLockWaits(Protocol):
    """A store whose claims can wait on a row lock held by a concurrent transaction (the
    database store, in atomic mode), and that can bound that wait."""

    def lock_wait(self, seconds: float) -> AbstractContextManager[None]: ...


def lock_wait(store: Store, seconds: float | None) -> AbstractContextManager[None]:
    """Bound the row-lock waits of the claim run inside to ``seconds`` (``None``: leave them
    as they are), where ``store`` can wait on a lock at all."""
    if seconds is None or not isinstance(store, BoundsLockWaits):
        return nullcontext()
    return store.lock_wait(seconds)


@runtime_checkable
class ChecksHealth(Protocol):
    """A store the health check can probe within a time bound (``health.py``): ``ping``
    makes one round trip and raises the store's errors; ``bounded_reads`` bounds the reads
    run inside (``oldest_expired``). A store without them is probed with ``usable``."""

    def ping(self, timeout: float) -> None: ...
    def bounded_reads(self, timeout: float) -> AbstractContextManager[None]: ...


@runtime_checkable
class CountsInUse(Protocol):
    """A store that can count an account's records in use (``MAX_IN_FLIGHT_PER_ACCOUNT``)."""

    def count_in_use(self, account: str, now: datetime, limit: int) -> int: ...


# -- inspection: whole records, for tests and operators' tools --------------------------------


@dataclass(frozen=True)
class Record:
    """A whole record, as an inspection reads or writes it, whatever the store's layout.

    ``pk``: the database's primary key, the Redis store's record key (``None``: not written
    yet). A store that keeps only a digest of the scope (Redis) reads ``account``,
    ``endpoint`` and ``key`` as ``None`` unless it saw that scope (``remember_scopes``), and
    keeps neither ``created_at`` nor ``completed_at``.
    """

    pk: Any
    account: str | None
    endpoint: str | None
    key: str | None
    state: str
    token: str
    fingerprint: str
    lease_expires_at: datetime | None
    expires_at: datetime
    response_status: int | None
    response_headers: list[list[str]] | None
    response_body: bytes | None
    created_at: datetime | None = None
    completed_at: datetime | None = None


@dataclass(frozen=True)
class Times:
    """A record's lease, expiry and (Redis) PTTL in ms from now by the store's clock (None:
    none, or a store without a PTTL)."""

    lease: int | None
    expires: int | None
    pttl: int | None


@runtime_checkable
class Inspects(Protocol):
    """A store whose records tests and tools can read and write whole, in its own layout
    and on its own clock. Never on a request's path: nothing here is fenced or fast."""

    def keeps_own_clock(self) -> bool:
        """Whether leases and expiry run on the store's clock, which a test cannot fake."""
        ...

    def remember_scopes(self) -> None:
        """Name ``records()`` by the scopes this process uses from now on (a store that
        keeps only a digest of the scope; nothing to do for one that keeps it)."""
        ...

    def records(self) -> list[Record]:
        """Every record (expired ones a store has not deleted yet included)."""
        ...

    def put(self, record: Record, fields: Collection[str] | None = None) -> Record:
        """Write ``record`` as the store would (a new one when its ``pk`` is ``None``):
        ``fields``, the ones that changed or were given (``None``: all)."""
        ...

    def drop(self, record: Record) -> None:
        """Delete ``record``."""
        ...

    def age(self, delta: timedelta) -> list[Any]:
        """Every record as the store would hold it ``delta`` later (its times that much
        earlier): the pks of those the store would have deleted by then, now deleted."""
        ...

    def retime(self, pk: Any, times: Times) -> Times | None:
        """Set the record's lease, expiry and PTTL to ``times`` from now by the store's
        clock (``None``: left as they are, no PTTL); the times it had (``None``: no such
        record)."""
        ...


DEFAULT_STORE: Final = "idempotency_django.store.database.DatabaseStore"

_instances: dict[type, Store] = {}


def shared(store: Store) -> None:
    """Make ``store`` the instance ``get_store`` answers for its class (the module-level
    instance of a store module, which tests may patch)."""
    _instances[type(store)] = store


def get_store(spec: str | Store | None = None) -> Store:
    """The store named by ``spec`` (a dotted path to a store class, or a store), or the
    ``IDEMPOTENCY["STORE"]`` setting's: one instance per class, shared by every view."""
    if spec is None:
        spec = conf.STORE
    if not isinstance(spec, str):
        return spec
    try:
        cls = import_string(spec)
    except ImportError as error:
        raise ImproperlyConfigured(f"IDEMPOTENCY STORE: cannot import {spec!r}: {error}") from error
    if not isinstance(cls, type):
        raise ImproperlyConfigured(f"IDEMPOTENCY STORE: {spec!r} is not a class")
    instance = _instances.get(cls)
    if instance is None:
        instance = _instances[cls] = cls()
    return instance


def check_store(spec: str | Store, mode: Any, where: str, *, mode_given: bool = True) -> Store:
    """A view's or task's own ``store=``, refused where it is declared when it cannot be
    loaded, or when it cannot run the view's ``mode`` (atomic needs the database store):
    its own ``mode=`` (``mode_given``), or else the project's ``MODE``, which it would
    otherwise meet on every request."""
    try:
        store = get_store(spec)
    except ImproperlyConfigured as error:
        raise ImproperlyConfigured(f"{where}: store={spec!r}: {error}") from error
    if mode == "atomic" and not store.transactional:
        if not mode_given:
            raise ImproperlyConfigured(
                f"{where}: store={spec!r} under IDEMPOTENCY MODE 'atomic': no transaction "
                f"spans {type(store).__name__} and the database, so every request would "
                "fail. Give this view mode='commit', or leave the store to the setting."
            )
        raise ImproperlyConfigured(
            f"{where}: mode='atomic' needs a store in the database, not "
            f"{type(store).__name__}: no transaction spans it and the database."
        )
    return store


# The record predicates the engine decides with (``is_in_use``, ``is_expired``, ``is_lapsed``,
# ``lease_left``) live in ``core/decisions.py``, beside the table that reads them; they stay
# importable from here, loaded on first use (the decisions import this module).
IN_DECISIONS = frozenset({"is_expired", "is_in_use", "is_lapsed", "lease_left"})


def __getattr__(name: str) -> object:
    if name in IN_DECISIONS:
        from idempotency_django.core import decisions

        return getattr(decisions, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
