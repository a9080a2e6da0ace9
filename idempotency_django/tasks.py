"""Run non-HTTP work at most once per key: queue redeliveries, not only HTTP retries.

``@idempotent_task`` protects one function (a Celery task, a queue consumer's handler);
``claim_once`` protects a block of code that is not one function. Both use the store the
HTTP decorator uses, with its leases, heartbeat, TTL and purge: a key is scoped by
``account = scope`` and ``endpoint = "task:<name>"``, and the result is stored as JSON
(status 200, ``Content-Type: application/json``) so the admin shows it.

The flow is the HTTP decorator's ``commit`` mode: the claim commits on its own, the work
runs outside any transaction of ours while the heartbeat renews its lease, then the result
is stored (fenced by the claim's token). An exception, or a result that is not JSON,
releases the key so that the next delivery runs. Called inside an open transaction on the
store's database, the claim cannot commit on its own: the work then runs in ``atomic`` mode
(claim, work and result in that transaction) and a warning is logged, as for views.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import sys
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ParamSpec, TypeVar, cast

from django.core.exceptions import ImproperlyConfigured
from django.core.serializers.json import DjangoJSONEncoder
from django.db import DatabaseError, connections, transaction

from idempotency_django import engine, keys
from idempotency_django.conf import IN_FLIGHT_POLICIES, MODES, conf
from idempotency_django.exceptions import InFlight, KeyMalformed, KeyMismatch, ResponseNotStored
from idempotency_django.heartbeat import heartbeat
from idempotency_django.models import ACCOUNT_MAX_LENGTH, ENDPOINT_MAX_LENGTH, KEY_MAX_LENGTH
from idempotency_django.responses import StoredResponse

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
    """The key is empty, blank, longer than 255 characters or not printable ASCII."""


class TaskResultNotStored(ResponseNotStored):
    """The key's work completed, but its result was larger than ``MAX_RESPONSE_BYTES``."""


@dataclass(frozen=True)
class TaskOptions:
    """Per-task overrides; ``None`` falls back to the ``IDEMPOTENCY`` setting when the task
    is called."""

    in_flight: str | None = None
    wait_seconds: float | None = None
    lease_seconds: float | None = None
    ttl_seconds: float | None = None
    max_run_seconds: float | None = None
    mode: str | None = None

    def __post_init__(self) -> None:
        for name, allowed in (("in_flight", IN_FLIGHT_POLICIES), ("mode", MODES)):
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ImproperlyConfigured(
                    f"idempotent task {name}={value!r}: expected one of {', '.join(allowed)}"
                )

    def pick(self, name: str, setting: str) -> Any:
        value = getattr(self, name)
        return conf.get(setting) if value is None else value

    def engine_options(self) -> engine.Options:
        return engine.Options(
            alias=engine.store_alias(),
            lease=float(self.pick("lease_seconds", "LEASE_SECONDS")),
            ttl=conf.TTL_SECONDS if self.ttl_seconds is None else float(self.ttl_seconds),
            in_flight=str(self.pick("in_flight", "IN_FLIGHT")),
            wait_seconds=float(self.pick("wait_seconds", "WAIT_SECONDS")),
            retry_after=conf.RETRY_AFTER_SECONDS,
        )


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

    def __init__(
        self, scope: engine.Scope, fingerprint: str, options: TaskOptions, label: str
    ) -> None:
        self.scope = scope
        self.fingerprint = fingerprint
        self._options = options
        self._label = label
        self._entered = False
        self._enabled = False
        self._run: TaskRun | None = None
        self._claim: engine.Claim | None = None
        self._atomic: transaction.Atomic | None = None

    def __enter__(self) -> TaskRun:
        if self._entered:
            raise RuntimeError(f"{self._label}: a claim_once(...) can be entered only once.")
        self._entered = True
        self._enabled = conf.ENABLED
        if not self._enabled:
            self._run = TaskRun(done=False)
            return self._run
        options = self._options.engine_options()
        mode = str(self._options.pick("mode", "MODE"))
        if mode == "commit" and connections[options.alias].in_atomic_block:
            # The claim cannot commit on its own inside somebody else's transaction; the
            # unique index still serialises duplicates (they wait for this transaction).
            logger.warning(
                "%s called inside an open transaction on %r: running in atomic mode (claim, "
                "work and result in that transaction). Call it outside transaction.atomic, "
                "or pass mode='atomic'.",
                self._label,
                options.alias,
            )
            mode = "atomic"
        if mode == "atomic":
            self._atomic = transaction.atomic(using=options.alias)
            self._atomic.__enter__()
            try:
                began = self._begin(options)
            except BaseException:
                self._atomic.__exit__(*sys.exc_info())
                raise
        else:
            began = self._begin(options)
        if isinstance(began, StoredResponse):
            self._run = TaskRun(done=True, result=json.loads(began.body))
        else:
            self._claim = began
            if self._atomic is None:
                max_run = float(self._options.pick("max_run_seconds", "MAX_RUN_SECONDS"))
                heartbeat.register(began, options.lease, max_run)
            self._run = TaskRun(done=False)
        return self._run

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        run = self._run
        if not self._enabled or run is None:
            return
        if self._atomic is not None:
            self._exit_atomic(run, self._atomic, exc_type, exc, traceback)
            return
        claim = self._claim
        if claim is None:
            return  # a replay: nothing was claimed, nothing to write
        try:
            if exc_type is not None:
                _release_quietly(claim)
                return
            try:
                body = self._encode(run.result)
            except TypeError:
                _release_quietly(claim)
                raise
            self._complete(claim, body, quiet=True)
            run._result = json.loads(body)
        finally:
            heartbeat.unregister(claim)

    def _exit_atomic(
        self,
        run: TaskRun,
        atomic: transaction.Atomic,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Roll the claim back with the work on failure; commit both, or neither, on success."""
        if exc_type is not None:
            atomic.__exit__(exc_type, exc, traceback)
            return
        try:
            if self._claim is not None:
                body = self._encode(run.result)
                self._complete(self._claim, body, quiet=False)
                run._result = json.loads(body)
        except BaseException:
            atomic.__exit__(*sys.exc_info())
            raise
        atomic.__exit__(None, None, None)

    def _begin(self, options: engine.Options) -> engine.Claim | StoredResponse:
        key = self.scope.key
        try:
            return engine.begin(self.scope, self.fingerprint, options)
        except InFlight as error:
            retry_after = options.retry_after if error.retry_after is None else error.retry_after
            raise TaskInFlight(
                f"{self._label} is still running for key {key!r} (claimed by another "
                f"worker); deliver it again in {retry_after} s.",
                retry_after=retry_after,
            ) from error
        except KeyMismatch as error:
            raise TaskKeyMismatch(
                f"{self._label}: key {key!r} was already used with different arguments."
            ) from error
        except ResponseNotStored as error:
            raise TaskResultNotStored(
                f"{self._label}: key {key!r} already ran, but its result was larger than "
                "MAX_RESPONSE_BYTES and was not stored."
            ) from error

    def _encode(self, result: Any) -> bytes:
        try:
            text = json.dumps(result, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
            return text.encode("utf-8")
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"{self._label} returned a result that is not JSON-serialisable ({error}); "
                f"the key {self.scope.key!r} was released, so the next delivery runs again. "
                "Return JSON values: dict, list, str, int, float, bool or None."
            ) from error

    def _complete(self, claim: engine.Claim, body: bytes, *, quiet: bool) -> None:
        storable = len(body) <= conf.MAX_RESPONSE_BYTES
        if not storable:
            logger.warning(
                "%s: result not stored (over MAX_RESPONSE_BYTES); a repeat of the key will "
                "raise TaskResultNotStored.",
                self._label,
                extra={"idempotency_key": claim.scope.key},
            )
        outcome = StoredResponse(RESULT_STATUS, body, list(RESULT_HEADERS))
        try:
            engine.complete(claim, outcome, body_stored=storable)
        except DatabaseError:
            if not quiet:
                raise
            logger.exception(
                "Idempotency store unavailable while storing a task result: the work ran, "
                "but the record stays in progress until its lease lapses.",
                extra={"idempotency_key": claim.scope.key},
            )


def claim_once(
    scope: str,
    key: object,
    *,
    name: str = "",
    fingerprint: Any = None,
    in_flight: str | None = None,
    wait_seconds: float | None = None,
    lease_seconds: float | None = None,
    ttl_seconds: float | None = None,
    max_run_seconds: float | None = None,
    mode: str | None = None,
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
    options = TaskOptions(
        in_flight=in_flight,
        wait_seconds=wait_seconds,
        lease_seconds=lease_seconds,
        ttl_seconds=ttl_seconds,
        max_run_seconds=max_run_seconds,
        mode=mode,
    )
    endpoint = _endpoint(name)
    task_scope = engine.Scope(_account(scope), endpoint, task_key(key))
    label = f"claim_once({scope!r}, name={name!r})" if name else f"claim_once({scope!r})"
    return ClaimOnce(task_scope, _fingerprint(endpoint, fingerprint, label), options, label)


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
    ttl_seconds: float | None = None,
    max_run_seconds: float | None = None,
    mode: str | None = None,
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
    options = TaskOptions(
        in_flight=in_flight,
        wait_seconds=wait_seconds,
        lease_seconds=lease_seconds,
        ttl_seconds=ttl_seconds,
        max_run_seconds=max_run_seconds,
        mode=mode,
    )
    if fingerprint_args is not None and fingerprint is not None:
        raise ImproperlyConfigured(
            "idempotent_task: give fingerprint_args or fingerprint, not both"
        )

    def decorator(func: Callable[P, R]) -> Callable[P, R]:
        task_name = name or f"{func.__module__}.{func.__qualname__}"
        label = f"Task {task_name!r}"
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

        def describe(*args: Any, **kwargs: Any) -> tuple[engine.Scope, str]:
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
            task_scope = engine.Scope(_account(raw_scope), endpoint, task_key(raw_key))
            return task_scope, _fingerprint(endpoint, work, label)

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


def task_key(value: object) -> str:
    """A task's key as stored: a str (or int, or UUID) of 1-255 printable ASCII characters,
    the characters an HTTP ``Idempotency-Key`` may hold."""
    if isinstance(value, uuid.UUID) or (isinstance(value, int) and not isinstance(value, bool)):
        value = str(value)
    if not isinstance(value, str):
        raise TypeError(f"An idempotency key must be a str, int or UUID, not {type(value)!r}.")
    if not value.strip(" "):
        raise TaskKeyMalformed("The key is empty.")
    if len(value) > KEY_MAX_LENGTH:
        raise TaskKeyMalformed(f"The key is longer than {KEY_MAX_LENGTH} characters.")
    if any(not 0x20 <= ord(char) <= 0x7E for char in value):
        raise TaskKeyMalformed("The key must be printable ASCII characters.")
    return value


def _account(scope: object) -> str:
    if not isinstance(scope, str) or not scope:
        raise ValueError(f"An idempotent task's scope must be a non-empty str, not {scope!r}.")
    return keys.fit(scope, ACCOUNT_MAX_LENGTH)


def _endpoint(name: str) -> str:
    """``task:<name>``, or ``task`` for an unnamed ``claim_once`` block."""
    return keys.fit(f"{ENDPOINT_PREFIX}{name}" if name else "task", ENDPOINT_MAX_LENGTH)


def _fingerprint(endpoint: str, work: Any, label: str) -> str:
    """SHA-256 over the endpoint and a canonical form of the work: JSON with sorted keys
    (datetimes, decimals and UUIDs as Django's JSON encoder writes them), or raw bytes."""
    if isinstance(work, bytes):
        kind, payload = b"bytes", work
    else:
        kind, payload = b"json", _canonical_json(work, label)
    return keys.digest(b"task", endpoint.encode("utf-8", "surrogatepass"), kind, payload)


def _canonical_json(work: Any, label: str) -> bytes:
    try:
        text = json.dumps(
            work,
            cls=DjangoJSONEncoder,
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
            allow_nan=False,
        )
    except (TypeError, ValueError) as error:
        culprit = ""
        if isinstance(work, dict):
            for arg, value in work.items():
                try:
                    json.dumps(value, cls=DjangoJSONEncoder, sort_keys=True, allow_nan=False)
                except (TypeError, ValueError):
                    culprit = f" (argument {arg!r}, a {type(value).__name__})"
                    break
        raise TypeError(
            f"{label}: cannot fingerprint its arguments{culprit}: {error}. Name the "
            "arguments that define the work with fingerprint_args=, or give fingerprint=."
        ) from error
    return text.encode("utf-8", "surrogatepass")


def _release_quietly(claim: engine.Claim) -> None:
    try:
        engine.release(claim)
    except DatabaseError:
        logger.exception(
            "Idempotency store unavailable while releasing a task key; it frees itself when "
            "its lease lapses.",
            extra={"idempotency_key": claim.scope.key},
        )
