from __future__ import annotations

import hashlib
import re
from typing import Any

import pytest
from django.contrib.auth.models import AnonymousUser, User
from django.http import HttpRequest
from django.test import RequestFactory

from idempotency_django.core import keys
from idempotency_django.exceptions import KeyMalformed
from idempotency_django.models import ACCOUNT_MAX_LENGTH, ENDPOINT_MAX_LENGTH, KEY_MAX_LENGTH
from tests.conftest import keyed

JSON = "application/json"
FORM = "application/x-www-form-urlencoded"


def quoted(key: str) -> str:
    return f'"{key}"'


# parse_key: accepted keys


@pytest.mark.parametrize(
    "raw",
    [
        "abc",
        "3f2c7a4e-1b9d-4c55-9e0a-8d6f2b1c0e77",
        "a!#$%&'*+-.^_`|~z",
        "x",
        'a"b',
        "a\\b",
    ],
)
def test_parse_key_accepts_visible_ascii_bare_token(raw: str) -> None:
    assert keys.parse_key(raw) == raw


def test_parse_key_sf_string_names_the_same_key_as_the_bare_token() -> None:
    assert keys.parse_key('"abc"') == "abc"
    assert keys.parse_key('"abc"') == keys.parse_key("abc")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ('"a\\"b"', 'a"b'),
        ('"a\\\\b"', "a\\b"),
        ('"\\"\\\\"', '"\\'),
    ],
)
def test_parse_key_sf_string_unescapes(raw: str, expected: str) -> None:
    assert keys.parse_key(raw) == expected


def test_parse_key_allows_spaces_inside_a_quoted_key() -> None:
    assert keys.parse_key('"a b c"') == "a b c"


def test_parse_key_keeps_leading_and_trailing_spaces_inside_the_quotes() -> None:
    assert keys.parse_key('" abc "') == " abc "


@pytest.mark.parametrize("raw", ["  abc", "abc  ", "\tabc\t", ' "abc" ', '\t"abc"\t'])
def test_parse_key_ignores_surrounding_optional_whitespace(raw: str) -> None:
    assert keys.parse_key(raw) == "abc"


def test_parse_key_accepts_the_maximum_length_bare() -> None:
    key = "k" * KEY_MAX_LENGTH
    assert KEY_MAX_LENGTH == 255
    assert keys.parse_key(key) == key


def test_parse_key_accepts_the_maximum_length_quoted() -> None:
    key = "k" * KEY_MAX_LENGTH
    assert keys.parse_key(quoted(key)) == key


def test_parse_key_length_counts_the_unescaped_key() -> None:
    key = '"' * KEY_MAX_LENGTH
    raw = quoted('\\"' * KEY_MAX_LENGTH)
    assert keys.parse_key(raw) == key


# parse_key: rejected keys


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param("", id="empty"),
        pytest.param('""', id="empty-quoted"),
        pytest.param("   ", id="spaces-only"),
        pytest.param('"   "', id="spaces-only-quoted"),
        pytest.param("\t \t", id="whitespace-only"),
        pytest.param("k" * (KEY_MAX_LENGTH + 1), id="256-bare"),
        pytest.param(quoted("k" * (KEY_MAX_LENGTH + 1)), id="256-quoted"),
        pytest.param("a b", id="space-in-bare"),
        pytest.param("a\tb", id="tab-in-bare"),
        pytest.param(quoted("a\tb"), id="tab-in-quoted"),
        pytest.param("a\x00b", id="nul-in-bare"),
        pytest.param(quoted("a\x00b"), id="nul-in-quoted"),
        pytest.param("a\x7fb", id="del-in-bare"),
        pytest.param(quoted("a\x7fb"), id="del-in-quoted"),
        pytest.param("a\nb", id="newline-in-bare"),
        pytest.param(quoted("a\rb"), id="cr-in-quoted"),
        pytest.param("caf\u00e9", id="non-ascii-bare"),
        pytest.param(quoted("caf\u00e9"), id="non-ascii-quoted"),
        pytest.param("caf\u00c3\u00a9", id="utf8-as-latin1-bare"),
        pytest.param('"a\\nb"', id="invalid-escape"),
        pytest.param('"a\\b"', id="invalid-escape-letter"),
        pytest.param('"abc\\"', id="escaped-closing-quote"),
        pytest.param('"abc\\', id="backslash-at-end"),
        pytest.param('"abc', id="unterminated"),
        pytest.param('"', id="lone-quote"),
        pytest.param('"abc"def', id="trailing-data"),
        pytest.param('"abc""', id="trailing-quote"),
        pytest.param('"abc";p=1', id="trailing-parameter"),
        pytest.param('"a" "b"', id="two-strings"),
        # Two header lines, as servers join them.
        pytest.param("a,b", id="two-lines-joined"),
        pytest.param("a, b", id="two-lines-joined-with-a-space"),
        pytest.param('"a","b"', id="two-quoted-lines-joined"),
        pytest.param('"a,b"', id="comma-in-quoted"),
        pytest.param("a,", id="a-line-and-an-empty-line"),
        pytest.param(",a", id="an-empty-line-and-a-line"),
    ],
)
def test_parse_key_rejects_malformed(raw: str) -> None:
    with pytest.raises(KeyMalformed):
        keys.parse_key(raw)


@pytest.mark.parametrize("character", [chr(code) for code in range(0x110)])
def test_parse_key_accepts_exactly_the_published_pattern(character: str) -> None:
    """The parser and the OpenAPI pattern clients validate against agree on every character
    of a bare key (inside one: a key that starts with a quote is read as a quoted string)."""
    from idempotency_django.core.contract import key_parameter

    pattern = re.compile(key_parameter(required=True, ttl=None)["schema"]["pattern"])
    raw = f"a{character}b"
    try:
        accepted = keys.parse_key(raw) == raw
    except KeyMalformed:
        accepted = False
    assert accepted is bool(pattern.fullmatch(raw))


_SAMPLE = ' \t"\\,!#az09~\x00\x7f\u00e9'


def _bare() -> Any:
    from hypothesis import strategies as st

    return st.text(alphabet=st.sampled_from(_SAMPLE), max_size=300) | st.builds(
        lambda n, tail: "k" * n + tail,
        st.integers(0, KEY_MAX_LENGTH + 2),
        st.text(alphabet=st.sampled_from(_SAMPLE), max_size=2),
    )


def _quoted() -> Any:
    """Quoted strings near the limits: unescaped characters and escapes (an escape is two
    characters of the value, one of the key), any run of them, and what may follow."""
    from hypothesis import strategies as st

    piece = st.sampled_from([*_SAMPLE, "k", '\\"', "\\\\", "\\n"])
    short = st.lists(piece, max_size=8).map("".join)
    long = st.builds(
        lambda n, escape, tail: ("k" * n if not escape else '\\"' * n) + tail,
        st.integers(0, KEY_MAX_LENGTH + 2),
        st.booleans(),
        short,
    )
    return st.builds(
        lambda inner, end: f'"{inner}{end}',
        short | long,
        st.sampled_from(['"', "", '""', '"x', "\\"]),
    )


def test_parse_key_accepts_exactly_the_published_schema() -> None:
    """For any header value, the published pattern and maximum length allow it exactly
    when the parser accepts it, bare or quoted: a client validating against the schema is
    never refused a key, nor kept from one the server takes. A field value has no
    surrounding whitespace (RFC 9110 5.5: servers strip it, as parse_key does), so
    neither do the values generated here."""
    from hypothesis import given, settings

    from idempotency_django.core.contract import key_parameter

    schema = key_parameter(required=True, ttl=None)["schema"]
    pattern = re.compile(schema["pattern"])

    @settings(max_examples=2000, deadline=None)
    @given((_bare() | _quoted()).map(lambda value: value.strip(" \t")))
    def check(value: str) -> None:
        try:
            keys.parse_key(value)
            accepted = True
        except KeyMalformed:
            accepted = False
        published = bool(pattern.fullmatch(value)) and len(value) <= schema["maxLength"]
        assert published is accepted, value

    check()


def test_key_malformed_carries_a_detail() -> None:
    with pytest.raises(KeyMalformed) as excinfo:
        keys.parse_key("k" * (KEY_MAX_LENGTH + 1))
    assert str(KEY_MAX_LENGTH) in excinfo.value.detail


# fit


@pytest.mark.parametrize("max_length", [ACCOUNT_MAX_LENGTH, ENDPOINT_MAX_LENGTH])
def test_fit_keeps_values_up_to_the_max_length(max_length: int) -> None:
    assert keys.fit("", max_length) == ""
    assert keys.fit("short", max_length) == "short"
    exact = "v" * max_length
    assert keys.fit(exact, max_length) == exact


@pytest.mark.parametrize("max_length", [ACCOUNT_MAX_LENGTH, ENDPOINT_MAX_LENGTH])
def test_fit_maps_long_values_to_a_digest_within_the_max_length(max_length: int) -> None:
    value = "v" * (max_length + 1)
    fitted = keys.fit(value, max_length)
    assert fitted == "sha256:" + hashlib.sha256(value.encode()).hexdigest()
    assert len(fitted) <= max_length


def test_fit_is_stable_and_distinguishes_long_values() -> None:
    first = "POST /" + "a" * 300
    second = "POST /" + "a" * 299 + "b"
    assert keys.fit(first, ENDPOINT_MAX_LENGTH) == keys.fit(first, ENDPOINT_MAX_LENGTH)
    assert keys.fit(first, ENDPOINT_MAX_LENGTH) != keys.fit(second, ENDPOINT_MAX_LENGTH)


def test_fit_handles_non_ascii_and_surrogates() -> None:
    value = "\u00e9\ud800" * 200
    fitted = keys.fit(value, ENDPOINT_MAX_LENGTH)
    assert fitted.startswith("sha256:")
    assert fitted == keys.fit(value, ENDPOINT_MAX_LENGTH)


def test_fit_stays_within_a_short_max_length() -> None:
    assert len(keys.fit("v" * 100, 32)) <= 32


# default_account and default_endpoint


def test_default_account_is_none_for_anonymous(rf: RequestFactory) -> None:
    request = rf.post("/orders/")
    request.user = AnonymousUser()
    assert keys.default_account(request) is None


def test_default_account_is_none_for_a_principal_that_is_not_authenticated(
    rf: RequestFactory,
) -> None:
    """A principal with a primary key that says it is not authenticated (a guest or a
    deactivated session's object of a custom user model) is anonymous, whatever its pk."""

    class Guest:
        pk = 7
        is_authenticated = False

    request = rf.post("/")
    request.user = Guest()  # type: ignore[assignment]
    assert keys.default_account(request) is None


def test_default_account_is_none_without_a_user_attribute(rf: RequestFactory) -> None:
    request = rf.post("/orders/")
    assert not hasattr(request, "user")
    assert keys.default_account(request) is None


@pytest.mark.django_db
def test_default_account_is_the_user_pk_as_a_string(rf: RequestFactory) -> None:
    user = User.objects.create_user(username="alice")
    request = rf.post("/orders/")
    request.user = user
    assert keys.default_account(request) == str(user.pk)


@pytest.mark.django_db
def test_default_account_differs_between_users(rf: RequestFactory) -> None:
    alice = User.objects.create_user(username="alice")
    bob = User.objects.create_user(username="bob")
    first, second = rf.post("/orders/"), rf.post("/orders/")
    first.user, second.user = alice, bob
    assert keys.default_account(first) != keys.default_account(second)


def test_default_endpoint_is_method_and_path(rf: RequestFactory) -> None:
    assert keys.default_endpoint(rf.post("/orders/1/refund")) == "POST /orders/1/refund"
    assert keys.default_endpoint(rf.patch("/orders/1")) == "PATCH /orders/1"


def test_default_endpoint_ignores_the_query_string(rf: RequestFactory) -> None:
    assert keys.default_endpoint(rf.post("/orders/?page=2")) == "POST /orders/"


def test_default_endpoint_separates_concrete_paths(rf: RequestFactory) -> None:
    assert keys.default_endpoint(rf.post("/orders/1/refund")) != keys.default_endpoint(
        rf.post("/orders/2/refund")
    )


# default_fingerprint


def fingerprint(
    rf: RequestFactory,
    payload: bytes | str = b"",
    content_type: str = JSON,
    *,
    method: str = "POST",
    path: str = "/orders/",
    fields: tuple[str, ...] | None = None,
    body: keys.Fingerprinter | None = None,
) -> str:
    """The default fingerprint of a request built from these parts."""
    request = rf.generic(method, path, data=payload, content_type=content_type)
    return keys.default_fingerprint(
        request, keys.default_endpoint(request), fields=fields, body=body
    )


def test_fingerprint_is_version_3_a_key_id_and_a_keyed_digest(rf: RequestFactory) -> None:
    value = fingerprint(rf, b'{"amount": 10}')
    version, _, hexdigest = value.partition(":")
    assert version == "3"
    assert len(hexdigest) == 64
    assert int(hexdigest, 16) >= 0
    assert hexdigest[:8] == keyed(b"", "tests-only-not-secret")[2:10]  # the key's id


def test_fingerprint_is_the_documented_canonical_form(rf: RequestFactory) -> None:
    """Pins version 3: a change to any part of the canonical form, or of how it is keyed,
    fails here, and must come with a new version (see ``keys.fingerprints_match``)."""
    request = rf.generic(
        "POST",
        "/orders/?b=%41&a=2&a=1",
        data=b'{"note": "caf\xc3\xa9", "amount": 1.50, "items": [10, null, true]}',
        content_type="application/json; charset=utf-8",
    )
    parts = [
        b"POST",
        b"POST /orders/",
        b'[["a","2"],["a","1"],["b","A"]]',
        b"application/json",
        b'json:{"amount":15e-1,"items":[1e1,null,true],"note":"caf\xc3\xa9"}',
    ]
    prefixed = b"".join(len(part).to_bytes(8, "big") + part for part in parts)

    value = keys.default_fingerprint(request, "POST /orders/")

    assert value == keyed(hashlib.sha256(prefixed).digest())
    # The same vector as a literal: salted_hmac's construction is part of the promise too.
    assert value == "3:5b12448bd8677cf0121aa05f4c21b2de4533b76c307079b6c2da29f38a7b9024"


def test_fingerprint_ignores_json_key_order_and_whitespace(rf: RequestFactory) -> None:
    compact = b'{"amount":10,"currency":"EUR","meta":{"a":1,"b":[1,2]}}'
    spread = b'{\n  "meta": { "b": [1, 2], "a": 1 },\n  "currency": "EUR",\n  "amount": 10\n}'
    assert fingerprint(rf, compact) == fingerprint(rf, spread)


def test_fingerprint_changes_with_a_json_value(rf: RequestFactory) -> None:
    assert fingerprint(rf, b'{"amount": 10}') != fingerprint(rf, b'{"amount": 11}')


def test_fingerprint_keeps_json_array_order(rf: RequestFactory) -> None:
    assert fingerprint(rf, b'{"items": [1, 2]}') != fingerprint(rf, b'{"items": [2, 1]}')


def test_fingerprint_distinguishes_json_types(rf: RequestFactory) -> None:
    assert fingerprint(rf, b'{"amount": 10}') != fingerprint(rf, b'{"amount": "10"}')


def test_fingerprint_changes_with_the_method(rf: RequestFactory) -> None:
    body = b'{"amount": 10}'
    request_post = rf.generic("POST", "/orders/", data=body, content_type=JSON)
    request_patch = rf.generic("PATCH", "/orders/", data=body, content_type=JSON)
    # Same endpoint string on purpose: the method is a part of its own.
    assert keys.default_fingerprint(request_post, "orders") != keys.default_fingerprint(
        request_patch, "orders"
    )


def test_fingerprint_changes_with_the_endpoint(rf: RequestFactory) -> None:
    request = rf.generic("POST", "/orders/", data=b"{}", content_type=JSON)
    assert keys.default_fingerprint(request, "POST /orders/") != keys.default_fingerprint(
        request, "POST /payments/"
    )


def test_fingerprint_changes_with_the_path(rf: RequestFactory) -> None:
    assert fingerprint(rf, b"{}", path="/orders/1") != fingerprint(rf, b"{}", path="/orders/2")


def test_fingerprint_changes_with_the_query_string(rf: RequestFactory) -> None:
    assert fingerprint(rf, b"{}", path="/orders/?a=1") != fingerprint(rf, b"{}", path="/orders/")
    assert fingerprint(rf, b"{}", path="/orders/?a=1") != fingerprint(
        rf, b"{}", path="/orders/?a=2"
    )


def test_fingerprint_ignores_query_parameter_order(rf: RequestFactory) -> None:
    assert fingerprint(rf, b"{}", path="/orders/?a=1&b=2") == fingerprint(
        rf, b"{}", path="/orders/?b=2&a=1"
    )


def test_fingerprint_keeps_the_order_of_repeated_query_values(rf: RequestFactory) -> None:
    assert fingerprint(rf, b"{}", path="/orders/?a=1&a=2") != fingerprint(
        rf, b"{}", path="/orders/?a=2&a=1"
    )


def test_fingerprint_decodes_the_query_string(rf: RequestFactory) -> None:
    assert fingerprint(rf, b"{}", path="/orders/?a=%41") == fingerprint(
        rf, b"{}", path="/orders/?a=A"
    )


def test_fingerprint_distinguishes_non_utf8_query_values(rf: RequestFactory) -> None:
    assert fingerprint(rf, b"{}", path="/orders/?a=%FF") != fingerprint(
        rf, b"{}", path="/orders/?a=%FE"
    )


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "application/problem+json", "application/vnd.api+json"],
)
def test_fingerprint_parses_json_and_json_suffix_types(
    rf: RequestFactory, content_type: str
) -> None:
    assert fingerprint(rf, b'{"a": 1, "b": 2}', content_type) == fingerprint(
        rf, b'{"b":2,"a":1}', content_type
    )


def test_fingerprint_parses_json_with_a_charset_parameter(rf: RequestFactory) -> None:
    assert fingerprint(rf, b'{"a": 1, "b": 2}', "application/json; charset=utf-8") == (
        fingerprint(rf, b'{"b":2,"a":1}', "application/json; charset=utf-8")
    )


def test_fingerprint_invalid_json_falls_back_to_raw_bytes(rf: RequestFactory) -> None:
    broken = b'{"amount": 10,'
    assert keys.canonical_body(rf.post("/", broken, JSON)) == b"raw:" + broken
    assert fingerprint(rf, broken) != fingerprint(rf, b'{"amount": 11,')
    # Raw bytes: whitespace now counts.
    assert fingerprint(rf, broken) != fingerprint(rf, b'{"amount":10,')


def test_fingerprint_invalid_utf8_json_falls_back_to_raw_bytes(rf: RequestFactory) -> None:
    assert fingerprint(rf, b'{"a": "\xff"}') != fingerprint(rf, b'{"a": "\xfe"}')


def test_fingerprint_survives_a_lone_surrogate_escape_in_json(rf: RequestFactory) -> None:
    assert fingerprint(rf, b'{"a": "\\ud800"}') != fingerprint(rf, b'{"a": "\\ud801"}')


def test_fingerprint_of_deeply_nested_json_is_its_bytes(rf: RequestFactory) -> None:
    depth = 100_000
    body = b"[" * depth + b"]" * depth
    assert keys.canonical_body(rf.post("/", body, JSON)) == b"raw:" + body
    assert fingerprint(rf, body) != fingerprint(rf, b"[" * (depth - 1) + b"]" * (depth - 1))


def test_fingerprint_ignores_form_field_order(rf: RequestFactory) -> None:
    assert fingerprint(rf, "amount=10&currency=EUR", FORM) == fingerprint(
        rf, "currency=EUR&amount=10", FORM
    )


def test_fingerprint_tells_a_json_body_from_a_form_body_with_the_same_fields(
    rf: RequestFactory,
) -> None:
    assert fingerprint(rf, b'{"a": ["1"]}') != fingerprint(rf, "a=1", FORM)


def test_fingerprint_changes_with_a_form_value(rf: RequestFactory) -> None:
    assert fingerprint(rf, "amount=10", FORM) != fingerprint(rf, "amount=11", FORM)


def test_fingerprint_keeps_repeated_form_values_in_order(rf: RequestFactory) -> None:
    assert fingerprint(rf, "item=a&item=b", FORM) != fingerprint(rf, "item=b&item=a", FORM)


def test_fingerprint_decodes_form_escapes(rf: RequestFactory) -> None:
    assert fingerprint(rf, "name=a+b", FORM) == fingerprint(rf, "name=a%20b", FORM)


def test_fingerprint_distinguishes_non_utf8_form_values(rf: RequestFactory) -> None:
    assert fingerprint(rf, "name=%FF", FORM) != fingerprint(rf, "name=%FE", FORM)


@pytest.mark.parametrize("content_type", ["text/plain", "application/octet-stream", "text/csv"])
def test_fingerprint_compares_other_content_types_as_raw_bytes(
    rf: RequestFactory, content_type: str
) -> None:
    assert fingerprint(rf, b'{"a":1,"b":2}', content_type) != fingerprint(
        rf, b'{"b":2,"a":1}', content_type
    )
    assert fingerprint(rf, b"a=1&b=2", content_type) != fingerprint(rf, b"b=2&a=1", content_type)
    assert fingerprint(rf, b"payload", content_type) == fingerprint(rf, b"payload", content_type)


def test_fingerprint_fields_ignores_other_json_fields(rf: RequestFactory) -> None:
    fields = ("amount",)
    assert fingerprint(rf, b'{"amount": 10, "note": "x"}', fields=fields) == fingerprint(
        rf, b'{"note": "y", "amount": 10}', fields=fields
    )
    assert fingerprint(rf, b'{"amount": 10, "note": "x"}', fields=fields) != fingerprint(
        rf, b'{"amount": 11, "note": "x"}', fields=fields
    )


def test_fingerprint_without_fields_sees_every_field(rf: RequestFactory) -> None:
    assert fingerprint(rf, b'{"amount": 10, "note": "x"}') != fingerprint(
        rf, b'{"amount": 10, "note": "y"}'
    )


def test_fingerprint_fields_applies_to_form_bodies(rf: RequestFactory) -> None:
    fields = ("amount", "currency")
    assert fingerprint(rf, "amount=10&currency=EUR&note=x", FORM, fields=fields) == fingerprint(
        rf, "note=y&currency=EUR&amount=10", FORM, fields=fields
    )
    assert fingerprint(rf, "amount=10&currency=EUR", FORM, fields=fields) != fingerprint(
        rf, "amount=10&currency=USD", FORM, fields=fields
    )


def test_fingerprint_fields_still_counts_the_query_string(rf: RequestFactory) -> None:
    fields = ("amount",)
    assert fingerprint(rf, b'{"amount": 10}', path="/o/?a=1", fields=fields) != fingerprint(
        rf, b'{"amount": 10}', path="/o/?a=2", fields=fields
    )


def constant_body(value: str | bytes) -> keys.Fingerprinter:
    def body(request: HttpRequest) -> str | bytes:
        return value

    return body


def test_fingerprint_body_callable_replaces_the_body_part(rf: RequestFactory) -> None:
    same = constant_body("order-42")
    assert fingerprint(rf, b'{"amount": 10}', body=same) == fingerprint(
        rf, b'{"amount": 99}', body=same
    )
    assert fingerprint(rf, b'{"amount": 10}', body=same) != fingerprint(
        rf, b'{"amount": 10}', body=constant_body("order-43")
    )


def test_fingerprint_body_callable_may_return_str_or_bytes(rf: RequestFactory) -> None:
    assert fingerprint(rf, b"{}", body=constant_body("order-42")) == fingerprint(
        rf, b"{}", body=constant_body(b"order-42")
    )
    assert fingerprint(rf, b"{}", body=constant_body("\u00e9")) == fingerprint(
        rf, b"{}", body=constant_body("\u00e9".encode())
    )


def test_fingerprint_body_callable_receives_the_request(rf: RequestFactory) -> None:
    seen: list[HttpRequest] = []

    def body(request: HttpRequest) -> str:
        seen.append(request)
        return request.headers.get("X-Order", "")

    first = rf.post("/orders/", headers={"X-Order": "1"})
    second = rf.post("/orders/", headers={"X-Order": "2"})
    assert keys.default_fingerprint(first, "e", body=body) != keys.default_fingerprint(
        second, "e", body=body
    )
    assert seen == [first, second]


def test_fingerprint_body_callable_still_counts_method_endpoint_and_query(
    rf: RequestFactory,
) -> None:
    same = constant_body("x")
    base = fingerprint(rf, b"{}", body=same)
    assert base != fingerprint(rf, b"{}", method="PATCH", body=same)
    assert base != fingerprint(rf, b"{}", path="/other/", body=same)
    assert base != fingerprint(rf, b"{}", path="/orders/?a=1", body=same)


def test_digest_is_length_prefixed() -> None:
    assert keys.digest(b"ab", b"c") != keys.digest(b"a", b"bc")
    assert keys.digest(b"a", b"") != keys.digest(b"a")
    assert keys.digest(b"", b"a") != keys.digest(b"a", b"")
    assert keys.digest(b"ab", b"c") == keys.digest(b"ab", b"c")


def test_canonical_body_is_sorted_compact_json(rf: RequestFactory) -> None:
    request = rf.generic("POST", "/", data=b'{"b": 1, "a": [1, 2]}', content_type=JSON)
    assert keys.canonical_body(request) == b'json:{"a":[1,2],"b":1}'


def test_canonical_body_of_a_form(rf: RequestFactory) -> None:
    request = rf.generic("POST", "/", data=b"b=2&a=1&b=1", content_type=FORM)
    assert keys.canonical_body(request) == b'form:{"a":["1"],"b":["2","1"]}'


def test_canonical_body_returns_raw_bytes_for_other_types(rf: RequestFactory) -> None:
    request = rf.generic("POST", "/", data=b'{"b": 1}', content_type="text/plain")
    assert keys.canonical_body(request) == b'raw:{"b": 1}'


def test_fingerprint_ignores_media_type_parameters_on_a_drf_style_request(
    rf: RequestFactory,
) -> None:
    class FullContentType:
        """Like DRF's Request: ``content_type`` keeps the parameters."""

        def __init__(self, request: Any) -> None:
            self._request = request

        def __getattr__(self, name: str) -> Any:
            return getattr(self._request, name)

        @property
        def content_type(self) -> str:
            return str(self._request.META["CONTENT_TYPE"])

    plain = rf.post("/o/", data=b'{"a": 1, "b": 2}', content_type="application/json")
    with_charset = FullContentType(
        rf.post("/o/", data=b'{"b":2,"a":1}', content_type="application/json; charset=utf-8")
    )

    assert keys.default_fingerprint(plain, "POST /o/") == keys.default_fingerprint(
        with_charset,  # type: ignore[arg-type]
        "POST /o/",
    )


def test_fingerprint_of_a_multipart_body_already_parsed(rf: RequestFactory) -> None:
    def parsed(note: str) -> str:
        request = rf.post("/o/", data={"note": note, "amount": "1"})
        assert request.POST["note"] == note  # reads the stream: .body is gone now
        return keys.default_fingerprint(request, "POST /o/")

    assert parsed("a") != parsed("b")
    # Parsed first or not, the same form is the same request.
    unparsed = rf.post("/o/", data={"note": "a", "amount": "1"})
    assert parsed("a") == keys.default_fingerprint(unparsed, "POST /o/")
