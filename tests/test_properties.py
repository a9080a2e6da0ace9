"""Property-based tests (Hypothesis) of what names a request: the ``Idempotency-Key``
parser (``keys.parse_key``) and the request fingerprint (``keys.default_fingerprint``),
held to the canonical form that ``fingerprint.default_fingerprint``'s docstring documents.

Runs deterministically by default (the ``ci`` profile: derandomized, no example database,
a few seconds in all). For a longer, randomized search::

    HYPOTHESIS_PROFILE=long python -m pytest tests/test_properties.py tests/test_stateful.py

A counterexample found that way belongs here as an ``@example`` (or a plain test).
"""

from __future__ import annotations

import json
import os
import re
import string
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any
from urllib.parse import quote, quote_plus, urlencode

import pytest
from django.http import HttpRequest
from django.http.multipartparser import MultiPartParserError
from django.test import RequestFactory
from hypothesis import example, given, settings
from hypothesis import strategies as st

from idempotency_django.core import keys
from idempotency_django.exceptions import KeyMalformed
from idempotency_django.models import FINGERPRINT_MAX_LENGTH, KEY_MAX_LENGTH

settings.register_profile("ci", derandomize=True, database=None, deadline=None)
settings.register_profile(
    "long", max_examples=2000, derandomize=False, database=None, deadline=None
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

JSON = "application/json"
FORM = "application/x-www-form-urlencoded"
VERSION_3 = re.compile(r"3:[0-9a-f]{64}")

rf = RequestFactory()


# -- parse_key -------------------------------------------------------------------------------

# A key never holds a comma: servers join repeated header lines with one.
VISIBLE = st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters=",")
PRINTABLE = st.characters(min_codepoint=0x20, max_codepoint=0x7E, exclude_characters=",")
NOT_VISIBLE = st.characters(codec=None).filter(lambda char: not 0x21 <= ord(char) <= 0x7E)
NOT_PRINTABLE = st.characters(codec=None).filter(lambda char: not 0x20 <= ord(char) <= 0x7E)
OWS = st.text(st.sampled_from(" \t"), max_size=3)


def sized_text(alphabet: st.SearchStrategy[str], low: int, high: int) -> st.SearchStrategy[str]:
    """Text whose length is drawn evenly from ``low..high`` (plain ``st.text`` favours
    short strings, and the length limit is what needs testing)."""
    return st.integers(low, high).flatmap(
        lambda size: st.text(alphabet, min_size=size, max_size=size)
    )


def sf_string(content: str) -> str:
    """``content`` as an RFC 8941 sf-string: quoted, with ``"`` and ``\\`` escaped."""
    return '"' + content.replace("\\", "\\\\").replace('"', '\\"') + '"'


# A bare token starting with a quote is read as an sf-string (``"abc"`` is the key abc).
bare_tokens = sized_text(VISIBLE, 1, KEY_MAX_LENGTH).filter(lambda key: not key.startswith('"'))
quoted_keys = sized_text(PRINTABLE, 1, KEY_MAX_LENGTH).filter(lambda key: key.strip(" "))
escaped = st.text(PRINTABLE, max_size=20).map(lambda text: sf_string(text)[1:-1])


@given(key=bare_tokens)
@example(key="a" * KEY_MAX_LENGTH)
@example(key="a\"b\\c'")
def test_a_bare_token_round_trips(key: str) -> None:
    assert keys.parse_key(key) == key


@given(key=quoted_keys)
@example(key=" " * (KEY_MAX_LENGTH - 1) + "x")
@example(key='\\"\\')
def test_an_sf_string_round_trips_to_its_key(key: str) -> None:
    assert keys.parse_key(sf_string(key)) == key


@given(key=bare_tokens | quoted_keys.map(sf_string), before=OWS, after=OWS)
def test_whitespace_around_the_value_does_not_count(key: str, before: str, after: str) -> None:
    assert keys.parse_key(before + key + after) == keys.parse_key(key)


def bare_with_a_bad_character() -> st.SearchStrategy[str]:
    """A value that is not a quoted string and holds a character outside visible ASCII,
    after its surrounding whitespace is stripped."""
    return st.builds(
        lambda prefix, bad, suffix: prefix + bad + suffix,
        st.text(VISIBLE, max_size=10),
        NOT_VISIBLE,
        st.text(VISIBLE, max_size=10),
    ).filter(
        lambda raw: (
            not raw.strip(" \t").startswith('"')
            and any(not 0x21 <= ord(char) <= 0x7E for char in raw.strip(" \t"))
        )
    )


malformed_keys = st.one_of(
    # empty and blank
    st.text(st.sampled_from(" \t"), max_size=10),
    st.integers(0, 10).map(lambda size: sf_string(" " * size)),
    # over 255 characters
    sized_text(VISIBLE, KEY_MAX_LENGTH + 1, 600).filter(lambda key: not key.startswith('"')),
    sized_text(PRINTABLE, KEY_MAX_LENGTH + 1, 600).map(sf_string),
    # outside visible ASCII in a bare token, outside printable ASCII in a quoted one
    bare_with_a_bad_character(),
    st.builds(lambda a, bad, b: f'"{a}{bad}{b}"', escaped, NOT_PRINTABLE, escaped),
    # bad escapes: anything but \" and \\, or a backslash at the very end
    st.builds(
        lambda a, char, b: f'"{a}\\{char}{b}"',
        escaped,
        st.characters(codec=None).filter(lambda char: char not in '"\\'),
        escaped,
    ),
    escaped.map(lambda text: f'"{text}\\'),
    # unterminated
    escaped.map(lambda text: f'"{text}'),
    # two header lines, joined by the server with a comma (and maybe a space)
    st.builds(
        lambda one, separator, other: one + separator + other,
        bare_tokens | quoted_keys.map(sf_string),
        st.sampled_from([",", ", "]),
        bare_tokens | quoted_keys.map(sf_string),
    ),
    # a comma anywhere, bare or quoted
    st.builds(
        lambda a, b: f"{a},{b}", st.text(VISIBLE, max_size=10), st.text(VISIBLE, max_size=10)
    ),
    st.builds(lambda a, b: f'"{a},{b}"', escaped, escaped),
    # trailing garbage after the closing quote
    st.builds(
        lambda key, garbage: sf_string(key) + garbage,
        quoted_keys,
        st.text(min_size=1, max_size=10).filter(lambda garbage: garbage.strip(" \t")),
    ),
)


@given(raw=malformed_keys)
@example(raw="")
@example(raw=" \t ")
@example(raw='""')
@example(raw="a" * (KEY_MAX_LENGTH + 1))
@example(raw='"' + "a" * (KEY_MAX_LENGTH + 1) + '"')
@example(raw="a b")
@example(raw="caf\u00e9")
@example(raw="a\x00b")
@example(raw='"a\\b"')
@example(raw='"abc\\"')
@example(raw='"abc')
@example(raw='"abc"x')
@example(raw='"abc" "def"')
@example(raw='"a\tb"')
@example(raw="a,b")
@example(raw='"a", "b"')
@example(raw='"a,b"')
def test_a_malformed_value_raises_key_malformed(raw: str) -> None:
    with pytest.raises(KeyMalformed):
        keys.parse_key(raw)


SF_STRING = re.compile(r'"((?:[\x20\x21\x23-\x2b\x2d-\x5b\x5d-\x7e]|\\["\\])*)"')
TOKEN = re.compile(r"[\x21-\x2b\x2d-\x7e]+")


def reference_parse(raw: str) -> str | None:
    """The documented grammar, written as regular expressions: the key, or ``None`` when
    the value is malformed."""
    value = raw.strip(" \t")
    if value.startswith('"'):
        match = SF_STRING.fullmatch(value)
        if match is None:
            return None
        key = re.sub(r'\\(["\\])', r"\1", match.group(1))
    elif TOKEN.fullmatch(value):
        key = value
    else:
        return None
    if not key.strip(" ") or len(key) > KEY_MAX_LENGTH:
        return None
    return key


near_keys = st.text(
    st.sampled_from('"\\ \ta~!,\x7f\x00\x1f\u00e9\u2028\ud800') | st.characters(codec=None),
    max_size=12,
)


@given(raw=st.one_of(near_keys, st.text(), malformed_keys, bare_tokens, quoted_keys.map(sf_string)))
def test_parse_key_agrees_with_the_grammar_and_raises_nothing_else(raw: str) -> None:
    expected = reference_parse(raw)
    if expected is None:
        with pytest.raises(KeyMalformed):
            keys.parse_key(raw)
    else:
        assert keys.parse_key(raw) == expected


# -- fingerprints: helpers -------------------------------------------------------------------


def request_of(
    body: bytes, content_type: str = JSON, query: str = "", method: str = "POST"
) -> HttpRequest:
    path = "/o/" + (f"?{query}" if query else "")
    # CONTENT_TYPE given outright: RequestFactory leaves it out when the body is empty.
    return rf.generic(method, path, data=body, CONTENT_TYPE=content_type)


def fingerprint(
    body: bytes,
    content_type: str = JSON,
    query: str = "",
    method: str = "POST",
    fields: tuple[str, ...] | None = None,
) -> str:
    request = request_of(body, content_type, query, method)
    return keys.default_fingerprint(request, f"{method} /o/", fields=fields)


# -- fingerprints: JSON ----------------------------------------------------------------------

json_text = st.text(max_size=6) | st.text(st.characters(codec=None), max_size=4)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=False, allow_infinity=False),
    json_text,
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4)
    ),
    max_leaves=12,
    # As the server will read them: "\ud83d\ude00" escapes parse to one character.
).map(lambda value: json.loads(json.dumps(value)))


def same_json(one: Any, other: Any) -> bool:
    """The documented equality: values, not spellings; numbers by exact decimal value
    (``1`` is ``1.0``, ``true`` is not ``1``); object keys in any order."""
    if isinstance(one, bool) or isinstance(other, bool) or one is None or other is None:
        return type(one) is type(other) and one == other
    if isinstance(one, (int, float)) and isinstance(other, (int, float)):
        return Decimal(json.dumps(one)) == Decimal(json.dumps(other))
    if isinstance(one, list) and isinstance(other, list):
        return len(one) == len(other) and all(map(same_json, one, other))
    if isinstance(one, dict) and isinstance(other, dict):
        return one.keys() == other.keys() and all(same_json(one[k], other[k]) for k in one)
    return type(one) is type(other) and one == other


WHITESPACE = st.text(st.sampled_from(" \t\n\r"), max_size=2)


@st.composite
def number_spellings(draw: st.DrawFn, value: Decimal) -> str:
    """One of the JSON spellings of ``value``: any position of the point, padding zeros, an
    exponent (``e``/``E``, with or without ``+``), and either sign for zero."""
    sign, digit_tuple, exponent = value.as_tuple()
    assert isinstance(exponent, int)
    digits = "".join(map(str, digit_tuple)).lstrip("0")
    exponent_mark = draw(st.sampled_from(["e", "E", "e+", "E+"]))
    if not digits:
        text = "0" + draw(st.sampled_from(["", ".0", ".000"]))
        if draw(st.booleans()):
            text += f"{exponent_mark}{draw(st.integers(0, 20))}"
        return draw(st.sampled_from(["", "-"])) + text
    padded = digits + "0" * draw(st.integers(0, 3))
    exponent -= len(padded) - len(digits)
    if draw(st.booleans()):
        point = draw(st.integers(1, len(padded)))
        whole, fraction = padded[:point], padded[point:]
    else:
        whole, fraction = "0", "0" * draw(st.integers(0, 3)) + padded
    power = exponent + len(fraction)
    text = whole + (f".{fraction}" if fraction else "")
    if power or draw(st.booleans()):
        text += (exponent_mark if power >= 0 else exponent_mark[0]) + str(power)
    return ("-" if sign else "") + text


@st.composite
def spelled(draw: st.DrawFn, value: Any) -> str:
    """A JSON text of ``value``: object members in any order, any insignificant whitespace,
    strings escaped or not, numbers in any spelling of their value."""
    pad = draw(WHITESPACE)
    if isinstance(value, dict):
        members = draw(st.permutations(list(value.items())))
        inner = ",".join(
            f"{draw(WHITESPACE)}{draw(spelled(name))}{draw(WHITESPACE)}:{draw(spelled(member))}"
            for name, member in members
        )
        return f"{pad}{{{inner}{draw(WHITESPACE)}}}{draw(WHITESPACE)}"
    if isinstance(value, list):
        inner = ",".join(draw(spelled(member)) for member in value)
        return f"{pad}[{inner}{draw(WHITESPACE)}]{draw(WHITESPACE)}"
    if isinstance(value, str):
        ascii_only = draw(st.booleans()) or any(0xD800 <= ord(c) <= 0xDFFF for c in value)
        return pad + json.dumps(value, ensure_ascii=ascii_only) + draw(WHITESPACE)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return pad + draw(number_spellings(Decimal(json.dumps(value)))) + draw(WHITESPACE)
    return pad + json.dumps(value) + draw(WHITESPACE)


def as_bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


@given(value=json_values, data=st.data())
@example(value={"b": [1, {"y": None, "x": "é"}], "a": 0.5}, data=None)
def test_json_key_order_whitespace_and_spelling_do_not_count(value: Any, data: Any) -> None:
    compact = as_bytes(json.dumps(value, separators=(",", ":")))
    other = (
        as_bytes(data.draw(spelled(value)))
        if data is not None
        else json.dumps(value, indent=2).encode()
    )

    assert fingerprint(other) == fingerprint(compact)


def paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every position in a JSON value, the root included."""
    found = [path]
    if isinstance(value, dict):
        for name, member in value.items():
            found += paths(member, (*path, name))
    elif isinstance(value, list):
        for index, member in enumerate(value):
            found += paths(member, (*path, index))
    return found


def replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: replaced(value[head], rest, new)}
    return [replaced(member, rest, new) if i == head else member for i, member in enumerate(value)]


def near_misses(old: Any) -> list[Any]:
    """Values a sloppy canonical form might confuse with ``old``."""
    if isinstance(old, bool):
        return [int(old), str(old).lower(), not old]
    if isinstance(old, (int, float)):
        return [str(old), old + 1, -old if old else 1, float(old) + 1e-9, bool(old), None]
    if isinstance(old, str):
        return [old + " ", old.upper() if old.upper() != old else old + "x", "", None]
    if old is None:
        return ["null", "", 0, False, [], {}]
    if isinstance(old, list):
        return [old[:-1], [*old, None], old[::-1], {}, [old]]
    return [
        {**old, "extra": None},
        dict(list(old.items())[:-1]),
        list(old.values()),
        {name: None for name in old},
    ]


@st.composite
def changed(draw: st.DrawFn, value: Any) -> Any:
    """``value`` with one change somewhere: a value replaced, a field added or removed,
    an item appended or dropped."""
    path = draw(st.sampled_from(paths(value)))
    old = value
    for step in path:
        old = old[step]
    new = draw(st.sampled_from(near_misses(old)) | json_values)
    return replaced(value, path, new)


@given(value=json_values, data=st.data())
@example(value={"amount": 1}, data=None)
def test_any_change_of_a_json_value_changes_the_fingerprint(value: Any, data: Any) -> None:
    other = data.draw(changed(value)) if data is not None else {"amount": True}

    same = fingerprint(json.dumps(value).encode()) == fingerprint(json.dumps(other).encode())

    assert same == same_json(value, other), (value, other)


decimals = st.builds(
    lambda sign, coefficient, exponent: Decimal(
        (sign, tuple(map(int, str(coefficient))), exponent)
    ),
    st.integers(0, 1),
    st.integers(0, 10**40) | st.integers(0, 20),
    st.integers(-60, 60),
)


@given(value=decimals, data=st.data())
def test_one_number_value_has_one_fingerprint_whatever_its_spelling(
    value: Decimal, data: Any
) -> None:
    one, other = data.draw(number_spellings(value)), data.draw(number_spellings(value))

    assert json.loads(one, parse_float=Decimal, parse_int=Decimal) == value  # a real spelling
    assert fingerprint(one.encode()) == fingerprint(other.encode())
    assert fingerprint(f'{{"n":{one}}}'.encode()) == fingerprint(f'{{"n": {other}}}'.encode())


@given(one=decimals, other=decimals)
@example(one=Decimal("0.1"), other=Decimal("0.1000000000000000055511151231257827"))
@example(one=Decimal(1), other=Decimal("1." + "0" * 39 + "1"))
def test_numbers_keep_their_exact_value(one: Decimal, other: Decimal) -> None:
    same = fingerprint(str(one).encode()) == fingerprint(str(other).encode())

    assert same == (one == other)


@given(number=st.floats(allow_nan=False, allow_infinity=False))
@example(number=0.1)
@example(number=0.5)
def test_a_float_is_not_its_binary_expansion_unless_they_are_equal(number: float) -> None:
    """``0.1`` and the exact value of the double nearest to it are two numbers."""
    short, exact = repr(number), str(Decimal(number))

    same = fingerprint(short.encode()) == fingerprint(exact.encode())

    assert same == (Decimal(short) == Decimal(number))


def test_the_documented_number_examples() -> None:
    def of(number: str) -> str:
        return fingerprint(f'{{"amount": {number}}}'.encode())

    assert of("1") == of("1.0") == of("1e0") == of("10e-1")
    assert of("0.1") != of("0.1000000000000000055511151231257827")
    assert of("-0") == of("0")


@given(value=json_values, data=st.data())
def test_a_duplicate_object_key_counts_only_its_last_value(value: Any, data: Any) -> None:
    earlier = data.draw(json_values)
    members = [f'"k":{json.dumps(earlier)}', f'"k":{json.dumps(value)}']

    assert fingerprint(("{" + ",".join(members) + "}").encode()) == fingerprint(
        json.dumps({"k": value}).encode()
    )


@given(
    value=st.dictionaries(st.sampled_from("abcd"), json_values, max_size=4),
    fields=st.lists(st.sampled_from("abcde"), max_size=3, unique=True).map(tuple),
    data=st.data(),
)
def test_only_the_named_fields_count(value: dict[str, Any], fields: Any, data: Any) -> None:
    """``fields`` keeps the named fields; an absent field differs from a ``null`` one."""
    other = data.draw(changed(value)) if value else data.draw(json_values)

    same = fingerprint(json.dumps(value).encode(), fields=fields) == fingerprint(
        json.dumps(other).encode(), fields=fields
    )

    def picked(document: Any) -> Any:
        if not isinstance(document, dict):
            return document
        return {name: document[name] for name in fields if name in document}

    assert same == same_json(picked(value), picked(other))


@st.composite
def one_change(
    draw: st.DrawFn,
    items: list[Any],
    fresh: st.SearchStrategy[Any],
    tweak: Callable[[Any], st.SearchStrategy[Any]],
) -> list[Any]:
    """``items`` with one change: an item added, removed, moved, or changed in one part."""
    result = list(items)
    kind = draw(st.sampled_from(["add", "tweak", "remove", "move"] if result else ["add"]))
    if kind == "add":
        result.insert(draw(st.integers(0, len(result))), draw(fresh))
        return result
    index = draw(st.integers(0, len(result) - 1))
    if kind == "tweak":
        result[index] = draw(tweak(result[index]))
    elif kind == "remove":
        del result[index]
    else:
        result.insert(draw(st.integers(0, len(result) - 1)), result.pop(index))
    return result


def tweak_pair(
    names: st.SearchStrategy[str], values: st.SearchStrategy[str]
) -> Callable[[tuple[str, str]], st.SearchStrategy[tuple[str, str]]]:
    """A pair with its name or its value changed (or, drawn again, the same)."""

    def tweak(pair: tuple[str, str]) -> st.SearchStrategy[tuple[str, str]]:
        name, value = pair
        return st.one_of(
            st.tuples(st.just(name), values | st.just(value + " ") | st.just(value[:-1])),
            st.tuples(names, st.just(value)),
        )

    return tweak


# -- fingerprints: query string and media type ------------------------------------------------

query_names = st.text(max_size=3) | st.sampled_from("ab")
query_values = st.text(max_size=3) | st.sampled_from("12")
query_pairs = st.tuples(query_names, query_values)
pair_lists = st.lists(query_pairs, max_size=6)
tweak_query = tweak_pair(query_names, query_values)


def by_name(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The documented canonical query: pairs stably sorted by name."""
    return sorted(pairs, key=lambda pair: pair[0])


@st.composite
def encoded_query(draw: st.DrawFn, pairs: list[tuple[str, str]]) -> str:
    """``pairs`` URL-encoded, with ``+`` or ``%20`` for spaces and letters percent-encoded
    or not: spellings that decode to the same pairs."""
    quoting = draw(st.sampled_from([quote_plus, quote]))
    text = urlencode(pairs, quote_via=quoting)
    if draw(st.booleans()):
        text = "".join(
            f"%{ord(piece):02X}" if piece.isalnum() and draw(st.booleans()) else piece
            for piece in re.findall(r"%[0-9A-F]{2}|.", text)
        )
    return text


@given(pairs=pair_lists, data=st.data())
@example(pairs=[("a", "1"), ("b", "2")], data=None)
def test_query_order_counts_only_within_a_name(pairs: list[tuple[str, str]], data: Any) -> None:
    other = data.draw(st.permutations(pairs)) if data is not None else [("b", "2"), ("a", "1")]
    first = data.draw(encoded_query(pairs)) if data is not None else urlencode(pairs)
    second = data.draw(encoded_query(other)) if data is not None else urlencode(other)

    same = fingerprint(b"{}", query=first) == fingerprint(b"{}", query=second)

    assert same == (by_name(pairs) == by_name(other))


@given(pairs=pair_lists, data=st.data())
def test_any_change_of_the_query_changes_the_fingerprint(
    pairs: list[tuple[str, str]], data: Any
) -> None:
    other = data.draw(one_change(pairs, query_pairs, tweak_query))

    same = fingerprint(b"{}", query=urlencode(pairs)) == fingerprint(b"{}", query=urlencode(other))

    assert same == (by_name(pairs) == by_name(other))


@pytest.mark.parametrize(
    ("query", "other", "same"),
    [
        ("a=1&b=2", "b=2&a=1", True),
        ("a=1&a=2", "a=2&a=1", False),
        ("a=", "", False),
        ("a=b+c", "a=b%20c", True),
        ("a=%61", "a=a", True),
    ],
)
def test_the_documented_query_examples(query: str, other: str, same: bool) -> None:
    assert (fingerprint(b"{}", query=query) == fingerprint(b"{}", query=other)) == same


TOKEN_CHARS = string.ascii_lowercase + string.digits + "-.+"
media_types = st.one_of(
    st.sampled_from(
        [
            JSON,
            FORM,
            "text/plain",
            "application/octet-stream",
            "application/problem+json",
            "application/vnd.api+json",
            "multipart/form-data",
            "multipart/mixed",
            "",
        ]
    ),
    st.builds(
        lambda kind, sub: f"{kind}/{sub}",
        st.text(TOKEN_CHARS, min_size=1, max_size=6),
        st.text(TOKEN_CHARS, min_size=1, max_size=6),
    ),
)
# Not a boundary: it changes how a multipart body parses (tested with the forms below).
parameters = st.sampled_from(["", "; charset=utf-8", ";charset=latin-1", "; version=2"])


@given(
    body=st.binary(max_size=40) | json_values.map(lambda v: json.dumps(v).encode()),
    one=media_types,
    other=media_types,
    one_parameters=parameters,
    other_parameters=parameters,
)
@example(body=b"a=1", one=FORM, other="multipart/form-data", one_parameters="", other_parameters="")
@example(body=b"{}", one=JSON, other=JSON, one_parameters="", other_parameters="; charset=utf-8")
def test_the_media_type_counts_and_its_parameters_do_not(
    body: bytes, one: str, other: str, one_parameters: str, other_parameters: str
) -> None:
    # PUT: Django leaves it unparsed, so any bytes are a body for any media type.
    same = fingerprint(body, one + one_parameters, method="PUT") == fingerprint(
        body, other + other_parameters, method="PUT"
    )

    assert same == (one == other)


# -- fingerprints: forms ------------------------------------------------------------------------

field_names = st.text(string.ascii_letters + string.digits + "_", min_size=1, max_size=3)
field_values = st.text(st.characters(codec="utf-8"), max_size=6)
form_pair = st.tuples(field_names | st.sampled_from("ab"), field_values | st.sampled_from("12"))
form_pairs = st.lists(form_pair, max_size=6)
tweak_form = tweak_pair(field_names | st.sampled_from("ab"), field_values)
boundaries = st.text(string.ascii_letters + string.digits + "'()+_-.", min_size=10, max_size=40)
# Django drops a file whose sanitized name is empty, "." or "..".
upload_names = st.builds(
    lambda stem, extension: stem + extension,
    st.text(string.ascii_letters + string.digits, min_size=1, max_size=6),
    st.sampled_from(["", ".txt", ".tar.gz", "-1_a"]),
)
upload_types = st.sampled_from(["text/plain", "application/pdf", "image/png"])
an_upload = st.tuples(field_names, upload_names, upload_types, st.binary(max_size=30))
uploads = st.lists(an_upload, max_size=2)


def grouped(pairs: list[tuple[str, str]]) -> dict[str, list[str]]:
    """The documented canonical form: field names in any order, each field's values in
    the order sent."""
    result: dict[str, list[str]] = {}
    for name, value in pairs:
        result.setdefault(name, []).append(value)
    return result


def multipart(
    boundary: str,
    pairs: list[tuple[str, str]],
    files: Sequence[tuple[str, str, str, bytes]] = (),
) -> tuple[bytes, str]:
    """A multipart/form-data body with the fields in exactly this order."""
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
        + value.encode()
        + b"\r\n"
        for name, value in pairs
    ]
    parts += [
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; '
            f'filename="{filename}"\r\nContent-Type: {content_type}\r\n\r\n'
        ).encode()
        + content
        + b"\r\n"
        for name, filename, content_type, content in files
    ]
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


@given(pairs=form_pairs, data=st.data())
@example(pairs=[("a", "1"), ("b", "2"), ("a", "3")], data=None)
def test_a_url_encoded_form_counts_values_in_order_per_field(
    pairs: list[tuple[str, str]], data: Any
) -> None:
    other = (
        data.draw(st.permutations(pairs))
        if data is not None
        else [("b", "2"), ("a", "3"), ("a", "1")]
    )

    same = fingerprint(urlencode(pairs).encode(), FORM) == fingerprint(
        urlencode(other).encode(), FORM
    )

    assert same == (grouped(pairs) == grouped(other))


@given(pairs=form_pairs, data=st.data())
def test_any_change_of_a_url_encoded_form_changes_the_fingerprint(
    pairs: list[tuple[str, str]], data: Any
) -> None:
    other = data.draw(one_change(pairs, form_pair, tweak_form))
    same = fingerprint(urlencode(pairs).encode(), FORM) == fingerprint(
        urlencode(other).encode(), FORM
    )

    assert same == (grouped(pairs) == grouped(other))


@given(
    pairs=form_pairs,
    files=uploads,
    one=boundaries,
    other=boundaries,
    method=st.sampled_from(["POST", "PUT", "PATCH"]),
    data=st.data(),
)
def test_multipart_counts_fields_and_files_whatever_the_boundary(
    pairs: list[tuple[str, str]],
    files: list[tuple[str, str, str, bytes]],
    one: str,
    other: str,
    method: str,
    data: Any,
) -> None:
    reordered = data.draw(st.permutations(pairs))
    first = fingerprint(*multipart(one, pairs, files), method=method)
    retry = fingerprint(*multipart(other, reordered, files), method=method)

    assert (first == retry) == (grouped(pairs) == grouped(reordered))


@st.composite
def tweak_upload(
    draw: st.DrawFn, upload: tuple[str, str, str, bytes]
) -> tuple[str, str, str, bytes]:
    """An upload with one part changed: a byte of its contents (same size), its file name,
    content type or field name."""
    name, filename, content_type, content = upload
    part = draw(st.sampled_from(["content", "filename", "content_type", "name"]))
    if part == "content":
        if not content:
            return name, filename, content_type, draw(st.binary(min_size=1, max_size=3))
        index = draw(st.integers(0, len(content) - 1))
        flipped = bytes([content[index] ^ draw(st.integers(1, 255))])
        return name, filename, content_type, content[:index] + flipped + content[index + 1 :]
    if part == "filename":
        return name, draw(upload_names), content_type, content
    if part == "content_type":
        return name, filename, draw(upload_types), content
    return draw(field_names), filename, content_type, content


@given(pairs=form_pairs, files=uploads, boundary=boundaries, data=st.data())
def test_any_change_of_a_multipart_form_changes_the_fingerprint(
    pairs: list[tuple[str, str]],
    files: list[tuple[str, str, str, bytes]],
    boundary: str,
    data: Any,
) -> None:
    if data.draw(st.booleans()):
        other_pairs, other_files = data.draw(one_change(pairs, form_pair, tweak_form)), files
    else:
        other_pairs, other_files = pairs, data.draw(one_change(files, an_upload, tweak_upload))
    same = fingerprint(*multipart(boundary, pairs, files)) == fingerprint(
        *multipart(boundary, other_pairs, other_files)
    )

    def files_of(uploaded: list[tuple[str, str, str, bytes]]) -> dict[str, list[Any]]:
        result: dict[str, list[Any]] = {}
        for name, *rest in uploaded:
            result.setdefault(name, []).append(rest)
        return result

    expected = grouped(pairs) == grouped(other_pairs) and files_of(files) == files_of(other_files)
    assert same == expected


@given(
    upload=an_upload.filter(lambda upload: upload[3]),
    method=st.sampled_from(["POST", "PUT", "PATCH"]),
    data=st.data(),
)
def test_a_file_counts_by_its_contents_not_just_its_size(
    upload: tuple[str, str, str, bytes], method: str, data: Any
) -> None:
    name, filename, content_type, content = upload
    index = data.draw(st.integers(0, len(content) - 1))
    flipped = bytes([content[index] ^ data.draw(st.integers(1, 255))])
    changed = content[:index] + flipped + content[index + 1 :]

    first = fingerprint(*multipart("b" * 12, [], [upload]), method=method)
    other = fingerprint(
        *multipart("b" * 12, [], [(name, filename, content_type, changed)]), method=method
    )

    assert first != other


@given(pairs=form_pairs, boundary=boundaries)
@example(pairs=[], boundary="x" * 10)
def test_multipart_and_url_encoded_forms_of_the_same_fields_differ(
    pairs: list[tuple[str, str]], boundary: str
) -> None:
    assert fingerprint(*multipart(boundary, pairs)) != fingerprint(urlencode(pairs).encode(), FORM)


# -- fingerprints: anything at all --------------------------------------------------------------


@st.composite
def damaged_multipart(draw: st.DrawFn) -> tuple[bytes, str]:
    """A multipart body cut short, with bytes flipped or inserted, under its boundary or
    another one."""
    boundary = draw(boundaries)
    body, content_type = multipart(boundary, draw(form_pairs), draw(uploads))
    cut = draw(st.integers(0, len(body)))
    mangled = body[:cut] + draw(st.binary(max_size=8)) + body[cut + draw(st.integers(0, 4)) :]
    return mangled, draw(st.sampled_from([content_type, "multipart/form-data", content_type[:-2]]))


any_content_type = st.one_of(
    media_types.map(lambda media: media + "; charset=utf-8"),
    st.text(st.characters(max_codepoint=0xFF), max_size=40),
    st.text(TOKEN_CHARS + '/;= ,"', max_size=40),
)


@given(
    body_and_type=st.tuples(st.binary(max_size=200), any_content_type | media_types)
    | damaged_multipart(),
    method=st.sampled_from(["POST", "PUT", "PATCH", "DELETE"]),
)
@example(body_and_type=(b"\xff\xfe{", JSON), method="POST")
@example(body_and_type=(b"[" * 200 + b"]" * 200, JSON), method="POST")
@example(body_and_type=(b"--x\r\n", "multipart/form-data; boundary=x"), method="PATCH")
def test_any_bytes_with_any_content_type_get_a_fingerprint(
    body_and_type: tuple[bytes, str], method: str
) -> None:
    """Never an exception, but for what the docstring documents: a multipart ``POST``
    Django cannot parse raises ``MultiPartParserError``, as the view's own access would."""
    body, content_type = body_and_type
    request = request_of(body, content_type, method=method)
    try:
        value = keys.default_fingerprint(request, f"{method} /o/")
    except MultiPartParserError:
        assert method == "POST"
        assert keys.media_type(request) == "multipart/form-data"
        return
    assert VERSION_3.fullmatch(value)
    assert value == keys.default_fingerprint(
        request_of(body, content_type, method=method), f"{method} /o/"
    )


# -- fingerprints: a project's own FINGERPRINT ----------------------------------------------

# What a project's FINGERPRINT returns: anything, often shaped like "<number>:<text>" or a
# hex digest, sometimes too long for the column.
custom_values = st.one_of(
    st.text(max_size=120),
    st.builds(lambda n, rest: f"{n}:{rest}", st.integers(0, 10**9), st.text(max_size=70)),
    st.builds(
        lambda n, digest: f"{n}:{digest}",
        st.integers(1, 9),
        st.text("0123456789abcdef", min_size=64, max_size=64),
    ),
    st.text("0123456789abcdef", min_size=64, max_size=64),
)


@given(one=custom_values, other=custom_values)
@example(one="100:EUR", other="250:EUR")
@example(one="3:" + "a" * 64, other="2:" + "a" * 64)
@example(one="a" * 64, other="2:" + "a" * 64)
@example(one="x", other="custom:x")
@example(one="v" * 73, other="v" * 74)
def test_two_custom_fingerprints_match_exactly_when_equal(one: str, other: str) -> None:
    stored, current = keys.custom_fingerprint(one), keys.custom_fingerprint(other)

    assert keys.fingerprints_match(stored, current) is (one == other)
    assert len(stored) <= FINGERPRINT_MAX_LENGTH


@given(value=custom_values, body=st.binary(max_size=50))
def test_a_custom_fingerprint_never_matches_a_library_one(value: str, body: bytes) -> None:
    library = keys.default_fingerprint(request_of(body, JSON), "POST /o/")
    custom = keys.custom_fingerprint(value)

    assert not keys.fingerprints_match(custom, library)
    assert not keys.fingerprints_match(library, custom) or value == library
