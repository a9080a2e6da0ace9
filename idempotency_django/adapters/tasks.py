"""Run non-HTTP work at most once per key: queue redeliveries, not only HTTP retries.

``@idempotent_task`` protects one function (a Celery task, a queue consumer's handler);
``claim_once`` protects a block of code that is not one function. Both use the store the
HTTP decorator uses, with its leases, heartbeat, TTL and purge (a key is scoped by
``account = scope`` and ``endpoint = "task:<name>"``), and the one shell the HTTP
adapters use (``shell.py``), with the same rules. The result is stored as JSON, so the
admin shows it. The long story: ``docs/tasks.md``.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, ParamSpec, TypeVar, cast

from django.core.exceptions import ImproperlyConfigured

from idempotency_django import signals
from idempotency_django.conf import conf
from idempotency_django.core import claims, keys, shell
from idempotency_django.core.options import _UNSET, TASK, Options, names
from idempotency_django.exceptions import (
    InFlight,
    KeyMalformed,
    KeyMismatch,
    ResponseNotStored,
    StoreUnavailable,
    WorkNotCommitted,
)
from idempotency_django.models import ACCOUNT_MAX_LENGTH, ENDPOINT_MAX_LENGTH
from idempotency_django.store.base import Store

logger = logging.getLogger("idempotency_django")

P = ParamSpec("P")
R = TypeVar("R")

ENDPOINT_PREFIX = "task:"
RESULT_STATUS = 200
RESULT_HEADERS = [("Content-Type", "application/json")]


class TaskInFlight(InFlight):
    """The key's first run is still going on (in this or another process).

    ``retry_after`` is the number of seconds to wait before delivering again, e.g.
    ``raise self.retry(exc=exc, countdown=exc.retry_after)`` in a Celery task.
    """

    retry_after: int

    def __init__(self, detail: str, *, retry_after: int) -> None:
        super().__init__(detail, retry_after=retry_after)


class TaskKeyMismatch(KeyMismatch):
    """The key was already used for different work (different fingerprinted arguments)."""


class TaskKeyMalformed(KeyMalformed, ValueError):
    """The key is empty, blank, longer than 255 characters, not printable ASCII or has a comma."""


class TaskResultNotStored(ResponseNotStored):
    """The key's work completed, but its result was larger than ``MAX_RESPONSE_BYTES``."""


class TaskStoreUnavailable(StoreUnavailable):
    """The store failed: the work did not run, or its transaction did not commit.
    Deliver the message again later (``retry_after`` seconds)."""


class TaskWorkNotCommitted(WorkNotCommitted):
    """The work's transaction (``atomic`` mode) failed to commit for a reason of its own (a
    deferred constraint) and rolled back; the key is released. Delivering the same message
    again most likely fails the same way: not a failure to retry blindly."""


class TaskRun:
    """What ``claim_once`` yields: ``done`` says the work already ran for this key, and
    ``result`` is its stored result; otherwise run the work and set ``result``."""

    def __init__(self, *, done: bool, result: Any = None) -> None:
        self.done = done
        self._result = result

    @property
    def result(self) -> Any:
        return self._result

    @result.setter
    def result(self, value: Any) -> None:
        if self.done:
            raise RuntimeError(
                "This key's work already ran: check run.done and use run.result instead "
                "of running the work again."
            )
        self._result = value

    def __repr__(self) -> str:
        return f"TaskRun(done={self.done!r}, result={self._result!r})"


class ClaimOnce:
    """The context manager ``claim_once`` returns; one ``with`` per instance."""

    def __init__(self, scope: claims.Scope, fingerprint: str, options: Options, label: str) -> None:
        self.scope = scope
        self.fingerprint = fingerprint
        self._options = options
        self._label = label
        self._entered = False
        self._run: TaskRun | None = None
        self._protected: shell.Run | None = None

    def __enter__(self) -> TaskRun:
        if self._entered:
            raise RuntimeError(f"{self._label}: a claim_once(...) can be entered only once.")
        self._entered = True
        if not conf.ENABLED:
            self._run = TaskRun(done=False)
            return self._run
        protected = shell.Run(self.scope, self.fingerprint, self._options.policy())
        started = protected.start()
        if isinstance(started, shell.Replayed):
            self._run = TaskRun(done=True, result=json.loads(started.stored.body))
            return self._run
        if isinstance(started, shell.Refused):
            raise self._task_error(started.error)
        if protected.claimed:
            self._protected = protected
        self._run = TaskRun(done=False)
        return self._run

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        protected, run = self._protected, self._run
        if protected is None or run is None:
            return  # disabled, replayed, or failed open: nothing was claimed
        if exc is not None:
            protected.fail(exc)
            return
        try:
            body = self._encode(run.result)
        except TypeError as error:
            protected.fail(error)
            raise
        outcome = shell.definitive(
            RESULT_STATUS, body, lambda: list(RESULT_HEADERS), protected.policy, self.scope
        )
        refused = protected.finish(outcome)
        if refused is not None:
            raise self._task_error(refused.error)
        run._result = json.loads(body)

    def _task_error(self, error: Exception) -> Exception:
        key = signals.log_key(self.scope.key)  # these messages end up in worker logs
        if isinstance(error, InFlight):
            retry_after = error.retry_after if error.retry_after is not None else 1
            return TaskInFlight(
                f"{self._label} is still running for key {key!r} (claimed by another "
                f"worker); deliver it again in {retry_after} s.",
                retry_after=retry_after,
            )
        if isinstance(error, KeyMismatch):
            return TaskKeyMismatch(
                f"{self._label}: key {key!r} was already used with different arguments."
            )
        if isinstance(error, ResponseNotStored):
            if error.slug != ResponseNotStored.slug:  # stored, but RESPONSE_CODEC can't open it
                return TaskResultNotStored(
                    f"{self._label}: key {key!r} already ran. {error.detail}"
                )
            return TaskResultNotStored(
                f"{self._label}: key {key!r} already ran, but its result was larger than "
                "MAX_RESPONSE_BYTES and was not stored."
            )
        if isinstance(error, WorkNotCommitted):
            return TaskWorkNotCommitted(f"{self._label}: {error.detail}")
        if isinstance(error, StoreUnavailable):
            return TaskStoreUnavailable(
                f"{self._label}: {error.detail}", retry_after=error.retry_after
            )
        return error  # pragma: no cover - the shell refuses with the errors above

    def _encode(self, result: Any) -> bytes:
        try:
            text = json.dumps(result, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
            return text.encode("utf-8")
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"{self._label} returned a result that is not JSON-serialisable ({error}); "
                f"the key {signals.log_key(self.scope.key)!r} was released, so the next "
                "delivery runs again. "
                "Return JSON values: dict, list, str, int, float, bool or None."
            ) from error


def claim_once(
    scope: str,
    key: object,
    *,
    name: str = "",
    fingerprint: Any = None,
    in_flight: str | None = None,
    wait_seconds: float | None = None,
    lease_seconds: float | None = None,
    ttl_seconds: float | None = _UNSET,
    max_run_seconds: float | None = None,
    max_response_bytes: int | None = None,
    mode: str | None = None,
    store: str | Store | None = None,
) -> ClaimOnce:
    """Run a block at most once per ``(scope, name, key)``::

        with claim_once("receipts", message_id, fingerprint={"order": order_id}) as run:
            if run.done:
                return run.result  # stored by an earlier delivery
            run.result = send_receipt(order_id)

    ``fingerprint`` is any JSON-serialisable value (or bytes) that describes the work; a
    repeat of the key with a different one raises ``TaskKeyMismatch``. ``name`` separates
    blocks that share a scope (the endpoint is ``"task:<name>"``, or ``"task"``). After the block,
    ``run.result`` is the stored (JSON round-tripped) result. The other arguments override
    the ``IDEMPOTENCY`` settings of the same name.
    """
    given = _options_among(locals())
    label = f"claim_once({scope!r}, name={name!r})" if name else f"claim_once({scope!r})"
    options = Options.given(given, label, TASK)
    endpoint = _endpoint(name)
    task_scope = claims.Scope(_account(scope), endpoint, task_key(key))
    work = keys.task_fingerprint(endpoint, fingerprint, label)
    return ClaimOnce(task_scope, work, options, label)


def idempotent_task(
    *,
    scope: str | Callable[..., str],
    key: str | Callable[..., object],
    name: str | None = None,
    fingerprint_args: Sequence[str] | None = None,
    fingerprint: Callable[..., Any] | None = None,
    in_flight: str | None = None,
    wait_seconds: float | None = None,
    lease_seconds: float | None = None,
    ttl_seconds: float | None = _UNSET,
    max_run_seconds: float | None = None,
    max_response_bytes: int | None = None,
    mode: str | None = None,
    store: str | Store | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Run the decorated function at most once per ``(scope, key)``; a repeat returns the
    stored result without running it.

    ``key`` names the argument that carries the key (a message id), or is a callable
    given the function's arguments. ``scope`` is a string or such a callable. ``name``
    defaults to ``module.qualname``: renaming or moving the function changes it (and so
    forgets its keys) unless ``name`` is given. ``fingerprint_args`` names the arguments
    that make the work *that* work (default: every argument but the key); ``fingerprint``
    instead computes a JSON-serialisable value from the arguments. The rest override the
    ``IDEMPOTENCY`` settings of the same name.
    """
    given = _options_among(locals())
    if name is not None:
        Options.given(given, f"Task {name!r}", TASK)  # validate now, not at the first call
    if fingerprint_args is not None and fingerprint is not None:
        raise ImproperlyConfigured(
            "idempotent_task: give fingerprint_args or fingerprint, not both"
        )

    def decorator(func: Callable[P, R]) -> Callable[P, R]:
        task_name = name or f"{func.__module__}.{func.__qualname__}"
        label = f"Task {task_name!r}"
        options = Options.given(given, label, TASK)
        if inspect.iscoroutinefunction(func):
            raise ImproperlyConfigured(f"{label}: async functions are not supported")
        signature = inspect.signature(func)
        named = [key] if isinstance(key, str) else []
        unknown = [
            arg for arg in [*named, *(fingerprint_args or ())] if arg not in signature.parameters
        ]
        if unknown:
            raise ImproperlyConfigured(
                f"{label} has no argument {unknown[0]!r} (key / fingerprint_args)"
            )
        endpoint = _endpoint(task_name)

        def describe(*args: Any, **kwargs: Any) -> tuple[claims.Scope, str]:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            raw_key = bound.arguments[key] if isinstance(key, str) else key(*args, **kwargs)
            raw_scope = scope(*args, **kwargs) if callable(scope) else scope
            if fingerprint is not None:
                work = fingerprint(*args, **kwargs)
            elif fingerprint_args is not None:
                work = {arg: bound.arguments[arg] for arg in fingerprint_args}
            else:
                work = {arg: value for arg, value in bound.arguments.items() if arg != key}
            task_scope = claims.Scope(_account(raw_scope), endpoint, task_key(raw_key))
            return task_scope, keys.task_fingerprint(endpoint, work, label)

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            if not conf.ENABLED:
                return func(*args, **kwargs)
            task_scope, task_fingerprint = describe(*args, **kwargs)
            with ClaimOnce(task_scope, task_fingerprint, options, label) as run:
                if not run.done:
                    run.result = func(*args, **kwargs)
            return cast(R, run.result)

        return wrapper

    return decorator


def _options_among(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The task options among an entry point's arguments (its ``locals()`` on entry): the
    signatures spell them out for type checkers, ``options.Options`` defines them."""
    return {name: arguments[name] for name in names(TASK)}


def task_key(value: object) -> str:
    """A task's key as stored: a str (or int, or UUID) that an HTTP ``Idempotency-Key`` may
    hold (``keys.key_error``)."""
    if isinstance(value, uuid.UUID) or (isinstance(value, int) and not isinstance(value, bool)):
        value = str(value)
    if not isinstance(value, str):
        raise TypeError(f"An idempotency key must be a str, int or UUID, not {type(value)!r}.")
    error = keys.key_error(value)
    if error is not None:
        raise TaskKeyMalformed(error)
    return value


def _account(scope: object) -> str:
    if not isinstance(scope, str) or not scope:
        raise ValueError(f"An idempotent task's scope must be a non-empty str, not {scope!r}.")
    return keys.fit(scope, ACCOUNT_MAX_LENGTH)


def _endpoint(name: str) -> str:
    """``task:<name>``, or ``task`` for an unnamed ``claim_once`` block."""
    return keys.fit(f"{ENDPOINT_PREFIX}{name}" if name else "task", ENDPOINT_MAX_LENGTH)
