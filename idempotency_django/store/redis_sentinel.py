"""The Redis store on a master found through Redis Sentinel.

``sentinel_config`` reads where the Sentinels are and which service they watch, from a
``redis+sentinel://host:port,host:port/service/db`` URL or from ``STORE_OPTIONS``
(``SENTINELS``, ``SERVICE_NAME``); ``connect`` builds redis-py's ``Sentinel.master_for``
client: every new connection asks the Sentinels for the current master, never a replica
(a replica's copy lags: a claim or an outcome read there may be one the master has since
replaced, or one it never had). ``option_problems`` is the check ``E029``. The long story:
``docs/stores.md`` ("Redis Sentinel").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import redis
from redis.sentinel import Sentinel

SENTINEL_URLS = ("redis+sentinel://", "rediss+sentinel://")
DEFAULT_SENTINEL_PORT = 26379


@dataclass(frozen=True)
class SentinelConfig:
    """Where the Sentinels are, the service they watch, and how to talk to its master."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    ssl: bool = False


def is_sentinel_url(url: object) -> bool:
    return isinstance(url, str) and url.startswith(SENTINEL_URLS)


def sentinel_config(options: dict[str, Any]) -> SentinelConfig | None:
    """The Sentinel configuration that ``options`` name (``None``: no Sentinel). Raises
    ``ValueError`` for one that cannot be used (the check ``E029`` reports it first)."""
    url = options["URL"]
    if is_sentinel_url(url):
        return parse_url(url)
    if not options["SENTINELS"]:
        return None
    scheme, _, rest = str(url).partition("://")
    credentials, _, location = rest.rpartition("@")
    username, password = _credentials(credentials)
    _, _, path = location.partition("/")
    return SentinelConfig(
        sentinels=tuple(_address(entry) for entry in options["SENTINELS"]),
        service=str(options["SERVICE_NAME"]),
        db=_db(path),
        username=username,
        password=password,
        ssl=scheme == "rediss",
    )


def parse_url(url: str) -> SentinelConfig:
    """``redis+sentinel://[user:password@]host[:port],host[:port]/service[/db]``: the
    credentials are the master's; ``rediss+sentinel://`` talks TLS to the master."""
    scheme, _, rest = url.partition("://")
    credentials, _, location = rest.rpartition("@")
    hosts, _, path = location.partition("/")
    service, _, db = path.partition("/")
    if not service:
        raise ValueError(f"{url!r} names no service (redis+sentinel://host:port/service/db)")
    sentinels = tuple(_address(entry) for entry in hosts.split(",") if entry)
    if not sentinels:
        raise ValueError(f"{url!r} names no Sentinel")
    username, password = _credentials(credentials)
    return SentinelConfig(
        sentinels=sentinels,
        service=unquote(service),
        db=_db(db),
        username=username,
        password=password,
        ssl=scheme == "rediss+sentinel",
    )


def _credentials(text: str) -> tuple[str | None, str | None]:
    if not text:
        return None, None
    username, separator, password = text.partition(":")
    if not separator:
        return None, unquote(username)  # redis://secret@host: a password alone
    return unquote(username) or None, unquote(password)


def _db(text: str) -> int:
    text = text.strip("/")
    if not text:
        return 0
    if not text.isdigit():
        raise ValueError(f"database {text!r} is not a whole number")
    return int(text)


def _address(entry: Any) -> tuple[str, int]:
    """``("host", port)`` from a pair or a ``"host:port"`` string (``"[::1]:26379"`` for
    IPv6; the port defaults to 26379)."""
    if isinstance(entry, (list, tuple)) and len(entry) == 2:
        host, port = entry
    elif isinstance(entry, str) and entry:
        if entry.startswith("["):
            host, _, after = entry[1:].partition("]")
            port_text = after.removeprefix(":")
        else:
            host, _, port_text = entry.partition(":")
        port_text = port_text or str(DEFAULT_SENTINEL_PORT)
        if not port_text.isdigit():
            raise ValueError(f"Sentinel {entry!r} is not host:port")
        port = int(port_text)
    else:
        raise ValueError(f"Sentinel {entry!r} is not a (host, port) pair or 'host:port'")
    host = str(host)
    if not host or isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"Sentinel {entry!r} is not a host and a port 1-65535")
    return host, port


def connect(
    config: SentinelConfig,
    *,
    socket_timeout: float,
    socket_connect_timeout: float,
    sentinel_password: str | None = None,
    **options: Any,
) -> redis.Redis:
    """A client of ``config.service``'s master, as the Sentinels name it when a connection
    is made: a connection the master refuses (``READONLY``: it was demoted) is dropped and
    raises ``ConnectionError``, and the next one asks the Sentinels again. Each Sentinel is
    asked under the same timeouts as the master: a frozen one costs a timeout, then the
    next one is asked (without them, a Sentinel that accepts and never answers would hold
    every request that needs a new connection)."""
    sentinel = Sentinel(
        config.sentinels,
        sentinel_kwargs={
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": socket_connect_timeout,
            "password": sentinel_password,
        },
    )
    client: redis.Redis = sentinel.master_for(
        config.service,
        db=config.db,
        username=config.username,
        password=config.password,
        ssl=config.ssl,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_connect_timeout,
        **options,
    )
    return client


def option_problems(options: dict[str, Any]) -> list[str]:
    """What is wrong with the Redis store's Sentinel options (``URL`` when it is a
    ``redis+sentinel://`` one, ``SENTINELS``, ``SERVICE_NAME``, ``SENTINEL_PASSWORD``):
    the check ``E029``."""
    problems: list[str] = []
    url, sentinels, service = options["URL"], options["SENTINELS"], options["SERVICE_NAME"]
    password = options["SENTINEL_PASSWORD"]
    if password is not None and not isinstance(password, str):
        problems.append(f"SENTINEL_PASSWORD {password!r} is not a string or None")
    if not isinstance(service, str):
        problems.append(f"SERVICE_NAME {service!r} is not a string")
    if not isinstance(sentinels, (list, tuple)):
        return [*problems, f"SENTINELS {sentinels!r} is not a list of (host, port)"]
    uses = is_sentinel_url(url) or bool(sentinels)
    if not uses:
        if service and isinstance(service, str):
            problems.append(
                "SERVICE_NAME is given but no Sentinel (SENTINELS, or a redis+sentinel:// URL)"
            )
        return problems
    if options["CLUSTER"]:
        problems.append("CLUSTER and Sentinel together: a cluster has no Sentinels")
    if is_sentinel_url(url):
        if sentinels or service:
            problems.append(
                "a redis+sentinel:// URL and SENTINELS or SERVICE_NAME: give the Sentinels "
                "and the service in one of them"
            )
        try:
            parse_url(url)
        except ValueError as error:
            problems.append(str(error))
        return problems
    if not (isinstance(url, str) and url.startswith(("redis://", "rediss://"))):
        problems.append(f"URL {url!r} with SENTINELS is not a redis:// or rediss:// URL")
    else:
        try:
            _db(url.partition("://")[2].rpartition("@")[2].partition("/")[2])
        except ValueError as error:
            problems.append(f"URL {url!r}: {error}")
    if not service:
        problems.append("SENTINELS without a SERVICE_NAME (the name the Sentinels monitor)")
    for entry in sentinels:
        try:
            _address(entry)
        except ValueError as error:
            problems.append(str(error))
    return problems
