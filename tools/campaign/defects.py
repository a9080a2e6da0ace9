"""Defects planted on purpose, to prove that the checker catches what it must
(``CAMPAIGN_DEFECT``; never in a real run):

- ``no-claim``: a store whose claim always wins (the record of the key, whatever its state,
  is dropped first): every request runs the view.
- ``lost-completion``: the completion is sent once; a store that fails it (a stall) loses
  it, and the key stays in progress until its lease lapses, when a retry runs the view
  again. The library sends it again until the lease may lapse (``_store_outcome``); this
  defect is that code before it did.
"""

from __future__ import annotations

from typing import Any

from idempotency_django.store.base import ClaimOrRead, Write
from idempotency_django.store.database import DatabaseStore
from idempotency_django.store.redis import RedisStore


class NoClaimRedisStore(RedisStore):
    def claim_or_read(self, write: Write) -> ClaimOrRead:
        self._call(lambda client: client.delete(self.key(write.scope)))
        return super().claim_or_read(write)


class NoClaimDatabaseStore(DatabaseStore):
    def claim_or_read(self, write: Write) -> ClaimOrRead:
        self._records(self.alias).filter(**write.scope.lookup()).delete()
        return super().claim_or_read(write)


def _complete_once(self: Any, claim: Any, response: Any, body_stored: bool) -> bool:
    from idempotency_django.core import shell

    return bool(shell.complete(claim, response, body_stored=body_stored))


def plant(defect: str) -> None:
    if defect == "lost-completion":
        from idempotency_django.core.shell import Run as Protected

        Protected._store_outcome = _complete_once  # type: ignore[method-assign]
    elif defect not in ("", "no-claim"):
        raise ValueError(f"unknown CAMPAIGN_DEFECT {defect!r}")
