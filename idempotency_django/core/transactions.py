"""The transactions around protected work: which ones, in what order, and how they end.

A protected view is taken off Django's ``ATOMIC_REQUESTS`` transactions
(``RequestTransactions``, ``request_transactions``): Django would open them around the
claim too, so that the claim could not commit first and the completion would commit before
(or without) the work. The shell (``shell.py``) opens them again around the work alone
(``Transactions``), the store's transaction outermost, so that the work's databases commit
before the store records the outcome; a view that is not protected gets them back whole
(``unprotected``). ``commit_inside_transaction`` gives a run its real mode: a claim cannot
commit on its own inside somebody else's transaction. The long story:
``docs/transactions.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any, TypeVar

from django.db import DatabaseError, connections, transaction

logger = logging.getLogger("idempotency_django")

V = TypeVar("V")


class RequestTransactions:
    """A protected view's ``_non_atomic_requests``: every database, resolved per request.

    Django would open the ``ATOMIC_REQUESTS`` transactions around the whole view, claim
    included, so that the claim could not commit first and the completion would commit
    before (or without) the work. The view opts out of all of them, and the shell opens
    them again around the work, in the order that keeps a stored outcome truthful.
    Aliases that the view's author opted out (``@transaction.non_atomic_requests``) stay out.
    """

    def __init__(self, by_author: Iterable[str] = ()) -> None:
        self._by_author: set[str] = set(by_author)

    def add(self, alias: str) -> None:  # what @transaction.non_atomic_requests calls
        self._by_author.add(alias)

    def __contains__(self, alias: object) -> bool:
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(list(connections))

    def to_reopen(self) -> list[str]:
        return _atomic_requests(excluding=self._by_author)


def request_transactions(view: Any) -> list[str]:
    """The aliases whose ``ATOMIC_REQUESTS`` transaction Django would open around ``view``
    (``BaseHandler.make_view_atomic``), less those its author opted out of with
    ``@transaction.non_atomic_requests``: the ones the shell opens again around the
    work. The one answer for every adapter (decorator, DRF mixin, middleware)."""
    opted_out = getattr(view, "_non_atomic_requests", ())
    if isinstance(opted_out, RequestTransactions):
        return opted_out.to_reopen()
    return _atomic_requests(excluding=opted_out)


def _atomic_requests(excluding: Collection[str]) -> list[str]:
    return [
        alias
        for alias in connections
        if alias not in excluding and connections[alias].settings_dict.get("ATOMIC_REQUESTS")
    ]


def unprotected(aliases: Sequence[str], work: Callable[[], V]) -> V:
    """Run work that is not protected in the request transactions it was opted out of."""
    with ExitStack() as stack:
        for alias in aliases:
            stack.enter_context(transaction.atomic(using=alias))
        return work()


def to_reopen(aliases: Sequence[str]) -> list[str]:
    """The request transactions still to open: those not already open (a test case's, an
    outer view's)."""
    return [alias for alias in aliases if not connections[alias].in_atomic_block]


class CommitFailed(Exception):
    """A transaction failed to commit; ``committed``: the aliases whose transactions had
    committed before it (the work's, when only the store's commit failed)."""

    def __init__(self, error: DatabaseError, committed: Sequence[str]) -> None:
        super().__init__(str(error))
        self.error = error
        self.committed = tuple(committed)


class Transactions:
    """The transactions one run opens around its work, left in the reverse order."""

    def __init__(self) -> None:
        self._stack = ExitStack()
        self.opened: list[str] = []
        self._committed: list[str] = []  # left without an error, in order

    def open(self, aliases: Sequence[str]) -> None:
        for alias in aliases:
            self._stack.push(self._left(alias))  # runs after that transaction is left
            self._stack.enter_context(transaction.atomic(using=alias))
            self.opened.append(alias)

    def _left(self, alias: str) -> Callable[..., bool]:
        def left(exc_type: type[BaseException] | None, *exc_info: object) -> bool:
            if exc_type is None:
                self._committed.append(alias)
            return False  # never swallows an error

        return left

    def commit(self) -> None:
        """Leave the open transactions: the work's databases commit before the store's."""
        try:
            self._stack.close()
        except DatabaseError as error:
            raise CommitFailed(error, self._committed) from error

    def leave(self, error: BaseException | None) -> None:
        """Leave the open transactions after ``error``: they roll back."""
        if error is None:
            self._stack.close()
        else:
            self._stack.__exit__(type(error), error, error.__traceback__)

    def roll_back(self, aliases: Iterable[str] | None = None) -> None:
        """Mark ``aliases`` (every one opened) to roll back when left."""
        for alias in self.opened if aliases is None else aliases:
            transaction.set_rollback(True, using=alias)

    def discard(self, alias: str) -> None:
        """Leave the transaction of a claim that was not made: nothing to keep."""
        transaction.set_rollback(True, using=alias)
        self._stack.close()

    @staticmethod
    def failed(alias: str) -> bool:
        """Whether the transaction open on ``alias`` is marked to roll back (the work asked
        for it, as DRF's exception handler does)."""
        return connections[alias].needs_rollback


def commit_inside_transaction(label: str, alias: str) -> str:
    """The mode of a ``commit`` run that finds a transaction already open on the store's
    database ``alias``: ``atomic``, with a warning once per view (``label``).

    The claim cannot commit on its own inside somebody else's transaction. The unique index
    still serialises duplicates (they wait for that transaction), so single flight holds,
    with the semantics of atomic mode."""
    _warn_once(label, alias)
    return "atomic"


_warned: set[tuple[str, str]] = set()


def _warn_once(label: str, alias: str) -> None:
    if (label, alias) in _warned:
        return
    _warned.add((label, alias))
    logger.warning(
        "Idempotency MODE 'commit' for %s inside an open transaction on %r: it runs in atomic "
        "mode (claim, work and outcome in that transaction). %s In a test, use a "
        "transactional test case (TransactionTestCase, or django_db(transaction=True)) to "
        "test commit mode.",
        label,
        alias,
        _advice(label),
    )


def _advice(label: str) -> str:
    """What gives commit mode back, outside tests: it depends on who opened the transaction.
    ninja's view is inside ``ATOMIC_REQUESTS`` before the operation runs, and
    ``non_atomic_requests`` on the operation's function does not reach it."""
    if "ninja" in label or label.startswith("IdempotentRouter"):
        return (
            "Outside tests, put the store on a database alias of its own (IDEMPOTENCY "
            "'DATABASE'), outside the request transaction, or use MODE 'atomic'."
        )
    if label.startswith("Task "):
        return "Outside tests, call the task outside any transaction, or use mode 'atomic'."
    return "Outside tests, use @transaction.non_atomic_requests or MODE 'atomic'."
