"""The example project's JSON reading (``example_project/payments/jsonbody.py`` and its DRF
parser and negotiation), in-process: no database, so on SQLite too. The e2e tests
(``tests/e2e/test_example_input.py``) send the same inputs over HTTP."""

from __future__ import annotations

import io
from decimal import Decimal

import pytest
from django.test import RequestFactory
from rest_framework.exceptions import ParseError
from rest_framework.request import Request

from example_project.payments import jsonbody
from example_project.payments.parsers import ContentNegotiation, JSONParser


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_an_object_with_exact_numbers() -> None:
    value = jsonbody.loads(b'{"amount": 1000, "rate": 0.1, "big": 1e400, "name": "caf\\u00e9"}')

    assert value == {
        "amount": Decimal(1000),
        "rate": Decimal("0.1"),
        "big": Decimal("1e400"),
        "name": "café",
    }


@pytest.mark.parametrize("number", [b"1000", b"1000.0", b"1e3", b"10000e-1"])
def test_one_number_however_written(number: bytes) -> None:
    assert jsonbody.loads(b"[" + number + b"]") == [Decimal(1000)]


def test_a_number_of_5000_digits_is_a_number() -> None:
    # Python's int() refuses more than 4300 digits; the range check is the caller's.
    assert jsonbody.loads(b"9" * 5000) == Decimal("9" * 5000)


def test_nesting_up_to_max_depth() -> None:
    assert jsonbody.loads(_nested(jsonbody.MAX_DEPTH)) is not None


@pytest.mark.parametrize(
    "body",
    [
        _nested(jsonbody.MAX_DEPTH + 1),
        b'{"a": ' * (jsonbody.MAX_DEPTH + 1) + b"1" + b"}" * (jsonbody.MAX_DEPTH + 1),
        b"[" * 5000,  # unclosed, and deeper than the parser's recursion limit
        _nested(100_000),
    ],
    ids=["max depth + 1", "objects", "5000 unclosed", "100000"],
)
def test_deeper_is_invalid_not_a_recursion_error(body: bytes) -> None:
    with pytest.raises(jsonbody.InvalidJSON, match=f"deeper than {jsonbody.MAX_DEPTH} levels"):
        jsonbody.loads(body)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "empty"),
        (b" \r\n\t", "empty"),
        (b'{"amount": NaN}', "NaN is not a JSON number"),
        (b'{"amount": Infinity}', "Infinity is not a JSON number"),
        (b'{"amount": -Infinity}', "-Infinity is not a JSON number"),
        (b'{"amount": 1e99999999999999999999999}', "a number is out of range"),
        (b'{"currency": "\xff"}', "not UTF-8"),
        (b'{"currency": "\xed\xa0\x80"}', "not UTF-8"),  # an encoded surrogate
        (b"\xef\xbb\xbf{}", "not valid JSON"),  # a byte order mark
        ('{"a": 1}'.encode("utf-16"), "not UTF-8"),
        (b'{"amount": 1', "not valid JSON"),
        (b'{"amount": 1}\x00', "not valid JSON"),
        (b'{"currency": "E\x01R"}', "not valid JSON"),  # a raw control character
        (b'{"currency": "\\ud800ab"}', "lone surrogate"),
        (b'{"\\udfff": 1}', "lone surrogate"),
        (b'{"currency": "EU\\u0000"}', "NUL"),
        (b'{"a\\u0000": 1}', "NUL"),
        (b'[[["\\u0000"]]]', "NUL"),
    ],
)
def test_invalid(body: bytes, message: str) -> None:
    with pytest.raises(jsonbody.InvalidJSON, match=message):
        jsonbody.loads(body)


def test_a_surrogate_pair_is_text() -> None:
    assert jsonbody.loads(b'["\\ud83d\\ude00"]') == ["\N{GRINNING FACE}"]


def test_the_drf_parser_raises_parse_error() -> None:
    parser = JSONParser()
    assert parser.parse(io.BytesIO(b'{"amount": 1}')) == {"amount": Decimal(1)}

    with pytest.raises(ParseError, match="deeper than"):
        parser.parse(io.BytesIO(b"[" * 5000))
    with pytest.raises(ParseError, match="not UTF-8"):
        parser.parse(io.BytesIO(b'"\xff"'))


@pytest.mark.parametrize(
    ("content_type", "parsed"),
    [
        ("application/json", True),
        ("application/json; charset=utf-8", True),
        ("Application/JSON", True),
        ("*/*", False),
        ("application/*", False),
        ("text/plain", False),
        ("application/json, text/plain", False),
        ("", False),
    ],
)
def test_negotiation_takes_the_parsers_media_type_only(content_type: str, parsed: bool) -> None:
    request = Request(RequestFactory().post("/", b"{}", content_type=content_type))

    parser = ContentNegotiation().select_parser(request, [JSONParser()])

    assert isinstance(parser, JSONParser) is parsed
