"""Keys for the calls a protected view makes downstream (a card provider, another service).

A retry of the incoming request must pass the provider the *same* key, or a retry that runs
the view again charges twice there. The key is derived, not stored: a SHA-256 over the
incoming key, its scope and a purpose naming the call, stable across retries, processes
and deploys, never shared between accounts. The derivation is part of the compatibility
promise (a pinned test vector holds it): changing it would double-charge in-flight retries
during a deploy. Guide: docs/client.md.
"""

from __future__ import annotations

from django.http import HttpRequest

from idempotency_django.conf import conf
from idempotency_django.core.wire import downstream_key as downstream_key
from idempotency_django.exceptions import AnonymousNotAllowed, KeyMissing


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
    from idempotency_django.core import keys  # imports the models: not at import time

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
