"""What names one operation: the ``Idempotency-Key`` header and the scope it is claimed in.

``parse_key`` reads the header (a bare token or an RFC 8941 sf-string: ``abc`` and
``"abc"`` are one key); ``key_error`` is the one rule for a key's value, shared with task
keys and the client. The scope is the account (``default_account``: the authenticated
principal) and the endpoint (``default_endpoint``: method and concrete path, in the
request's tenant with ``TENANT``: ``tenant_endpoint``). The fingerprint that tells a retry
from a different request lives in ``fingerprint.py``; its public names are re-exported
here, where settings and projects import them (``idempotency_django.keys.default_fingerprint``).
The rules: docs/http-contract.md; who shares a scope: docs/security.md.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from django.http import HttpRequest
from django.http.request import split_domain_port
from django.urls import Resolver404, resolve

from idempotency_django.conf import conf

# The fingerprint's public names, re-exported where FINGERPRINT settings and projects
# import them (idempotency_django.keys.default_fingerprint, keys.canonical_body, ...).
from idempotency_django.core.fingerprint import (
    FINGERPRINT_MAX_LENGTH as FINGERPRINT_MAX_LENGTH,
)
from idempotency_django.core.fingerprint import (
    FINGERPRINT_VERSION as FINGERPRINT_VERSION,
)
from idempotency_django.core.fingerprint import (
    MAX_JSON_DEPTH as MAX_JSON_DEPTH,
)
from idempotency_django.core.fingerprint import (
    Fingerprint as Fingerprint,
)
from idempotency_django.core.fingerprint import (
    Fingerprinter as Fingerprinter,
)
from idempotency_django.core.fingerprint import (
    canonical_body as canonical_body,
)
from idempotency_django.core.fingerprint import (
    custom_fingerprint as custom_fingerprint,
)
from idempotency_django.core.fingerprint import (
    default_fingerprint as default_fingerprint,
)
from idempotency_django.core.fingerprint import (
    digest as digest,
)
from idempotency_django.core.fingerprint import (
    fingerprint_display as fingerprint_display,
)
from idempotency_django.core.fingerprint import (
    fingerprints_match as fingerprints_match,
)
from idempotency_django.core.fingerprint import (
    media_type as media_type,
)
from idempotency_django.core.fingerprint import (
    task_fingerprint as task_fingerprint,
)
from idempotency_django.core.wire import (
    _PRINTABLE_ASCII as _PRINTABLE_ASCII,
)
from idempotency_django.core.wire import (
    _VISIBLE_ASCII as _VISIBLE_ASCII,
)
from idempotency_django.core.wire import (
    KEY_CHARACTER as KEY_CHARACTER,
)
from idempotency_django.core.wire import (
    KEY_MAX_LENGTH as KEY_MAX_LENGTH,
)
from idempotency_django.core.wire import (
    KEY_PATTERN as KEY_PATTERN,
)
from idempotency_django.core.wire import (
    KEY_VALUE_MAX_LENGTH as KEY_VALUE_MAX_LENGTH,
)
from idempotency_django.core.wire import (
    header_value as header_value,
)
from idempotency_django.core.wire import (
    key_error as key_error,
)
from idempotency_django.exceptions import KeyMalformed

logger = logging.getLogger("idempotency_django")


def parse_key(raw: str) -> str:
    """Parse an ``Idempotency-Key`` value: a bare token or an RFC 8941 sf-string.

    ``abc`` and ``"abc"`` name the same key, so clients that follow the IETF draft and
    clients that follow Stripe's examples interoperate.

    A key never holds a comma: servers join repeated header lines with one (WSGI servers
    into one environ value, Django's ASGI handler likewise), so ``a,b`` may be two keys
    sent at once, and which one the client meant is unknowable.
    """
    value = raw.strip(" \t")
    quoted = value.startswith('"')
    key = _parse_sf_string(value) if quoted else value
    # The one rule first (it names the comma of two joined header lines), then what only a
    # bare token needs: no spaces or quotes inside.
    error = key_error(key)
    if error is None and not quoted and not _VISIBLE_ASCII.fullmatch(key):
        error = "The key must be visible ASCII characters (or a quoted string)."
    if error is not None:
        raise KeyMalformed(error)
    return key


def _parse_sf_string(value: str) -> str:
    chars: list[str] = []
    index = 1
    while index < len(value):
        char = value[index]
        if char == "\\":
            index += 1
            if index == len(value) or value[index] not in '"\\':
                raise KeyMalformed('Only \\" and \\\\ may be escaped in a quoted key.')
            chars.append(value[index])
        elif char == '"':
            if index != len(value) - 1:
                raise KeyMalformed("Nothing may follow the closing quote of the key.")
            return "".join(chars)
        elif not 0x20 <= ord(char) <= 0x7E:
            raise KeyMalformed("The key must be printable ASCII characters.")
        else:
            chars.append(char)
        index += 1
    raise KeyMalformed("The quoted key has no closing quote.")


def fit(value: str, max_length: int) -> str:
    """Keep a scope value within its column: long values become a stable digest."""
    if len(value) <= max_length:
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
    return f"sha256:{digest}"[:max_length]


def default_account(request: HttpRequest) -> str | None:
    """The authenticated principal (``request.user``: Django's, or what a DRF authentication
    class returned) as ``principal_account`` names it; ``None`` for anonymous requests."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return None
    return principal_account(user)


def principal_account(principal: Any) -> str | None:
    """A user's primary key; with ``NAMESPACE_PRINCIPALS``, any other principal (a
    ``Merchant`` a DRF authentication class returns, an API client) as
    ``<app_label>.<model>:<pk>`` (the class's dotted path for an object that is not a
    model), as ninja's adapter names them, so that merchant 7 never shares user 7's keys.
    Without it, such a principal is its bare primary key, as before, and a warning says so
    once per class. ``None`` (anonymous) for a principal without a primary key."""
    pk = getattr(principal, "pk", None)
    if pk is None:
        return None
    if _is_user(principal):
        return str(pk)
    if conf.NAMESPACE_PRINCIPALS:
        return f"{principal_label(principal)}:{pk}"
    _warn_unnamespaced(principal)
    return str(pk)


def principal_label(principal: Any) -> str:
    """``app_label.model`` for a model instance, the class's dotted path for anything else."""
    meta = getattr(principal, "_meta", None)
    if meta is not None and isinstance(getattr(meta, "label_lower", None), str):
        return str(meta.label_lower)
    kind = type(principal)
    return f"{kind.__module__}.{kind.__qualname__}"


def _is_user(principal: Any) -> bool:
    from django.contrib.auth import get_user_model  # the app registry is ready by now

    return isinstance(principal, get_user_model())


_warned_principals: set[str] = set()


def _warn_unnamespaced(principal: Any) -> None:
    label = principal_label(principal)
    if label in _warned_principals:
        return
    _warned_principals.add(label)
    logger.warning(
        "An Idempotency-Key is scoped to a %s, which is not the user model: its account is "
        "its bare primary key, the same as the user with that primary key, so the two share "
        "keys. Set IDEMPOTENCY['NAMESPACE_PRINCIPALS'] = True (docs/security.md).",
        label,
    )


def account_or_none(value: object) -> str | None:
    """An ``ACCOUNT`` callable's answer as an account: ``None``, ``""`` (or only spaces)
    and ``"None"`` (``str()`` of a missing primary key) name nobody, and are refused as an
    anonymous request is, rather than put every such request in one shared account."""
    if value is None:
        return None
    text = str(value)
    if not text.strip() or text == "None":
        return None
    return text


def request_host(request: HttpRequest) -> str:
    """A ``TENANT``: the request's host name, lower-cased and without its port, as Django
    validates it against ``ALLOWED_HOSTS`` (``get_host``: a disallowed host is a 400)."""
    domain, _port = split_domain_port(request.get_host())
    return domain


def tenant_header(name: str) -> Callable[[HttpRequest], str | None]:
    """A ``TENANT``: the value of the request header ``name`` (``X-Org``), or ``None``.

    Only as trustworthy as the view's own check that the caller belongs to that tenant,
    which the view makes anyway before acting in it."""

    def tenant(request: HttpRequest) -> str | None:
        return request.headers.get(name)

    tenant.__qualname__ = f"tenant_header({name!r})"
    return tenant


def tenant_endpoint(endpoint: str, tenant: object) -> str:
    """``endpoint`` in a tenant's scope: ``tenant:<tenant> <endpoint>``, the tenant
    percent-encoded (it holds no space, so no two tenant and endpoint pairs write the same
    text). No tenant (``None`` or ``""``): the endpoint as it is."""
    if tenant is None or tenant == "":
        return endpoint
    return f"tenant:{quote(str(tenant), safe='')} {endpoint}"


def default_endpoint(request: HttpRequest) -> str:
    """Method and concrete path: ``/orders/1/refund`` and ``/orders/2/refund`` are apart.

    A path and its trailing-slash twin that resolve to the same view with the same arguments
    (``re_path(r"^x/?$")``, a router with ``trailing_slash="/?"``) are one endpoint, written
    with the slash, so a retry whose slash a client or proxy added or dropped is a retry.
    Paths that end with a slash, and paths whose twin resolves elsewhere (or nowhere), are
    written as they are: the endpoint of every other request is what it always was, and
    so are the records stored under it.
    """
    return f"{request.method} {_route_path(request)}"


def _route_path(request: HttpRequest) -> str:
    path = request.path
    match = getattr(request, "resolver_match", None)
    if match is None or path.endswith("/"):
        return path
    try:
        twin = resolve(request.path_info + "/", getattr(request, "urlconf", None))
    except Resolver404:
        return path
    same_route = twin.func == match.func and twin.args == match.args and twin.kwargs == match.kwargs
    return path + "/" if same_route else path
