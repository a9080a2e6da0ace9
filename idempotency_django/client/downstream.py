"""The downstream key's derivation, Django-free (the client and the server share it;
``idempotency_django.downstream.downstream_key_for`` takes the key and scope from a
request). Guide: docs/client.md."""

from __future__ import annotations

import hashlib
import uuid

_NAMESPACE = b"idempotency-django/downstream-key/v1"


def downstream_key(
    key: str, purpose: str, account: str | None = None, *, endpoint: str | None = None
) -> str:
    """A deterministic key for one downstream call made on behalf of ``key``.

    ``purpose`` names the call (``"stripe-charge"``; ``"stripe-refund:line-3"`` when one
    request makes several calls of a kind). Give the ``account`` (and ``endpoint``) that
    scope ``key`` upstream, so that two accounts using the same key get different
    downstream keys; ``downstream_key_for`` fills them in from a request.

    The result is a UUID-formatted string (36 characters, version 8: RFC 9562's
    name-based SHA-256 layout), accepted by providers that want a UUID and well within
    every provider's length limit (Stripe 255, PayPal 108, Square 45).
    """
    if not key:
        raise ValueError("downstream_key needs the incoming Idempotency-Key, not an empty one")
    if not purpose:
        raise ValueError("downstream_key needs a purpose naming the downstream call")
    hasher = hashlib.sha256()
    for part in (_NAMESPACE, *(_part(value) for value in (purpose, account, endpoint, key))):
        hasher.update(len(part).to_bytes(8, "big"))
        hasher.update(part)
    value = int.from_bytes(hasher.digest()[:16], "big")
    value &= ~(0xF000 << 64)  # version 8 ...
    value |= 0x8000 << 64
    value &= ~(0xC000 << 48)  # ... and the RFC 9562 variant
    value |= 0x8000 << 48
    return str(uuid.UUID(int=value))


def _part(value: str | None) -> bytes:
    # None and "" must not collide: an account-less key is not the key of account "".
    return b"\x00" if value is None else b"\x01" + value.encode("utf-8", "surrogatepass")
