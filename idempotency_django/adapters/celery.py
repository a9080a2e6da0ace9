"""Celery tasks that run at most once per key and never drop a message the store refused.

``IdempotentTask`` runs a task's body under ``@idempotent_task`` (keyed by the task id
unless told otherwise) and turns the two "not now" refusals, ``TaskInFlight`` and
``TaskStoreUnavailable``, into ``self.retry`` with their ``retry_after``: raised instead,
either would fail the task, and Celery acks a failed message even under ``acks_late``.
Run eagerly (``apply()``, ``task_always_eager``), where nothing could deliver it later,
the refusal is raised to the caller.
``acks_late`` and ``reject_on_worker_lost`` are on, so a killed worker's message is
redelivered, and the lease holds it back until the dead run's claim lapsed. Guide:
docs/tasks.md.
"""

from __future__ import annotations

from typing import Any, ClassVar

from celery import Task  # type: ignore[import-untyped]

__all__ = ["DEFAULT_SCOPE", "IdempotentTask"]

DEFAULT_SCOPE = "celery"


class IdempotentTask(Task):  # type: ignore[misc]  # Celery ships no type information
    """A Celery task whose body runs at most once per key::

        @shared_task(base=IdempotentTask)
        def send_receipt(order_id: int) -> dict: ...


        @shared_task(base=IdempotentTask, idempotency={"key": "order_id", "scope": "receipts"})
        def charge(order_id: int, amount: int) -> dict: ...

    ``idempotency`` holds ``@idempotent_task``'s keyword arguments. ``key`` defaults to the
    task id, which Celery keeps across redeliveries and retries of one message; name an
    argument (or give a callable) when the same job can be published twice. ``scope``
    defaults to ``"celery"`` and ``name`` to the task's name. The body's result must be
    JSON, as every repeat returns the stored one.
    """

    acks_late = True
    reject_on_worker_lost = True
    # A store outage must not run out of retries and drop the message; bound it per task
    # (``max_retries=…``) to give up after a while instead, failing the task.
    max_retries = None
    idempotency: ClassVar[dict[str, Any]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.request_stack.top is None:
            # Called as a plain function: no worker (nor apply()) pushed a request, so
            # there is no task id and retry() raises the refusal to the caller.
            self.push_request(args=args, kwargs=kwargs)
            try:
                return self._run_once(*args, **kwargs)
            finally:
                self.pop_request()
        return self._run_once(*args, **kwargs)

    def _run_once(self, *args: Any, **kwargs: Any) -> Any:
        # Imported here: a Celery app module imports this one before Django is set up.
        from idempotency_django.adapters.tasks import TaskInFlight, TaskStoreUnavailable

        try:
            return self._protected_run()(*args, **kwargs)
        except (TaskInFlight, TaskStoreUnavailable) as exc:
            if self.request.is_eager:
                # apply() and task_always_eager: no broker to deliver it again later.
                # Celery would retry at once, in this call, without the countdown, and
                # again until RecursionError: the caller gets the refusal instead.
                raise
            raise self.retry(exc=exc, countdown=exc.retry_after) from exc

    def _protected_run(self) -> Any:
        """``self.run`` under ``@idempotent_task``, built at the first call (a task's
        options are set after the class is created)."""
        run = self.__dict__.get("_idempotent_run")
        if run is None:
            from idempotency_django.adapters.tasks import idempotent_task

            options = {"scope": DEFAULT_SCOPE, "name": self.name, "key": self._task_id}
            options.update(self.idempotency)
            run = idempotent_task(**options)(self.run)
            self._idempotent_run = run
        return run

    def _task_id(self, *args: Any, **kwargs: Any) -> str:
        task_id = self.request.id
        if not task_id:
            raise TypeError(
                f"Task {self.name!r} was called without a task id, its default "
                "idempotency key: send it (delay(), apply_async(), apply()), or name the "
                "argument that holds the key in idempotency={'key': ...}."
            )
        return str(task_id)
