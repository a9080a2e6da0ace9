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
import copy
import hashlib
import importlib
import json
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any, ClassVar, TypeVar

from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from idempotency_django.conf import conf, is_number
from idempotency_django.store.base import (
    CLAIMED,
    ClaimOrRead,
    Completion,
    FailureKind,
    Record,
    Scope,
    Snapshot,
    Stored,
    StoreError,
    Times,
    Write,
    never,
    shared,
    store_alias,
)

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from idempotency_django.store import redis_cluster, redis_sentinel
    from idempotency_django.store.redis_cluster import CLUSTER_URLS
    from idempotency_django.store.redis_sentinel import SENTINEL_URLS
except ImportError as error:  # pragma: no cover - the extra is not installed
    raise ImproperlyConfigured(
        "The Redis store needs redis-py: pip install 'idempotency-django[redis]'"
    ) from error

T = TypeVar("T")

CLIENT_ERRORS: tuple[type[BaseException], ...] = (
    redis.RedisError,
    redis.exceptions.RedisClusterException,  # not a RedisError: SlotNotCoveredError, ...
)
"""What a redis-py client raises when Redis or a Redis Cluster fails: every call of the
store translates them (``_kind``), so that none reaches a view or a task."""

# Exhaustion, not absence: the client's pool is full (MaxConnectionsError, or
# BlockingConnectionPool's wait ran out), or the server is at its ``maxclients``. Redis is
# there and answering others; failing open now would let whoever filled it run views
# unprotected. redis-py raises them as ConnectionError (older versions by message only).
_THERE_TYPES = tuple(
    getattr(redis.exceptions, name)
    for name in (
        "MaxConnectionsError",
        "MaxClientsReachedError",
        "AuthenticationError",  # and credentials refused: no reconnect changes that either
        "AuthorizationError",
    )
    if hasattr(redis.exceptions, name)  # redis-py 8.2 has them all; older ones fewer
)
_EXHAUSTED_WORDS = ("too many connections", "no connection available", "max number of clients")
# A cluster that no startup node answers (redis-py >= 8.2 raises the subclass
# RedisClusterUnreachableError; older versions a RedisClusterException saying so).
_CLUSTER_UNREACHABLE_WORDS = "cluster cannot be connected"
_NO_ANSWER = (redis.ConnectionError, redis.TimeoutError, OSError)
# The cluster says it is down (CLUSTERDOWN, MASTERDOWN: a failover under way), or no node
# serves the key's slot: the command was refused before it ran. Also when redis-py then
# failed to read a new map ("All slots are not covered"), which it raises instead.
_CLUSTER_DOWN = (redis.exceptions.ClusterDownError, redis.exceptions.SlotNotCoveredError)

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
    # Redis Sentinel (store/redis_sentinel.py, docs/stores.md): the store talks to the
    # master the Sentinels name (also chosen by a redis+sentinel:// URL); URL then gives
    # the master's database and credentials, its host is not used.
    "SENTINELS": (),
    "SERVICE_NAME": "",
    "SENTINEL_PASSWORD": None,
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

# KEYS[1]; ARGV: token. -> 1 | 0. Only the claim's own record, and only in progress: a
# completed record is never deleted by a late release (a resend whose first reply was lost).
_RELEASE = (
    _PARSE
    + """
local old = redis.call('GET', KEYS[1])
if not old then return 0 end
local state, token = header(old)
if state ~= 'i' or token ~= ARGV[1] then return 0 end
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


def record_key(prefix: str, scope: Scope) -> str:
    """The record's key: its scope hashed (any length, any characters), inside a hash tag
    so that every key of the record lives in one cluster slot."""
    joined = "\x00".join((scope.account, scope.endpoint, scope.key))
    digest = hashlib.sha256(joined.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{prefix}:{{{digest}}}"


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else str(max(1, round(seconds * 1000)))


def _meta(fingerprint: str, status: int | None = None, headers: Any = ()) -> str:
    """The record's JSON: fingerprint, status, headers. ``json.dumps`` escapes newlines, so
    the first newline after it starts the body."""
    return f'{{"f": {json.dumps(fingerprint)}, {_status_and_headers(status, headers)}\n'


def _status_and_headers(status: int | None, headers: Any) -> str:
    """``"s": <status>, "h": [[name, value], ...]}``: the meta's end, as ``json.dumps`` of
    the whole dict writes it (a str and a list encode on C's fast paths, a dict does not)."""
    encoded = "[]" if not headers else json.dumps([list(h) for h in headers])
    return f'"s": {"null" if status is None else int(status)}, "h": {encoded}}}'


class RedisStore:
    """Records as Redis keys, expired by Redis (``STORE_OPTIONS``: ``URL``, ``KEY_PREFIX``,
    ``SOCKET_TIMEOUT``, ``CONNECT_TIMEOUT``)."""

    errors: ClassVar[tuple[type[BaseException], ...]] = (StoreError,)
    transactional: ClassVar[bool] = False
    needs_purge: ClassVar[bool] = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._client: tuple[tuple[Any, ...], Any, dict[str, Any]] | None = None
        self._options: tuple[Any, dict[str, Any]] | None = None  # (given, merged): ``options``
        # The heartbeat's clients, by socket timeout (``renew``), for the same options.
        self._renewal_clients: tuple[tuple[Any, ...], dict[float, Any]] = ((), {})

    # -- connection -------------------------------------------------------------------------

    def options(self) -> dict[str, Any]:
        """``DEFAULT_OPTIONS`` with ``STORE_OPTIONS`` over them. Merged once and kept with a
        copy of what they were merged from, so that each call on the hot path costs one
        comparison (a change, even one made in place, merges them again): the object
        returned is shared, read it only."""
        given = conf.get("STORE_OPTIONS") or {}
        kept = self._options
        if kept is not None and kept[0] == given:
            return kept[1]
        options = {**DEFAULT_OPTIONS, **given}
        try:
            self._options = (copy.deepcopy(given), options)
        except Exception:  # a value that cannot be copied: merged again on every call
            self._options = None
        return options

    def client(self, options: dict[str, Any] | None = None) -> Any:
        """The client for the current ``STORE_OPTIONS`` (rebuilt when they change, so that
        ``override_settings`` works); one connection pool per process (redis-py resets it
        in a forked child). ``options``: ``options()``, read already by the caller.

        Building a cluster client asks the startup nodes for the cluster's map: a cluster
        that cannot be reached raises ``StoreError`` here, ``unreachable`` (nothing of ours
        was sent), and the next call tries again."""
        options = self.options() if options is None else options
        current = self._client
        if current is not None and current[2] is options:  # options() kept: unchanged
            return current[1]
        signature = _signature(options)
        if current is not None and current[0] == signature:
            self._client = (signature, current[1], options)
            return current[1]
        with self._lock:
            current = self._client
            if current is not None and current[0] == signature:
                return current[1]
            client = self._built(options)
            self._client = (signature, client, options)
            return client

    def _built(self, options: dict[str, Any], socket_timeout: float | None = None) -> Any:
        """``_connect``, its failure translated (``_kind(building=True)``). A URL that
        cannot be used (``ValueError``: checks ``E026``/``E029`` name it, unless silenced)
        fails every call as a store error of kind ``other``: 503, never a 500."""
        try:
            return self._connect(options, socket_timeout)
        except CLIENT_ERRORS as error:
            raise StoreError(f"Redis: {error}", self._kind(error, building=True)) from error
        except ValueError as error:
            raise StoreError(f"Redis: STORE_OPTIONS: {error}", "other") from error

    def _connect(self, options: dict[str, Any], socket_timeout: float | None = None) -> Any:
        """A client that never retries on its own: a command that timed out may have run,
        and the lifecycle decides (``shell.reconnecting`` retries a lost connection once).
        ``socket_timeout``: shorter than ``SOCKET_TIMEOUT`` (the heartbeat's, ``renew``)."""
        timeout = options["SOCKET_TIMEOUT"] if socket_timeout is None else socket_timeout
        connect_timeout = min(options["CONNECT_TIMEOUT"], timeout)
        sentinel = redis_sentinel.sentinel_config(options)
        client: Any
        if sentinel is not None:
            client = redis_sentinel.connect(
                sentinel,
                socket_timeout=timeout,
                socket_connect_timeout=connect_timeout,
                sentinel_password=options["SENTINEL_PASSWORD"],
                retry=Retry(NoBackoff(), 0),
                retry_on_timeout=False,
            )
        else:
            client = redis_cluster.connect(
                options["URL"],
                cluster=bool(options["CLUSTER"]),
                socket_timeout=timeout,
                socket_connect_timeout=connect_timeout,
                retry=Retry(NoBackoff(), 0),
                retry_on_timeout=False,
            )
        if socket_timeout is not None:
            return client
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

    # -- the database alias: not this store's, whose records are in Redis ------------------

    @property
    def alias(self) -> str:
        return store_alias()

    def bind(self, alias: str) -> RedisStore:
        """This store: it keeps no record in the database, whatever the alias."""
        return self

    def key(self, scope: Scope, options: dict[str, Any] | None = None) -> str:
        return record_key(str((options or self.options())["KEY_PREFIX"]), scope)

    def _call(self, operation: Callable[[Any], T], client: Any = None) -> T:
        """``operation(client)``, any failure of the client a ``StoreError``: every call the
        store makes to Redis goes through here (or ``client()``, for building it)."""
        try:
            return operation(self.client() if client is None else client)
        except CLIENT_ERRORS as error:
            raise self._translated(error) from error

    def _run(self, name: str, keys: Sequence[str], args: Sequence[Any], client: Any = None) -> Any:
        # self._scripts: registered when the client is built (by _call's client())
        return self._call(lambda client: _evalsha(client, self._scripts[name], keys, args), client)

    def _translated(self, error: BaseException) -> StoreError:
        return StoreError(f"Redis: {error}", self._kind(error))

    @staticmethod
    def _kind(error: BaseException, *, building: bool = False) -> FailureKind:
        """``unreachable`` (the one kind that may fail open) only where Redis could not be
        reached and nothing of ours ran: a refused, lost or still-loading connection; a
        cluster that no node answers (``RedisClusterUnreachableError``), that is down
        (``CLUSTERDOWN``, ``MASTERDOWN``) or that covers no slot for the key. Everything
        else is ``other`` (503, never an unprotected run):

        - a timeout anywhere in the error's chain: the command may have run (an unknown
          outcome); redis-py reports a command that timed out while the cluster could not
          be rediscovered as ``RedisClusterUnreachableError`` caused by that timeout;
        - exhaustion: a full pool (``MaxConnectionsError``, "No connection available"), a
          server at its ``maxclients``; and credentials refused. Redis is there, answering
          others: failing open would let whoever exhausted it run views unprotected;
        - any other cluster error (``TRYAGAIN``, ``READONLY``, too many redirections, ...).

        ``building``: raised while the client was built (a cluster client reads the map
        from its startup nodes): nothing was sent, so a timeout there is unreachable too.
        """
        chain = list(_chain(error))
        if any(_there(link) for link in chain):
            return "other"
        if not building and any(isinstance(link, redis.TimeoutError) for link in chain):
            return "other"
        if isinstance(error, redis.ConnectionError):
            return "unreachable"
        if any(isinstance(link, _CLUSTER_DOWN) for link in chain):
            return "unreachable"  # refused before it ran: no node serves the key now
        if (
            isinstance(error, redis.exceptions.RedisClusterException)
            and _CLUSTER_UNREACHABLE_WORDS in str(error).lower()
            and any(isinstance(link, _NO_ANSWER) for link in chain[1:])
        ):
            return "unreachable"  # not "no startup node is a cluster": a misconfiguration
        return "other"

    # -- the Store interface ----------------------------------------------------------------

    def claim_or_read(self, write: Write) -> ClaimOrRead:
        options = self.options()  # read once per call: the hot path's (docs/performance.md)
        key = self.key(write.scope, options)
        reply, acked = self._run_replicated(
            "claim",
            [key],
            [
                write.token,
                _ms(_seconds(write.lease)),
                _ms(None if write.ttl is None else _seconds(write.ttl)),
                _meta(write.fingerprint),
            ],
            options,
        )
        if reply[0] == 1:
            self._replicated(acked, key, write.token, "claim")
            return CLAIMED
        return _snapshot(key, bytes(reply[2]), int(reply[1]), write.fingerprint)

    def claim(self, write: Write) -> bool:
        return self.claim_or_read(write) == CLAIMED

    def read(self, scope: Scope, fingerprint: str) -> Snapshot | None:
        """The record (``TIME`` and ``GET`` in one round trip), for tests and tools."""
        key = self.key(scope)
        server_ms, value = self._call(lambda client: redis_cluster.time_and_get(client, key))
        if value is None:
            return None
        return _snapshot(key, bytes(value), server_ms, fingerprint)

    def read_stored(self, pk: Any) -> Stored | None:
        """The stored response of a completed record: one ``GET``."""
        value = self._call(lambda client: client.get(pk))
        if value is None:
            return None
        state, _token, _lease, _expires, meta, body = _parse(bytes(value))
        if state != COMPLETED:
            return None
        return _stored(meta, body)

    def take_over(self, record: Snapshot, write: Write) -> bool:
        reply, acked = self._run_replicated(
            "take_over",
            [record.pk],
            [
                record.token,
                write.token,
                _ms(_seconds(write.lease)),
                _ms(None if write.ttl is None else _seconds(write.ttl)),
                _meta(write.fingerprint),
            ],
        )
        if reply == 1:
            self._replicated(acked, record.pk, write.token, "take-over")
        return bool(reply == 1)

    def complete(self, scope: Scope, token: str, completion: Completion) -> bool:
        options = self.options()
        key = self.key(scope, options)
        ttl_seconds = None if completion.ttl is None else _seconds(completion.ttl)
        body = completion.body
        # The meta after its fingerprint (the script keeps the claim's), then "\n" and the
        # body, or "\r" for a response completed without a storable body.
        rest = _status_and_headers(completion.status, completion.headers)
        reply, acked = self._run_replicated(
            "complete",
            [key],
            [
                token,
                _ms(ttl_seconds),
                rest + ("\n" if body is not None else "\r"),
                b"" if body is None else bytes(body),
            ],
            options,
        )
        if reply == 1:
            self._outcome_replicated(acked)
        return bool(reply == 1)

    def is_completed(self, scope: Scope, token: str) -> bool:
        key = self.key(scope)
        value = self._call(lambda client: client.get(key))
        if value is None:
            return False
        state, stored_token, *_ = _parse(bytes(value))
        return state == COMPLETED and stored_token == token

    def release(self, scope: Scope, token: str) -> int:
        return int(self._run("release", [self.key(scope)], [token]))

    def renew(self, claims: Sequence[tuple[Scope, str]], lease: float, timeout: float) -> int:
        """Renew every claim: one script per group of keys (``groups``: all of them on a
        single Redis, one round trip; a cluster groups them per slot). Each round trip is
        bounded by ``timeout`` where it is shorter than ``SOCKET_TIMEOUT`` (``_renewal``),
        as the database store bounds its statement: a renewal must not outlast a beat."""
        client = self._renewal(timeout)
        if redis_cluster.is_cluster(client):
            return self._renew_per_node(client, claims, lease)
        renewed = 0
        for group in self.groups([(self.key(scope), token) for scope, token in claims]):
            keys = [key for key, _ in group]
            tokens = [token for _, token in group]
            renewed += int(self._run("renew", keys, [_ms(lease), *tokens], client))
        return renewed

    def _renewal(self, timeout: float) -> Any:
        """The client to renew with: the store's own, or one whose socket (and connect)
        timeout is ``timeout`` when that is shorter than ``SOCKET_TIMEOUT``. One per
        distinct timeout (the heartbeat's is a third of the shortest lease: a handful per
        process), built once and kept with the options they were built for."""
        client = self.client()
        options = self.options()
        if not 0 < timeout < options["SOCKET_TIMEOUT"]:
            return client
        signature = _signature(options)
        with self._lock:
            built_for, clients = self._renewal_clients
            if built_for != signature:
                for stale in clients.values():
                    redis_cluster.disconnect(stale)
                clients = {}
                self._renewal_clients = (signature, clients)
            found = clients.get(timeout)
            if found is None:
                found = clients[timeout] = self._built(options, socket_timeout=timeout)
            return found

    def groups(self, claims: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
        """The ``(key, token)`` pairs one renewal script may take together: all of them on a
        single Redis. (A cluster client groups them by slot: a script's keys share one.)"""
        return [claims] if claims else []

    def failure_kind(self, error: BaseException) -> FailureKind:
        if isinstance(error, StoreError):
            return error.kind
        return self._kind(error) if isinstance(error, CLIENT_ERRORS) else "other"

    def in_transaction(self) -> bool:
        return False

    def reset(self) -> None:
        """Before a retry on a new connection: close the pool's idle connections, which may
        be as dead as the one that failed (a restarted server), never those other threads
        are using. redis-py has already closed the connection that raised; on a cluster it
        has also asked for a new map."""
        current = self._client
        if current is not None:
            redis_cluster.disconnect(current[1], in_use=False)

    # -- Redis Cluster and WAIT (store/redis_cluster.py) -------------------------------------

    def _renew_per_node(
        self, client: Any, claims: Sequence[tuple[Scope, str]], lease: float
    ) -> int:
        """On a cluster a script's keys must share a slot: the renewal script once per
        claim, in one round trip per master (``redis_cluster.eval_per_node``)."""
        calls = [(self.key(scope), [_ms(lease), token]) for scope, token in claims]
        replies = self._call(
            lambda client: redis_cluster.eval_per_node(client, self._scripts["renew"], calls),
            client,
        )
        return sum(int(reply) for reply in replies if not isinstance(reply, Exception))

    def _run_replicated(
        self,
        name: str,
        keys: Sequence[str],
        args: Sequence[Any],
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, int | None]:
        """``_run``, then with ``WAIT_REPLICAS`` a ``WAIT`` on the same connection in the same
        round trip: the reply, and how many replicas acknowledged it (None: not asked)."""
        options = self.options() if options is None else options
        replicas = int(options["WAIT_REPLICAS"])
        client = self.client(options)  # raises StoreError itself (_built)
        if not replicas:
            return self._run(name, keys, args, client), None
        script = self._scripts[name]
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
        except CLIENT_ERRORS as error:
            raise self._translated(error) from error
        return reply, acked

    def _replicated(self, acked: int | None, key: str, token: str, what: str) -> None:
        """A claim or take-over that fewer replicas than ``WAIT_REPLICAS`` acknowledged is
        not trusted: a failover now would lose it and let a retry run the view again. It
        is released (fenced by its token: ``key`` is the record's key, as a take-over's
        values do not name its scope) and refused as a store failure (503; never
        ``unreachable``, so never run unprotected: the store did answer)."""
        if acked is None:  # WAIT_REPLICAS is 0: nothing was asked of the replicas
            return
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
        if acked is None:  # WAIT_REPLICAS is 0: nothing was asked of the replicas
            return
        wanted = int(self.options()["WAIT_REPLICAS"])
        if acked is not None and acked < wanted:
            raise StoreError(
                f"Redis: the completion reached {acked} of {wanted} replicas "
                f"within {self.options()['WAIT_TIMEOUT_MS']} ms (WAIT_REPLICAS)",
                "other",
            )

    def ping(self, timeout: float) -> None:
        """One round trip (``PING``), bounded by ``timeout`` where it is shorter than
        ``SOCKET_TIMEOUT`` (the renewal's client of that timeout): the health check's. On a
        cluster, the node the client asks first; a ``StoreError`` when it does not answer."""
        bounded = self._renewal(timeout)
        if not self._call(lambda client: client.ping(), bounded):
            raise StoreError("Redis: PING was not answered PONG", "other")

    def bounded_reads(self, timeout: float) -> AbstractContextManager[None]:
        """Nothing to bound: the health check reads nothing else from Redis."""
        return contextlib.nullcontext()

    def oldest_expired(self) -> datetime | None:
        """Always ``None``: Redis deletes a key when its TTL runs out, so no expired record
        is ever left to purge (a purge lag does not apply to this store)."""
        return None

    def usable(self) -> bool:
        try:
            return bool(self._call(lambda client: client.ping()))
        except StoreError:
            self.reset()
            return False

    # -- checks -----------------------------------------------------------------------------

    def eviction_policy(self) -> str | None:
        """The ``maxmemory-policy`` of the store's Redis (on a cluster, the first master's
        that is not ``noeviction``), or ``None`` when the server does not tell: ``CONFIG``
        disabled or renamed (as on many managed services), refused by an ACL, or the server
        unreachable. Under any policy but ``noeviction`` Redis evicts keys when it runs out
        of memory, a claim or a stored outcome among them, and a retry then runs the work
        again. Read by the system check ``W040`` (and for a health check to call)."""
        try:
            client = self.client()
            if redis_cluster.is_cluster(client):
                replies = [
                    client.config_get("maxmemory-policy", target_nodes=node)
                    for node in client.get_primaries()
                ]
            else:
                replies = [client.config_get("maxmemory-policy")]
        except (redis.RedisError, StoreError):  # unreachable (a cluster no node answers), a bad URL
            return None
        policies = [reply.get("maxmemory-policy") for reply in replies]
        if not policies or None in policies:
            return None
        return next((p for p in policies if p != "noeviction"), "noeviction")

    @staticmethod
    def check_options(value: Any) -> list[checks.CheckMessage]:
        """E026: ``STORE_OPTIONS`` that this store cannot use."""
        problems: list[str] = []
        sentinel_problems: list[str] = []
        if not isinstance(value, dict):
            problems.append(f"STORE_OPTIONS is {value!r}, not a dict")
        else:
            unknown = sorted(set(value) - set(DEFAULT_OPTIONS))
            problems += [f"unknown option {name!r}" for name in unknown]
            options = {**DEFAULT_OPTIONS, **value}
            if not isinstance(options["URL"], str) or not options["URL"].startswith(
                (
                    *("redis://", "rediss://", "unix://", "valkey://", "valkeys://"),
                    *CLUSTER_URLS,
                    *SENTINEL_URLS,
                )
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
            sentinel_problems = redis_sentinel.option_problems(options)
        errors: list[checks.CheckMessage] = [
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
        return errors + [
            checks.Error(
                f"IDEMPOTENCY['STORE_OPTIONS'] for RedisStore: {problem}.",
                hint=(
                    "Give {'URL': 'redis+sentinel://host1:26379,host2:26379/mymaster/0'}, "
                    "or {'SENTINELS': [('host1', 26379), ('host2', 26379)], "
                    "'SERVICE_NAME': 'mymaster'} with a redis:// URL for the database."
                ),
                id="idempotency_django.E029",
            )
            for problem in sentinel_problems
        ]

    # -- inspection (``base.Inspects``): tests and tools, never a request's path -------------

    def keeps_own_clock(self) -> bool:
        return True  # Redis's TIME

    def remember_scopes(self) -> None:
        """A key is a digest of its scope: from now on, this instance's ``key`` notes the
        scope of each key it makes (in this process), which ``records`` then names. An
        instance attribute over the method, so that the request path pays nothing for it
        until a test asks."""
        if "key" in self.__dict__:
            return
        named = self._named
        plain: Callable[[Scope, dict[str, Any] | None], str] = RedisStore.key.__get__(self)

        def key(scope: Scope, options: dict[str, Any] | None = None) -> str:
            made = plain(scope, options)
            named[made] = scope
            return made

        self.key = key  # type: ignore[method-assign]

    @property
    def _named(self) -> dict[str, Scope]:
        return self.__dict__.setdefault("_scopes", {})  # type: ignore[no-any-return]

    def records(self) -> list[Record]:
        client = self.client()
        pattern = f"{self.options()['KEY_PREFIX']}:*"
        keys = sorted(
            {k.decode() if isinstance(k, bytes) else k for k in client.scan_iter(pattern)}
        )
        found = [self._inspected(client, key) for key in keys]
        return [record for record in found if record is not None]

    def _inspected(self, client: Any, key: str) -> Record | None:
        value = client.get(key)
        if value is None:
            return None
        state, token, lease, expires, meta, body = _parse(bytes(value))
        scope = self._named.get(key)
        completed = state == COMPLETED
        return Record(
            pk=key,
            account=None if scope is None else scope.account,
            endpoint=None if scope is None else scope.endpoint,
            key=None if scope is None else scope.key,
            state=state,
            token=token,
            fingerprint=str(meta["f"]),
            lease_expires_at=None if completed or lease == 0 else _at(lease),
            expires_at=never() if expires == 0 else _at(expires),
            response_status=meta.get("s"),
            response_headers=[[str(n), str(v)] for n, v in meta.get("h", [])]
            if completed
            else None,
            response_body=body if completed else None,
        )

    def put(self, record: Record, fields: Collection[str] | None = None) -> Record:
        """Writes ``record`` whole, as the store would have (its times moved onto Redis's
        clock: Redis runs on this machine, one clock); a record past its expiry is kept a
        minute, as if Redis had not evicted it yet."""
        client = self.client()
        if record.pk is None:
            assert record.account is not None
            assert record.endpoint is not None
            assert record.key is not None
            record = replace(
                record, pk=self.key(Scope(record.account, record.endpoint, record.key))
            )
        key = record.pk
        server_ms = int(redis_cluster.time_and_get(client, key)[0])

        def ms(when: datetime) -> int:
            return round(when.timestamp() * 1000)

        completed = record.state == COMPLETED
        lease = 0 if completed or record.lease_expires_at is None else ms(record.lease_expires_at)
        expires = 0 if record.expires_at >= never() else ms(record.expires_at)
        meta: dict[str, Any] = {"f": record.fingerprint}
        if completed:
            meta.update(
                s=record.response_status, h=[list(h) for h in record.response_headers or []]
            )
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
        return record

    def drop(self, record: Record) -> None:
        self.client().delete(record.pk)

    def age(self, delta: timedelta) -> list[Any]:
        """Also each key's PTTL ``delta`` shorter: the keys Redis would have expired by
        then are deleted (``_AGE``)."""
        ms = round(delta.total_seconds() * 1000)
        client = self.client()
        run = self._inspection_script(_AGE)
        return [
            record.pk
            for record in self.records()
            if run(keys=[record.pk], args=[ms], client=client) == 1
        ]

    def retime(self, pk: Any, times: Times) -> Times | None:
        def arg(ms: int | None) -> str:
            return "" if ms is None else str(ms)

        now, old, pttl = self._inspection_script(_RETIME)(
            keys=[pk],
            args=[arg(times.lease), arg(times.expires), arg(times.pttl)],
            client=self.client(),
        )
        if old is None:
            return None
        _state, _token, lease, expires, _meta, _body = _parse(bytes(old))
        return Times(
            lease=None if lease == 0 else lease - int(now),
            expires=None if expires == 0 else expires - int(now),
            pttl=None if pttl < 0 else int(pttl),
        )

    def _inspection_script(self, source: str) -> Any:
        client = self.client()
        scripts = self.__dict__.setdefault("_inspection_scripts", {})
        found = scripts.get((id(client), source))
        if found is None:
            found = scripts[(id(client), source)] = client.register_script(source)
        return found


def _at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=dt_timezone.utc)


# Inspection's scripts (``age``, ``retime``): a test that fakes the time moves the records
# instead, since leases and expiry run on Redis's clock.

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


def _evalsha(client: Any, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
    """``script`` on ``keys`` and ``args``: ``EVALSHA`` on one connection of the client's
    pool, its reply read there (and ``EVAL`` on the same connection if the server does
    not have the script yet: one more round trip, none to load it). What redis-py's
    ``Script`` call does, without its per-command machinery (retries, which this store
    turns off, timing hooks), which cost more CPU than the round trip's own work. A
    connection that failed is closed, as redis-py closes it; a cluster client (which
    routes by slot) takes redis-py's own path."""
    if type(client) is not redis.Redis or client.connection is not None:
        return script(keys=list(keys), args=list(args), client=client)
    pool = client.connection_pool
    connection: Any = pool.get_connection()  # redis-py leaves its methods unannotated
    try:
        try:
            connection.send_packed_command(
                _packed(connection.encoder, ("EVALSHA", script.sha, len(keys), *keys, *args))
            )
            return connection.read_response()
        except redis.exceptions.NoScriptError:
            connection.send_packed_command(
                _packed(connection.encoder, ("EVAL", script.script, len(keys), *keys, *args))
            )
            return connection.read_response()
    except (redis.ConnectionError, redis.TimeoutError):
        connection.disconnect()
        raise
    finally:
        try:
            if getattr(connection, "should_reconnect", bool)():  # a maintenance notice
                connection.disconnect()
                connection.connect()
        finally:
            pool.release(connection)


_LARGE = 6000  # bytes: a value this long is sent as a chunk of its own, not copied
_pack_command: Callable[[tuple[Any, ...]], bytes] | None
try:
    _pack_command = importlib.import_module("hiredis").pack_command
except ImportError:  # pragma: no cover - without the hiredis extra
    _pack_command = None


def _packed(encoder: Any, parts: Sequence[Any]) -> list[bytes]:
    """A command in RESP, as redis-py packs it (strings in the client's encoding, bytes as
    they are, integers in decimal; anything else through the client's encoder), in chunks
    for ``send_packed_command``: a large value (a stored body) is its own chunk. With
    hiredis (the ``hiredis`` extra) and UTF-8, redis-py's default, hiredis packs it."""
    encoding, errors = encoder.encoding, encoder.encoding_errors
    if _pack_command is not None and encoding == "utf-8" and errors == "strict":
        return [_pack_command(tuple(parts))]
    chunks: list[bytes] = []
    buffer = [b"*%d\r\n" % len(parts)]
    for part in parts:
        if type(part) is str:
            data = part.encode(encoding, errors)
        elif type(part) is bytes:
            data = part
        elif type(part) is int:
            data = b"%d" % part
        else:
            data = encoder.encode(part)
        if len(data) > _LARGE:
            buffer.append(b"$%d\r\n" % len(data))
            chunks += (b"".join(buffer), data)
            buffer = [b"\r\n"]
        else:
            buffer += (b"$%d\r\n" % len(data), data, b"\r\n")
    chunks.append(b"".join(buffer))
    return chunks


def _signature(options: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(sorted((k, repr(v)) for k, v in options.items()))


def _chain(error: BaseException | None) -> Iterator[BaseException]:
    """``error`` and what caused it, or what it was raised while handling."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _there(error: BaseException) -> bool:
    """Redis is there, and no reconnect will change its answer: the pool or the server has
    no connection to spare, or the credentials were refused (``_THERE_TYPES``)."""
    if isinstance(error, _THERE_TYPES):
        return True
    message = str(error).lower()
    return isinstance(error, redis.ConnectionError) and any(
        word in message for word in _EXHAUSTED_WORDS
    )


def _seconds(delta: timedelta) -> float:
    return delta.total_seconds()


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
