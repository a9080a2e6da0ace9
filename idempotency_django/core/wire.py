"""What crosses the wire, shared by the server and the client: Django-free (it imports
nothing but the standard library), so that the client (``idempotency_django.client``)
runs in any Python process.

What a key may hold (``key_error``, the one rule every side applies), how it is written
in the header (``header_value``), the pattern the published contract gives clients
(``KEY_PATTERN``), and the downstream key's derivation (``downstream_key``; guide:
docs/client.md). The server's parser is ``keys.py``'s ``parse_key``.
"""

from __future__ import annotations

import hashlib
import re
import uuid

KEY_MAX_LENGTH = 255

# What a bare key is made of, as the published contract (contract.key_parameter) gives it
# to clients: visible ASCII but the comma, which parse_key refuses in any form.
KEY_CHARACTER = r"[\x21-\x2b\x2d-\x7e]"

# The header's value exactly as parse_key accepts it (a field value, which HTTP gives
# without surrounding whitespace), for the published contract: a bare key, which cannot
# start with a quote (that is read as a quoted string); or a quoted string of printable
# ASCII but the comma, with \" and \\ escapes, not only spaces. Both are 1 to
# KEY_MAX_LENGTH characters once unquoted, a limit only a pattern can state for the
# quoted form (an escape is two characters of the value, one of the key). Written in the
# common subset of ECMA-262 (what OpenAPI means) and Python's re: no identity escapes.
_QUOTED_CHARACTER = r'(?:[\x20\x21\x23-\x2b\x2d-\x5b\x5d-\x7e]|\\["\\])'
KEY_PATTERN = (
    rf"^(?:[\x21\x23-\x2b\x2d-\x7e]{KEY_CHARACTER}{{0,{KEY_MAX_LENGTH - 1}}}"
    rf'|"(?! *"){_QUOTED_CHARACTER}{{1,{KEY_MAX_LENGTH}}}")$'
)
# The longest value KEY_PATTERN accepts: a quoted key written with escapes only.
KEY_VALUE_MAX_LENGTH = 2 + 2 * KEY_MAX_LENGTH
_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]*")
_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]*")


def key_error(key: str) -> str | None:
    """Why ``key`` cannot be an idempotency key, or ``None``: the one rule for a key's value,
    applied to the HTTP header once unquoted (``parse_key``), to task keys (``task_key``)
    and by the client before it sends one (``client.check_key``), so that a key one of them
    refuses, all refuse. 1-255 printable ASCII characters, not only spaces, and no comma
    (servers join repeated header lines with one)."""
    if not key.strip(" "):
        return "The key is empty."
    if len(key) > KEY_MAX_LENGTH:
        return f"The key is longer than {KEY_MAX_LENGTH} characters."
    if not _PRINTABLE_ASCII.fullmatch(key):
        return "The key must be printable ASCII characters."
    if "," in key:
        return (
            "A key may not contain a comma (repeated Idempotency-Key header lines arrive "
            "joined by commas: send one)."
        )
    return None


def header_value(key: str) -> str:
    """``key`` as an ``Idempotency-Key`` header value that ``parse_key`` reads back as
    ``key``: a bare token when it is one, else an RFC 8941 sf-string."""
    if _VISIBLE_ASCII.fullmatch(key) and not key.startswith('"'):
        return key
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


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
