"""Reading a JSON request body: the one place every front door of the example API parses
JSON (the plain and async views through ``loads``, the DRF viewset through its parser).

A body that is not what RFC 8259 calls JSON, or that no column could store, is an
``InvalidJSON`` whose message tells the client what is wrong, never an exception that
becomes a 500:

- not UTF-8 (RFC 8259 JSON is UTF-8 whatever a ``charset`` parameter says), a byte order
  mark, not JSON at all, or empty;
- ``NaN``, ``Infinity`` and ``-Infinity`` (not JSON numbers);
- nested deeper than ``MAX_DEPTH`` arrays and objects (a body of 5000 ``[`` would otherwise
  raise ``RecursionError`` in the parser, which is caught here too);
- a string (or object key) holding a NUL character or a lone surrogate such as ``\\ud800``:
  valid JSON, but text that PostgreSQL (NUL) or UTF-8 (surrogates) cannot store.

Numbers are read as exact ``Decimal``s: ``10**400`` is a number for the caller to find out of
range (not an ``OverflowError`` at the database, not a float rounded to infinity), and
``1000``, ``1000.0`` and ``1e3`` are one number, as in the idempotency fingerprint.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

# Arrays and objects inside each other. A charge is one flat object; 32 levels leave room
# for any payload an endpoint of this API will take, and stay far below the parser's
# recursion limit.
MAX_DEPTH = 32


class InvalidJSON(ValueError):
    """The body is not JSON this API accepts; ``str()`` is the detail for the client."""


def _reject_constant(name: str) -> Any:
    raise InvalidJSON(f"The body is not valid JSON: {name} is not a JSON number.")


def loads(body: bytes) -> Any:
    """The JSON value of ``body`` (objects as ``dict``, numbers as ``Decimal``); raises
    ``InvalidJSON`` for anything the module docstring lists."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidJSON("The body is not UTF-8.") from None
    if not text.strip():
        raise InvalidJSON("The body is empty: send a JSON object.")
    try:
        value = json.loads(
            text, parse_int=Decimal, parse_float=Decimal, parse_constant=_reject_constant
        )
    except InvalidJSON:
        raise
    except RecursionError:
        raise _too_deep() from None
    except ArithmeticError:  # an exponent beyond even Decimal's range
        raise InvalidJSON("The body is not valid JSON: a number is out of range.") from None
    except ValueError as error:
        # Some Pythons (3.13) report an unclosed deep body as a syntax error rather than a
        # RecursionError: say what is wrong with it first, the same on every version.
        if _nests_deeper_than(text, MAX_DEPTH):
            raise _too_deep() from None
        raise InvalidJSON(f"The body is not valid JSON: {error}.") from None
    _check(value)
    return value


def _nests_deeper_than(text: str, limit: int) -> bool:
    """Whether brackets outside strings open more than ``limit`` levels (error path only)."""
    depth = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > limit:
                return True
        elif char in "]}":
            depth -= 1
    return False


def _too_deep() -> InvalidJSON:
    return InvalidJSON(f"The body nests arrays and objects deeper than {MAX_DEPTH} levels.")


def _check(value: Any) -> None:
    """Depth and strings of a parsed value, without recursion (``value`` may be deep)."""
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                raise _too_deep()
            if isinstance(item, dict):
                for name in item:
                    _check_text(name)
            children = item.values() if isinstance(item, dict) else item
            pending.extend((child, depth + 1) for child in children)


def _check_text(text: str) -> None:
    if "\x00" in text:
        raise InvalidJSON("The body holds a string with a NUL character (\\u0000).")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidJSON(
                "The body holds a string with a lone surrogate (such as \\ud800)."
            ) from None
