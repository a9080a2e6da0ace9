"""The wire format of an ``Idempotency-Key``, shared by the server and the client.

Django-free, so that the client (``idempotency_django.client``) runs in any Python
process: what a key may hold (``key_error``, the one rule every side applies), how it
is written in the header (``header_value``), and the pattern the published contract
gives clients (``KEY_PATTERN``). The server's parser is ``core/keys.py``'s ``parse_key``.
"""

from __future__ import annotations

import re

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
