"""The Redis (or Valkey) store: one Redis key per record, expired by Redis itself.

A record is the key ``<KEY_PREFIX>:{<sha256 of account, endpoint, key>}`` (the hash tag puts
every key of one record in one cluster slot), valued
``state|token|lease_ms|expires_ms|<json: fingerprint, status, headers>``, a newline and the
stored body; lease and expiry are Redis server time (``TIME``), in ms. The claim is one
script whose write is ``SET NX PX``; completion, release, renewal and take-over are scripts
fenced by the claim's token. Redis ≥ 7.0; Valkey works the same. How each step runs, what it
gives up and what a failover can lose: ``docs/stores.md``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, ClassVar

from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from idempotency_django.conf import conf, is_number
from idempotency_django.store.base import (
    CLAIMED,
    ClaimOrRead,
    FailureKind,
    Snapshot,
    Stored,
    StoreError,
    never,
    shared,
)

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from idempotency_django.store import redis_cluster
    from idempotency_django.store.redis_cluster import CLUSTER_URLS
except ImportError as error:  # pragma: no cover - the extra is not installed
    raise ImproperlyConfigured(
        "The Redis store needs redis-py: pip install 'idempotency-django[redis]'"
    ) from error

IN_PROGRESS = "in_progress"
COMPLETED = "completed"

#: ``STORE_OPTIONS`` of this store, and their defaults.
DEFAULT_OPTIONS: dict[str, Any] = {
    "URL": "redis://127.0.0.1:6379/0",
    "KEY_PREFIX": "idem",
    "SOCKET_TIMEOUT": 1.0,  # seconds: a command that takes longer is an unknown outcome
    "CONNECT_TIMEOUT": 1.0,
    # Redis Cluster and replication (store/redis_cluster.py, docs/stores.md): a
    # cluster client (also chosen by a redis+cluster:// URL); WAIT_REPLICAS > 0 makes a claim,
    # take-over or completion wait for that many replicas (WAIT, at most WAIT_TIMEOUT_MS):
    # a claim or take-over they did not acknowledge is refused (503), a completion resent.
    "CLUSTER": False,
    "WAIT_REPLICAS": 0,
    "WAIT_TIMEOUT_MS": 200,
}

# -- scripts: the value's header is "state|token|lease|expires|" -------------------------------

_PARSE = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function header(v)
  local a = string.find(v, '|', 1, true)
  local b = string.find(v, '|', a + 1, true)
  local c = string.find(v, '|', b + 1, true)
  local d = string.find(v, '|', c + 1, true)
  return string.sub(v, 1, a - 1), string.sub(v, a + 1, b - 1),
    tonumber(string.sub(v, b + 1, c - 1)), tonumber(string.sub(v, c + 1, d - 1)), c, d
end
local function ms(n) return string.format('%.0f', n) end
-- keep a record in progress at least two leases past its lease, whatever its TTL
local function keep(key, lease_ms)
  local ttl = redis.call('PTTL', key)
  if ttl >= 0 and ttl < 3 * lease_ms then redis.call('PEXPIRE', key, 3 * lease_ms) end
end
-- a new claim's value, and its PX: its TTL, but at least three leases ('' = no TTL)
local function claimed(token, now, lease_ms, ttl, meta)
  local expires = '0'
  local px = 3 * lease_ms
  if ttl ~= '' then
    expires = ms(now + tonumber(ttl))
    px = math.max(px, tonumber(ttl))
  end
  return 'i|' .. token .. '|' .. ms(now + lease_ms) .. '|' .. expires .. '|' .. meta, px
end
"""

# KEYS[1]; ARGV: token, lease ms, ttl ms ('' = forever), meta. -> {1, now} | {0, now, old}
# A record in progress under the same token is this claim's own, sent again after its
# reply was lost: it is written again (its lease from now), and answered as claimed, so that
# a WAIT after it counts a write of this connection, as the first one's did.
_CLAIM = (
    _PARSE
    + """
local now = now_ms()
local value, px = claimed(ARGV[1], now, tonumber(ARGV[2]), ARGV[3], ARGV[4])
local old
if ARGV[3] == '' then
  old = redis.call('SET', KEYS[1], value, 'NX', 'GET')
  if not old then redis.call('PEXPIRE', KEYS[1], px) end
else
  old = redis.call('SET', KEYS[1], value, 'NX', 'PX', px, 'GET')
end
if not old then return {1, now} end
local state, token = header(old)
if state == 'i' and token == ARGV[1] then
  redis.call('SET', KEYS[1], value, 'PX', px)
  return {1, now}
end
return {0, now, old}
"""
)

# KEYS[1]; ARGV: expected token, new token, lease ms, ttl ms ('' = forever), meta. -> 1 | 0
# Takes over a record that is not in use (by Redis's clock) and is in progress (its lease
# lapsed) or past its expiry: the same condition as the database store's take-over.
_TAKE_OVER = (
    _PARSE
    + """
local old = redis.call('GET', KEYS[1])
if not old then return 0 end
local state, token, lease, expires = header(old)
if token ~= ARGV[1] then return 0 end
local now = now_ms()
local in_use = state == 'i' and lease > now
local expired = expires ~= 0 and expires <= now
if in_use or not (state == 'i' or expired) then return 0 end
local value, px = claimed(ARGV[2], now, tonumber(ARGV[3]), ARGV[4], ARGV[5])
redis.call('SET', KEYS[1], value, 'PX', px)
return 1
"""
)

# KEYS[1]; ARGV: token, ttl ms ('' = forever), the meta after its fingerprint, body. -> 1 | 0
# The claim's fingerprint is kept: the meta is '{"f": <the claim's>, ' .. ARGV[3]. A record
# this token completed already (a completion sent again after its reply was lost) is
# written again as it is, and answered 1: a WAIT after it counts a write of this connection.
_COMPLETE = (
    _PARSE
    + """
local old = redis.call('GET', KEYS[1])
if not old then return 0 end
local state, token, _, _, _, d = header(old)
if token ~= ARGV[1] then return 0 end
if state ~= 'i' then
  redis.call('SET', KEYS[1], old, 'KEEPTTL')
  return 1
end
local claimed = cjson.decode(string.sub(old, d + 1, string.find(old, '\\n', d + 1, true) - 1))
local meta = '{"f": ' .. cjson.encode(claimed['f']) .. ', ' .. ARGV[3]
local now = now_ms()
if ARGV[2] == '' then
  redis.call('SET', KEYS[1], 'c|' .. ARGV[1] .. '|0|0|' .. meta .. ARGV[4])
else
  local ttl = math.max(1, tonumber(ARGV[2]))
  redis.call('SET', KEYS[1], 'c|' .. ARGV[1] .. '|0|' .. ms(now + ttl) .. '|' .. meta
    .. ARGV[4], 'PX', ttl)
end
return 1
"""
)

# KEYS[1]; ARGV: token. -> 1 | 0
_RELEASE = (
    _PARSE
    + """
local old = redis.call('GET', KEYS[1])
if not old then return 0 end
local state, token = header(old)
if token ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""
)

# KEYS: the records (one slot); ARGV: lease ms, then one token per key. -> renewed count
_RENEW = (
    _PARSE
    + """
local now = now_ms()
local lease = tonumber(ARGV[1])
local renewed = 0
for i, key in ipairs(KEYS) do
  local old = redis.call('GET', key)
  if old then
    local state, token, _, _, c = header(old)
    if state == 'i' and token == ARGV[i + 1] then
      redis.call('SET', key, 'i|' .. token .. '|' .. ms(now + lease) .. string.sub(old, c),
        'KEEPTTL')
      keep(key, lease)
      renewed = renewed + 1
    end
  end
end
return renewed
"""
)


def record_key(prefix: str, lookup: dict[str, str]) -> str:
    """The record's key: its scope hashed (any length, any characters), inside a hash tag
    so that every key of the record lives in one cluster slot."""
    scope = "\x00".join((lookup["account"], lookup["endpoint"], lookup["key"]))
    digest = hashlib.sha256(scope.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{prefix}:{{{digest}}}"


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else str(max(1, round(seconds * 1000)))


def _meta(fingerprint: str, status: int | None = None, headers: Any = ()) -> str:
    """The record's JSON: fingerprint, status, headers. ``json.dumps`` escapes newlines, so
    the first newline after it starts the body."""
    return json.dumps({"f": fingerprint, "s": status, "h": [list(h) for h in headers]}) + "\n"


class RedisStore:
    """Records as Redis keys, expired by Redis (``STORE_OPTIONS``: ``URL``, ``KEY_PREFIX``,
    ``SOCKET_TIMEOUT``, ``CONNECT_TIMEOUT``)."""

    errors: ClassVar[tuple[type[BaseException], ...]] = (StoreError,)
    transactional: ClassVar[bool] = False
    needs_purge: ClassVar[bool] = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._client: tuple[tuple[Any, ...], Any, dict[str, Any]] | None = None

    # -- connection -------------------------------------------------------------------------

    def options(self) -> dict[str, Any]:
        given = conf.get("STORE_OPTIONS") or {}
        return {**DEFAULT_OPTIONS, **given}

    def client(self) -> Any:
        """The client for the current ``STORE_OPTIONS`` (rebuilt when they change, so that
        ``override_settings`` works); one connection pool per process (redis-py resets it
        in a forked child)."""
        options = self.options()
        signature = tuple(sorted((k, repr(v)) for k, v in options.items()))
        current = self._client
        if current is not None and current[0] == signature:
            return current[1]
        with self._lock:
            current = self._client
            if current is not None and current[0] == signature:
                return current[1]
            client = self._connect(options)
            self._client = (signature, client, options)
            return client

    def _connect(self, options: dict[str, Any]) -> Any:
        """A client that never retries on its own: a command that timed out may have run,
        and the lifecycle decides (``claims.reconnecting`` retries a lost connection once)."""
        client = redis_cluster.connect(
            options["URL"],
            cluster=bool(options["CLUSTER"]),
            socket_timeout=options["SOCKET_TIMEOUT"],
            socket_connect_timeout=options["CONNECT_TIMEOUT"],
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
        )
        self._scripts = {
            name: client.register_script(source)
            for name, source in (
                ("claim", _CLAIM),
                ("take_over", _TAKE_OVER),
                ("complete", _COMPLETE),
                ("release", _RELEASE),
                ("renew", _RENEW),
            )
        }
        return client

    def key(self, lookup: dict[str, str]) -> str:
        return record_key(str(self.options()["KEY_PREFIX"]), lookup)

    def _run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        client = self.client()
        try:
            return self._scripts[name](keys=list(keys), args=list(args), client=client)
        except redis.RedisError as error:
            raise self._translated(error) from error

    def _translated(self, error: BaseException) -> StoreError:
        return StoreError(f"Redis: {error}", self._kind(error))

    @staticmethod
    def _kind(error: BaseException) -> FailureKind:
        """A refused, lost or still-loading connection is ``unreachable`` (the one kind that
        may fail open); a timeout is not: the command may have run (an unknown outcome)."""
        if isinstance(error, redis.TimeoutError):
            return "other"
        if isinstance(error, redis.ConnectionError):
            return "unreachable"
        return "other"

    # -- the Store interface ----------------------------------------------------------------

    def claim_or_read(self, alias: str, values: dict[str, Any], fingerprint: str) -> ClaimOrRead:
        key = self.key(values)
        reply, acked = self._run_replicated(
            "claim",
            [key],
            [
                values["token"],
                _ms(_seconds(values["lease_expires_at"] - values["created_at"])),
                _ms(_ttl(values)),
                _meta(values["fingerprint"]),
            ],
        )
        if reply[0] == 1:
            self._replicated(acked, key, values["token"], "claim")
            return CLAIMED
        return _snapshot(key, bytes(reply[2]), int(reply[1]), fingerprint)

    def claim(self, alias: str, values: dict[str, Any]) -> bool:
        return self.claim_or_read(alias, values, values["fingerprint"]) == CLAIMED

    def read(self, alias: str, lookup: dict[str, str], fingerprint: str) -> Snapshot | None:
        """The record (``TIME`` and ``GET`` in one round trip), for tests and tools."""
        key = self.key(lookup)
        try:
            server_ms, value = redis_cluster.time_and_get(self.client(), key)
        except redis.RedisError as error:
            raise self._translated(error) from error
        if value is None:
            return None
        return _snapshot(key, bytes(value), server_ms, fingerprint)

    def read_stored(self, alias: str, pk: Any) -> Stored | None:
        """The stored response of a completed record: one ``GET``."""
        try:
            value = self.client().get(pk)
        except redis.RedisError as error:
            raise self._translated(error) from error
        if value is None:
            return None
        state, _token, _lease, _expires, meta, body = _parse(bytes(value))
        if state != COMPLETED:
            return None
        return _stored(meta, body)

    def take_over(self, alias: str, record: Snapshot, values: dict[str, Any]) -> bool:
        reply, acked = self._run_replicated(
            "take_over",
            [record.pk],
            [
                record.token,
                values["token"],
                _ms(_seconds(values["lease_expires_at"] - values["created_at"])),
                _ms(_ttl(values)),
                _meta(values["fingerprint"]),
            ],
        )
        if reply == 1:
            self._replicated(acked, record.pk, values["token"], "take-over")
        return bool(reply == 1)

    def complete(
        self, alias: str, lookup: dict[str, str], token: str, values: dict[str, Any]
    ) -> bool:
        key = self.key(lookup)
        ttl = None if values["expires_at"] >= never() else values["expires_at"]
        ttl_seconds = None if ttl is None else _seconds(ttl - values["completed_at"])
        body = values["response_body"]
        # The meta after its fingerprint (the script keeps the claim's), then "\n" and the
        # body, or "\r" for a response completed without a storable body.
        rest = json.dumps(
            {"s": values["response_status"], "h": [list(h) for h in values["response_headers"]]}
        )[1:]
        reply, acked = self._run_replicated(
            "complete",
            [key],
            [
                token,
                _ms(ttl_seconds),
                rest + ("\n" if body is not None else "\r"),
                b"" if body is None else bytes(body),
            ],
        )
        if reply == 1:
            self._outcome_replicated(acked)
        return bool(reply == 1)

    def is_completed(self, alias: str, lookup: dict[str, str], token: str) -> bool:
        try:
            value = self.client().get(self.key(lookup))
        except redis.RedisError as error:
            raise self._translated(error) from error
        if value is None:
            return False
        state, stored_token, *_ = _parse(bytes(value))
        return state == COMPLETED and stored_token == token

    def release(self, alias: str, lookup: dict[str, str], token: str) -> int:
        return int(self._run("release", [self.key(lookup)], [token]))

    def renew(
        self, alias: str, claims: Sequence[tuple[dict[str, str], str]], lease: float, timeout: float
    ) -> int:
        """Renew every claim: one script per group of keys (``groups``: all of them on a
        single Redis, one round trip; a cluster groups them per slot)."""
        client = self.client()
        if redis_cluster.is_cluster(client):
            return self._renew_per_node(client, claims, lease)
        renewed = 0
        for group in self.groups([(self.key(lookup), token) for lookup, token in claims]):
            keys = [key for key, _ in group]
            tokens = [token for _, token in group]
            renewed += int(self._run("renew", keys, [_ms(lease), *tokens]))
        return renewed

    def groups(self, claims: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
        """The ``(key, token)`` pairs one renewal script may take together: all of them on a
        single Redis. (A cluster client groups them by slot: a script's keys share one.)"""
        return [claims] if claims else []

    def failure_kind(self, alias: str, error: BaseException) -> FailureKind:
        if isinstance(error, StoreError):
            return error.kind
        return self._kind(error) if isinstance(error, redis.RedisError) else "other"

    def in_transaction(self, alias: str) -> bool:
        return False

    def reset(self, alias: str) -> None:
        current = self._client
        if current is not None:
            redis_cluster.disconnect(current[1])

    # -- Redis Cluster and WAIT (store/redis_cluster.py) -------------------------------------

    def _renew_per_node(
        self, client: Any, claims: Sequence[tuple[dict[str, str], str]], lease: float
    ) -> int:
        """On a cluster a script's keys must share a slot: the renewal script once per
        claim, in one round trip per master (``redis_cluster.eval_per_node``)."""
        calls = [(self.key(lookup), [_ms(lease), token]) for lookup, token in claims]
        try:
            replies = redis_cluster.eval_per_node(client, self._scripts["renew"], calls)
        except redis.RedisError as error:
            raise self._translated(error) from error
        return sum(int(reply) for reply in replies if not isinstance(reply, Exception))

    def _run_replicated(
        self, name: str, keys: Sequence[str], args: Sequence[Any]
    ) -> tuple[Any, int | None]:
        """``_run``, then with ``WAIT_REPLICAS`` a ``WAIT`` on the same connection in the same
        round trip: the reply, and how many replicas acknowledged it (None: not asked)."""
        options = self.options()
        replicas = int(options["WAIT_REPLICAS"])
        if not replicas:
            return self._run(name, keys, args), None
        client, script = self.client(), self._scripts[name]
        timeout = int(options["WAIT_TIMEOUT_MS"])
        try:
            try:
                command = ["EVALSHA", script.sha, len(keys), *keys, *args]
                reply, acked = redis_cluster.write_and_wait(
                    client, keys[0], command, replicas, timeout
                )
            except redis.exceptions.NoScriptError:
                # The node that answered lacks it (a promoted replica): EVAL caches it there.
                command = ["EVAL", script.script, len(keys), *keys, *args]
                reply, acked = redis_cluster.write_and_wait(
                    client, keys[0], command, replicas, timeout
                )
        except redis.RedisError as error:
            raise self._translated(error) from error
        return reply, acked

    def _replicated(self, acked: int | None, key: str, token: str, what: str) -> None:
        """A claim or take-over that fewer replicas than ``WAIT_REPLICAS`` acknowledged is
        not trusted: a failover now would lose it and let a retry run the view again. It
        is released (fenced by its token: ``key`` is the record's key, as a take-over's
        values do not name its scope) and refused as a store failure (503; never
        ``unreachable``, so never run unprotected: the store did answer)."""
        wanted = int(self.options()["WAIT_REPLICAS"])
        if acked is None or acked >= wanted:
            return
        # If the release fails too, the claim's lease lapses: nobody renews a refused claim.
        with contextlib.suppress(StoreError):
            self._run("release", [key], [token])
        raise StoreError(
            f"Redis: the {what} reached {acked} of {wanted} replicas "
            f"within {self.options()['WAIT_TIMEOUT_MS']} ms (WAIT_REPLICAS)",
            "other",
        )

    def _outcome_replicated(self, acked: int | None) -> None:
        """A completion that fewer replicas than ``WAIT_REPLICAS`` acknowledged is a
        failed one: a failover now would lose it, and let a retry run the work again. The
        lifecycle sends it again (the script writes its own completed record again, which
        the next WAIT counts) until the claim's lease may lapse."""
        wanted = int(self.options()["WAIT_REPLICAS"])
        if acked is not None and acked < wanted:
            raise StoreError(
                f"Redis: the completion reached {acked} of {wanted} replicas "
                f"within {self.options()['WAIT_TIMEOUT_MS']} ms (WAIT_REPLICAS)",
                "other",
            )

    def usable(self, alias: str) -> bool:
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            self.reset(alias)
            return False

    # -- checks -----------------------------------------------------------------------------

    @staticmethod
    def check_options(value: Any) -> list[checks.CheckMessage]:
        """E026: ``STORE_OPTIONS`` that this store cannot use."""
        problems: list[str] = []
        if not isinstance(value, dict):
            problems.append(f"STORE_OPTIONS is {value!r}, not a dict")
        else:
            unknown = sorted(set(value) - set(DEFAULT_OPTIONS))
            problems += [f"unknown option {name!r}" for name in unknown]
            options = {**DEFAULT_OPTIONS, **value}
            if not isinstance(options["URL"], str) or not options["URL"].startswith(
                ("redis://", "rediss://", "unix://", "valkey://", "valkeys://", *CLUSTER_URLS)
            ):
                problems.append(f"URL {options['URL']!r} is not a redis:// URL")
            if not isinstance(options["KEY_PREFIX"], str) or not options["KEY_PREFIX"]:
                problems.append(f"KEY_PREFIX {options['KEY_PREFIX']!r} is not a non-empty string")
            elif any(ch in options["KEY_PREFIX"] for ch in "{}"):
                problems.append("KEY_PREFIX holds a brace, which would change the hash tag")
            for name in ("SOCKET_TIMEOUT", "CONNECT_TIMEOUT"):
                if not is_number(options[name]) or options[name] <= 0:
                    problems.append(f"{name} {options[name]!r} is not a number of seconds > 0")
            problems += redis_cluster.option_problems(options)
        return [
            checks.Error(
                f"IDEMPOTENCY['STORE_OPTIONS'] for RedisStore: {problem}.",
                hint=(
                    "Give {'URL': 'redis://host:6379/0', 'KEY_PREFIX': 'idem', "
                    "'SOCKET_TIMEOUT': 1.0, 'CONNECT_TIMEOUT': 1.0} (any of them)."
                ),
                id="idempotency_django.E026",
            )
            for problem in problems
        ]


def _seconds(delta: timedelta) -> float:
    return delta.total_seconds()


def _ttl(values: dict[str, Any]) -> float | None:
    expires: datetime = values["expires_at"]
    return None if expires >= never() else _seconds(expires - values["created_at"])


def _parse(value: bytes) -> tuple[str, str, int, int, dict[str, Any], bytes | None]:
    """``state, token, lease_ms, expires_ms, meta, body`` (body None: not stored)."""
    state, token, lease, expires, rest = value.split(b"|", 4)
    end = rest.find(b"\n")
    if end < 0:  # completed without a storable body: the meta ends with "\r"
        meta, body = rest.rstrip(b"\r"), None
    else:
        meta, body = rest[:end], rest[end + 1 :]
    return (
        IN_PROGRESS if state == b"i" else COMPLETED,
        token.decode(),
        int(lease),
        int(expires),
        json.loads(meta),
        body,
    )


def _stored(meta: dict[str, Any], body: bytes | None) -> Stored:
    return Stored(
        status=int(meta["s"]),
        headers=[(str(name), str(value)) for name, value in meta["h"]],
        body=body,
    )


def _snapshot(key: str, value: bytes, server_ms: int, fingerprint: str) -> Snapshot:
    """The record as ``claims`` reads it, its lease and expiry moved onto this process's
    clock (``now`` + what is left of them by Redis's clock)."""
    state, token, lease, expires, meta, body = _parse(value)
    now = timezone.now()
    completed = state == COMPLETED
    return Snapshot(
        pk=key,
        state=state,
        token=token,
        fingerprint=str(meta["f"]),
        lease_expires_at=None if completed else now + timedelta(milliseconds=lease - server_ms),
        expires_at=never() if expires == 0 else now + timedelta(milliseconds=expires - server_ms),
        response_status=meta["s"],
        stored=_stored(meta, body) if completed and meta["f"] == fingerprint else None,
    )


store = RedisStore()
shared(store)
