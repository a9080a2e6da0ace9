"""What happens to a response between the view and the store, and between the store and the
replay: the seam where the ``RESPONSE_CODEC`` (encryption at rest) and the redaction and
replay hooks plug in.

``seal`` runs once per completed request, before its outcome is written; ``unseal`` once per
replay, after the record is read. Both are identities until a project configures otherwise.
"""

from __future__ import annotations

from idempotency_django.responses import StoredResponse


def seal(outcome: StoredResponse) -> StoredResponse:
    """The outcome as it will be stored."""
    return outcome


def unseal(stored: StoredResponse) -> StoredResponse:
    """A stored outcome as it will be replayed."""
    return stored
