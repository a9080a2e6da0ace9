"""When a user is deleted, the records of its account go with it.

A user's account is its primary key, and a primary key can come back: a natural key (an
e-mail address, an identity provider's subject) taken by someone new, rows imported with
their ids. The newcomer would inherit the deleted user's keys: a replay of someone else's
response, or a 422. ``forget_account`` deletes them, after the user's deletion commits
(a deletion that rolls back keeps them: the user and their retries are still there).

Only where an account that is a bare primary key is certainly a user: ``ACCOUNT`` is the
default and ``NAMESPACE_PRINCIPALS`` is on (without it, merchant 7 shares user 7's account,
and deleting user 7 would take the merchant's records, letting its retries run again).
Task records are kept: a task's scope is any string the caller chose. Only the database
store can find an account's records (the Redis store's keys are digests of the scope): on
Redis they stay until they expire. docs/security.md ("Who shares a scope").
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import DatabaseError, transaction
from django.db.models import Q

from idempotency_django.conf import DEFAULTS, conf

logger = logging.getLogger("idempotency_django")


def forget_account(account: str) -> int:
    """Delete the records of ``account`` (but tasks') from the database store, at once; the
    number deleted. For a principal that is gone for good: call it from your own receiver
    when a custom ``ACCOUNT`` names principals its own way."""
    # Imported here: this module is imported when the app is ready, the store on first use.
    from idempotency_django.adapters.tasks import ENDPOINT_PREFIX
    from idempotency_django.store import database as database_store
    from idempotency_django.store.base import store_alias

    # A task's records: its scope is any string, which may look like a user's primary key.
    tasks = Q(endpoint__startswith=ENDPOINT_PREFIX) | Q(endpoint="task")
    return database_store.delete_account(store_alias(), account, tasks)


def user_deleted(sender: Any, instance: Any, using: str, **kwargs: Any) -> None:
    """``post_delete`` of the user model: forget the user's account once the deletion
    commits, where a bare primary key is certainly a user (see the module's docstring)."""
    if not (conf.NAMESPACE_PRINCIPALS and conf.get("ACCOUNT") == DEFAULTS["ACCOUNT"]):
        return
    from idempotency_django.core import keys

    account = keys.principal_account(instance)
    if account is None:
        return
    transaction.on_commit(lambda: _forget_after_commit(account), using=using)


def _forget_after_commit(account: str) -> None:
    """The user is gone: failing to delete their records must not fail the request that
    deleted them. The records then stay until they expire (logged)."""
    try:
        forget_account(account)
    except DatabaseError:
        logger.warning(
            "Could not delete the idempotency records of deleted user %s; they stay until "
            "they expire.",
            account,
            exc_info=True,
        )
