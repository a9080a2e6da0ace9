"""What the server saw, for the soak: every idempotency signal and warning, one JSON line each.

Each worker process appends to ``$SOAK_EVENTS_DIR/events-<pid>.jsonl`` with ``O_APPEND``
writes of one line, so a worker killed with SIGKILL loses nothing it had written. Every line
has the time and the worker's pid; a signal's line also has the database session its request
runs on (``backend``: the PostgreSQL backend pid, the MariaDB connection id), and the end of
every request is a ``request_finished`` line. With those the soak tells which executions of a
view its faults cut: a worker it killed, a connection it terminated. Nothing here changes
what the example does: it only listens.

One line is written before the store acts, not after: ``releasing``, just before a store's
``release`` (the ``DELETE`` of the claim's record, or its Redis script), from a wrapper of
that method. The ``released`` signal follows the release, so a worker killed between the
two leaves a record deleted and no ``released`` line; the ``releasing`` line tells that
case from a claim that vanished without any release (``soak.py``, rule 1).
"""

from __future__ import annotations

import json
import logging
import os
import time
from functools import partial
from typing import Any

from django.core.signals import request_finished
from django.db import connection
from django.dispatch import Signal

SIGNALS = (
    "claimed",
    "replayed",
    "in_flight",
    "mismatch",
    "released",
    "lease_taken_over",
    "completion_lost",
    "store_unavailable",
)

_fds: dict[int, int] = {}


def write(event: dict[str, Any]) -> None:
    directory = os.environ.get("SOAK_EVENTS_DIR")
    if not directory:
        return
    pid = os.getpid()
    fd = _fds.get(pid)
    if fd is None:
        path = os.path.join(directory, f"events-{pid}.jsonl")
        fd = _fds[pid] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    line = json.dumps({"t": time.time(), "pid": pid, **event}, default=str) + "\n"
    os.write(fd, line.encode())


def backend() -> int | None:
    """The database session of this thread's connection, read from the driver (no query)."""
    raw = connection.connection
    try:
        if raw is None:
            return None
        if connection.vendor == "postgresql":
            return int(raw.info.backend_pid)  # psycopg 3
        return int(raw.thread_id())  # MySQLdb
    except Exception:  # a connection already broken
        return None


def _on_signal(name: str, sender: Any, **kwargs: Any) -> None:
    write(
        {
            "event": name,
            "account": kwargs.get("account"),
            "endpoint": kwargs.get("endpoint"),
            "key": _raw_key(kwargs.get("key")),
            "status": kwargs.get("status"),
            "backend": backend(),
        }
    )


def _raw_key(digest: Any) -> Any:
    """The client's key of the signal being sent: receivers get its digest as ``key`` (so
    that a receiver that logs its arguments never carries the key), and the key itself from
    ``signals.raw_key()``, which the soak matches against the keys it sent."""
    from idempotency_django import signals

    try:
        return signals.raw_key()
    except LookupError:  # a signal not sent for one key
        return digest


def _on_request_finished(sender: Any, **kwargs: Any) -> None:
    write({"event": "request_finished"})


def connect() -> None:
    import idempotency_django
    from idempotency_django import signals

    for name in SIGNALS:
        signal = getattr(signals, name, None)  # signals added later are picked up too
        if isinstance(signal, Signal):
            signal.connect(partial(_on_signal, name), weak=False, dispatch_uid=f"soak-{name}")
    request_finished.connect(_on_request_finished, dispatch_uid="soak-request-finished")
    _record_releases()
    write({"event": "ready", "library": os.path.dirname(idempotency_django.__file__)})


def _stores() -> list[Any]:
    """The store classes the soak runs on: the database store, and the Redis store (which
    the Redis Cluster store is too) when redis is installed."""
    from idempotency_django.store.database import DatabaseStore

    try:
        from idempotency_django.store.redis import RedisStore
    except ImportError:
        return [DatabaseStore]
    return [DatabaseStore, RedisStore]


def _record_releases() -> None:
    """Wrap each store's ``release`` to write a ``releasing`` line before it runs: the
    library has no signal before a release, and its ``released`` signal comes after it."""
    for store in _stores():
        original = store.release
        if getattr(original, "soak_wrapped", False):
            continue

        def release(self: Any, scope: Any, token: str, _original: Any = original) -> Any:
            write(
                {
                    "event": "releasing",
                    "account": scope.account,
                    "endpoint": scope.endpoint,
                    "key": scope.key,
                    "backend": backend(),
                }
            )
            return _original(self, scope, token)

        release.soak_wrapped = True  # type: ignore[attr-defined]
        store.release = release


class EventLogHandler(logging.Handler):
    """Log records as events: the message, the key if the record names one, the exception."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            error = record.exc_info[1] if record.exc_info else None
            key = getattr(record, "idempotency_key", None)
            request = getattr(record, "request", None)  # django.request's records have it
            headers = getattr(request, "headers", None)
            if key is None and headers is not None:
                key = headers.get("Idempotency-Key")
            write(
                {
                    "event": "log",
                    "logger": record.name,
                    "level": record.levelname,
                    "message": record.getMessage(),
                    "account": getattr(record, "idempotency_account", None),
                    "key": key,
                    "error": None if error is None else f"{type(error).__name__}: {error}",
                }
            )
        except Exception:  # a logging handler must never raise
            self.handleError(record)
