"""Seed, read, count, expire and lapse records through the store the suite runs on.

On the database store these are ORM calls on ``IdempotencyRecord``; on the Redis store
(``IDEMPOTENCY_TEST_STORE=redis``) they read and write the store's keys in its own value
format (``store/redis.py``), on Redis's clock. A Redis key is a hash of the record's scope,
so this module remembers the scope of every key the store computes in this process (a
record written by another process reads with ``account``/``endpoint``/``key`` of None).

A test that fakes the time (``age``, ``retime``) moves the records instead wherever the
store keeps its own clock (``ON_STORE_CLOCK``): Redis, PostgreSQL and MariaDB.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any

from django.db import connection
from django.db.models import Case, F, When
from django.utils import timezone

from idempotency_django.models import IdempotencyRecord
from idempotency_django.store import never
from idempotency_django.store.base import Scope
from idempotency_django.store.database import DatabaseNow
from tests.conftest import ON_REDIS

State = IdempotencyRecord.State

#: The store's leases and expiry run on its own clock (Redis's, the database's), which a test
#: cannot move; SQLite runs on this process's (``django.utils.timezone.now``).
ON_STORE_CLOCK = ON_REDIS or connection.vendor in ("postgresql", "mysql")


@dataclass(frozen=True)
class Record:
    """A record as a test observes it, whatever the store (Redis: ``pk`` is its key)."""

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
    created_at: datetime | None = None  # the Redis store keeps neither: None there
    completed_at: datetime | None = None


FIELDS = [f.name for f in fields(Record)]


def _matches(record: Record, filters: dict[str, Any]) -> bool:
    return not [name for name, value in filters.items() if getattr(record, name) != value]


# -- the database store ----------------------------------------------------------------------


def _from_row(row: IdempotencyRecord) -> Record:
    body = row.response_body
    return Record(
        pk=row.pk,
        account=row.account,
        endpoint=row.endpoint,
        key=row.key,
        state=row.state,
        token=row.token,
        fingerprint=row.fingerprint,
        lease_expires_at=row.lease_expires_at,
        expires_at=row.expires_at,
        response_status=row.response_status,
        response_headers=row.response_headers,
        response_body=None if body is None else bytes(body),
        created_at=row.created_at,
        completed_at=row.completed_at,
    )


# -- the Redis store -------------------------------------------------------------------------

_scopes: dict[str, tuple[str, str, str]] = {}

if ON_REDIS:
    from idempotency_django.store import redis as redis_store

    _record_key = redis_store.record_key

    def _remembering_record_key(prefix: str, scope: Scope) -> str:
        key = _record_key(prefix, scope)
        _scopes[key] = (scope.account, scope.endpoint, scope.key)
        return key

    redis_store.record_key = _remembering_record_key


def _redis() -> Any:
    from idempotency_django.store.redis import store

    return store


def _server_ms(client: Any, key: str) -> int:
    from idempotency_django.store import redis_cluster

    return int(redis_cluster.time_and_get(client, key)[0])


def _redis_keys() -> list[str]:
    store = _redis()
    client = store.client()
    pattern = f"{store.options()['KEY_PREFIX']}:*"
    return sorted({k.decode() if isinstance(k, bytes) else k for k in client.scan_iter(pattern)})


def _redis_read(key: str) -> Record | None:
    from idempotency_django.store.redis import COMPLETED, _parse

    value = _redis().client().get(key)
    if value is None:
        return None
    state, token, lease, expires, meta, body = _parse(bytes(value))

    def at(ms: int) -> datetime:  # Redis runs on this machine: one clock
        return datetime.fromtimestamp(ms / 1000, tz=dt_timezone.utc)

    account, endpoint, scope_key = _scopes.get(key, (None, None, None))
    completed = state == COMPLETED
    return Record(
        pk=key,
        account=account,
        endpoint=endpoint,
        key=scope_key,
        state=state,
        token=token,
        fingerprint=str(meta["f"]),
        lease_expires_at=None if completed or lease == 0 else at(lease),
        expires_at=never() if expires == 0 else at(expires),
        response_status=meta.get("s"),
        response_headers=[[str(n), str(v)] for n, v in meta.get("h", [])] if completed else None,
        response_body=body if completed else None,
    )


def _redis_write(record: Record) -> None:
    """Writes ``record`` as the store would have (its times moved onto Redis's clock); a
    record past its expiry is kept a minute, as if Redis had not evicted it yet."""
    client = _redis().client()
    key = record.pk
    server_ms = _server_ms(client, key)

    def ms(when: datetime) -> int:  # Redis runs on this machine: one clock
        return round(when.timestamp() * 1000)

    completed = record.state == State.COMPLETED
    lease = 0 if completed or record.lease_expires_at is None else ms(record.lease_expires_at)
    expires = 0 if record.expires_at >= never() else ms(record.expires_at)
    meta: dict[str, Any] = {"f": record.fingerprint}
    if completed:
        meta.update(s=record.response_status, h=[list(h) for h in record.response_headers or []])
    else:
        meta.update(s=None, h=[])
    body = record.response_body
    head = f"{'c' if completed else 'i'}|{record.token}|{lease}|{expires}|{json.dumps(meta)}"
    value = head.encode() + (b"\r" if completed and body is None else b"\n" + (body or b""))
    ttl = 60_000 if expires == 0 else max(60_000, expires - server_ms)
    if expires == 0 and completed:
        client.set(key, value)
    else:
        client.set(key, value, px=ttl)


# Time on the Redis store: leases and expiry run on Redis's clock, which a test cannot move,
# so a test that fakes the time ages the records instead (the stateful model test).

# KEYS[1]; ARGV: ms. -> 1 when the key is gone. The record as it would be ``ms`` later: its
# lease and expiry (0: none) ``ms`` earlier, its PTTL ``ms`` shorter, and the key deleted
# when its PTTL is no longer than that, as Redis would have expired it by then.
_AGE = """
local old = redis.call('GET', KEYS[1])
if not old then return 1 end
local pttl = redis.call('PTTL', KEYS[1])
local ms = tonumber(ARGV[1])
if pttl >= 0 and pttl <= ms then
  redis.call('DEL', KEYS[1])
  return 1
end
local a = string.find(old, '|', 1, true)
local b = string.find(old, '|', a + 1, true)
local c = string.find(old, '|', b + 1, true)
local d = string.find(old, '|', c + 1, true)
local function earlier(field)
  local n = tonumber(field)
  if n == 0 then return '0' end
  return string.format('%.0f', n - ms)
end
local value = string.sub(old, 1, b) .. earlier(string.sub(old, b + 1, c - 1)) .. '|'
  .. earlier(string.sub(old, c + 1, d - 1)) .. string.sub(old, d)
if pttl < 0 then
  redis.call('SET', KEYS[1], value)
else
  redis.call('SET', KEYS[1], value, 'PX', pttl - ms)
end
return 0
"""

# KEYS[1]; ARGV: lease, expiry and PTTL in ms from now by Redis's clock ('': the lease or
# the expiry field unchanged, no PTTL). -> {now, the value before, its PTTL before}.
_RETIME = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local old = redis.call('GET', KEYS[1])
local pttl = redis.call('PTTL', KEYS[1])
if not old then return {now, false, pttl} end
local a = string.find(old, '|', 1, true)
local b = string.find(old, '|', a + 1, true)
local c = string.find(old, '|', b + 1, true)
local d = string.find(old, '|', c + 1, true)
local lease = string.sub(old, b + 1, c - 1)
local expires = string.sub(old, c + 1, d - 1)
if ARGV[1] ~= '' then lease = string.format('%.0f', now + tonumber(ARGV[1])) end
if ARGV[2] ~= '' then expires = string.format('%.0f', now + tonumber(ARGV[2])) end
local value = string.sub(old, 1, b) .. lease .. '|' .. expires .. string.sub(old, d)
if ARGV[3] == '' then
  redis.call('SET', KEYS[1], value)
else
  redis.call('SET', KEYS[1], value, 'PX', ARGV[3])
end
return {now, old, pttl}
"""

_scripts: dict[tuple[int, str], Any] = {}


def _script(source: str) -> Any:
    client = _redis().client()
    found = _scripts.get((id(client), source))
    if found is None:
        found = _scripts[(id(client), source)] = client.register_script(source)
    return found


def age(delta: timedelta) -> list[str]:
    """Every record as the store would hold it ``delta`` later: its times that much
    earlier. On the Redis store (``_AGE``), the keys that Redis would have expired by then
    are deleted, and returned; the database expires nothing by itself."""
    assert ON_STORE_CLOCK
    if not ON_REDIS:
        IdempotencyRecord.objects.update(
            lease_expires_at=F("lease_expires_at") - delta,
            expires_at=Case(
                When(expires_at__gte=never(), then=F("expires_at")),
                default=F("expires_at") - delta,
            ),
            created_at=F("created_at") - delta,
            completed_at=F("completed_at") - delta,
        )
        return []
    ms = round(delta.total_seconds() * 1000)
    client = _redis().client()
    run = _script(_AGE)
    return [key for key in _redis_keys() if run(keys=[key], args=[ms], client=client) == 1]


@dataclass(frozen=True)
class Times:
    """A record's lease, expiry and (Redis) PTTL in ms from now by the store's clock (None:
    none, or a database record)."""

    lease: int | None
    expires: int | None
    pttl: int | None


def retime(key: Any, times: Times) -> Times | None:
    """Sets the record ``key``'s lease, expiry and (Redis) PTTL to ``times`` from now by the
    store's clock (a ``None`` lease or expiry is left as it is; a ``None`` PTTL: none), and
    returns the times it had (None: no such record). A test that ages records gives back,
    this way, the real time its own steps took on the store's clock."""
    assert ON_STORE_CLOCK
    if not ON_REDIS:
        return _retime_row(key, times)
    from idempotency_django.store.redis import _parse

    def arg(ms: int | None) -> str:
        return "" if ms is None else str(ms)

    now, old, pttl = _script(_RETIME)(
        keys=[key],
        args=[arg(times.lease), arg(times.expires), arg(times.pttl)],
        client=_redis().client(),
    )
    if old is None:
        return None
    _state, _token, lease, expires, _meta, _body = _parse(bytes(old))
    return Times(
        lease=None if lease == 0 else lease - int(now),
        expires=None if expires == 0 else expires - int(now),
        pttl=None if pttl < 0 else int(pttl),
    )


def _retime_row(pk: int, times: Times) -> Times | None:
    rows = IdempotencyRecord.objects.filter(pk=pk)
    old = rows.annotate(now=DatabaseNow()).values("lease_expires_at", "expires_at", "now").first()
    if old is None:
        return None
    changes = {
        name: DatabaseNow(timedelta(milliseconds=ms))
        for name, ms in (("lease_expires_at", times.lease), ("expires_at", times.expires))
        if ms is not None
    }
    if changes:
        rows.update(**changes)

    def ms(when: datetime | None) -> int | None:
        if when is None or when >= never():
            return None
        return round((when - old["now"]).total_seconds() * 1000)

    return Times(lease=ms(old["lease_expires_at"]), expires=ms(old["expires_at"]), pttl=None)


def lasts(when: datetime | None, since: datetime | None, seconds: float) -> bool:
    """``when`` is exactly ``seconds`` after ``since`` (a record's ``created_at`` or
    ``completed_at``); on the Redis store, which keeps neither, ``seconds`` from now (less
    the few the test took)."""
    assert when is not None
    if since is not None:
        return when - since == timedelta(seconds=seconds)
    assert ON_REDIS
    left = (when - timezone.now()).total_seconds()
    return seconds - 5 < left <= seconds


# -- what tests call -------------------------------------------------------------------------


def all(**filters: Any) -> list[Record]:
    if not ON_REDIS:
        return [_from_row(row) for row in IdempotencyRecord.objects.filter(**filters)]
    found = [_redis_read(key) for key in _redis_keys()]
    return [r for r in found if r is not None and _matches(r, filters)]


def get(**filters: Any) -> Record:
    """The one record (that matches ``filters``): fails if there are none or several."""
    matching = all(**filters)
    assert len(matching) == 1, f"expected one record, found {len(matching)}"
    return matching[0]


def count(**filters: Any) -> int:
    return len(all(**filters))


def exists(**filters: Any) -> bool:
    return count(**filters) > 0


def values(*names: str, **filters: Any) -> list[tuple[Any, ...]]:
    return [tuple(getattr(r, name) for name in names) for r in all(**filters)]


def create(**values: Any) -> Record:
    """Seeds a record (``account``, ``endpoint``, ``key``, ``fingerprint``, ``token``, times,
    and the state and response fields of a completed one)."""
    if not ON_REDIS:
        return _from_row(IdempotencyRecord.objects.create(**values))
    lookup = Scope(values["account"], values["endpoint"], values["key"])
    given = {name: values.get(name) for name in FIELDS if name in values}
    body = given.get("response_body")
    record = Record(
        **{
            "pk": _redis().key(lookup),
            "state": State.IN_PROGRESS,
            "lease_expires_at": None,
            "expires_at": never(),
            "response_status": None,
            "response_headers": None,
            "response_body": None,
            **given,
        }
    )
    if body is not None:
        record = replace(record, response_body=bytes(body))
    _redis_write(record)
    return record


def update(filters: dict[str, Any] | None = None, **changes: Any) -> int:
    """Changes every record (matching ``filters``): ``expires_at`` to expire one,
    ``lease_expires_at`` to lapse one, ``state``, ``token``, … Returns how many."""
    if not ON_REDIS:
        return IdempotencyRecord.objects.filter(**(filters or {})).update(**changes)
    found = all(**(filters or {}))
    for record in found:
        _redis_write(replace(record, **changes))
    return len(found)


def delete(**filters: Any) -> int:
    if not ON_REDIS:
        return IdempotencyRecord.objects.filter(**filters).delete()[0]
    found = all(**filters)
    client = _redis().client()
    for record in found:
        client.delete(record.pk)
    return len(found)
