"""Keys for the calls a protected view makes downstream (a card provider, another service).

A retry of the incoming request must pass the provider the *same* key, or a retry that runs
the view again charges twice there. The key is derived, not stored: a SHA-256 over the
incoming key, its scope and a purpose naming the call, stable across retries, processes
and deploys, never shared between accounts. The derivation is part of the compatibility
promise (a pinned test vector holds it): changing it would double-charge in-flight retries
during a deploy. Guide: docs/client.md.
"""

from __future__ import annotations

import hashlib
import uuid

from django.http import HttpRequest

from idempotency_django.conf import conf
from idempotency_django.exceptions import AnonymousNotAllowed, KeyMissing

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


def downstream_key_for(
    request: HttpRequest,
    purpose: str,
    *,
    account: str | None = None,
    endpoint: str | None = None,
) -> str:
    """``downstream_key`` for the ``Idempotency-Key`` of an incoming ``request``.

    Inside a protected view the scope is the one the view's claim used (its per-view
    ``account``/``endpoint`` overrides included); elsewhere it comes from the ``ACCOUNT``,
    ``ENDPOINT`` and ``TENANT`` settings. Raises ``KeyMissing`` (a ``BadRequest``: a 400 if
    uncaught) when the request has no key, ``KeyMalformed`` when its key is not a valid
    one, and ``AnonymousNotAllowed`` (a ``PermissionDenied``: a 403 if uncaught) when an
    unprotected request has no account and none is given: two guests who both send
    ``order-1042`` would get one downstream key, and one would be refused by the provider
    or replayed the other's payment. Pass ``account=`` something only that guest holds
    (``request.session.session_key``, a guest-order token).
    """
    from idempotency_django import keys  # imports the models: not at import time

    scope = getattr(request, "idempotency_scope", None)  # set by @idempotent and the mixin
    if scope is not None:
        return downstream_key(
            scope.key,
            purpose,
            scope.account if account is None else account,
            endpoint=scope.endpoint if endpoint is None else endpoint,
        )
    raw = request.headers.get(conf.HEADER)
    if raw is None:
        raise KeyMissing(f"This request has no {conf.HEADER} to derive a downstream key from.")
    key = keys.parse_key(raw)
    if account is None:
        account = keys.account_or_none(conf.ACCOUNT(request))
        if account is None:
            raise AnonymousNotAllowed(
                "This request has no account to scope a downstream key: every guest's "
                f"{conf.HEADER} would share one. Pass account= (a session or guest-order "
                "token)."
            )
    if endpoint is None:
        endpoint = str(conf.ENDPOINT(request))
        tenant = conf.optional_callable("TENANT")
        if tenant is not None:
            endpoint = keys.tenant_endpoint(endpoint, tenant(request))
    return downstream_key(key, purpose, account, endpoint=endpoint)
