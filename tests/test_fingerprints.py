"""Fingerprints that tell retries from different requests: multipart bodies (whatever the
boundary, whoever parsed them), exact JSON numbers, repeated query values, absent fields,
hostile bodies, task arguments at full precision, and the fingerprint's version."""

from __future__ import annotations

import hashlib
import io
import json
import re
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest
import requests
from asgiref.sync import async_to_sync
from django.contrib.auth.models import User
from django.core.files.uploadedfile import SimpleUploadedFile, UploadedFile
from django.http import HttpRequest, QueryDict
from django.http.multipartparser import MultiPartParserError
from django.http.request import RawPostDataException
from django.test import AsyncClient, Client, RequestFactory, override_settings
from django.test.client import encode_multipart
from django.utils.datastructures import MultiValueDict
from django.utils.functional import lazy
from django.utils.safestring import mark_safe
from rest_framework.exceptions import ParseError, UnsupportedMediaType
from rest_framework.parsers import BaseParser, JSONParser, MultiPartParser
from rest_framework.request import Request
from rest_framework.test import APIClient

from idempotency_django.core import keys
from idempotency_django.models import FINGERPRINT_MAX_LENGTH, IdempotencyRecord
from tests import records
from tests.conftest import effects, keyed
from tests.project import fingerprint_views

JSON = "application/json"
FORM = "application/x-www-form-urlencoded"
VERSION_3 = re.compile(r"3:[0-9a-f]{64}")


def fingerprint(request: Any, fields: tuple[str, ...] | None = None) -> str:
    return keys.default_fingerprint(request, "POST /o/", fields=fields)


def json_request(rf: RequestFactory, body: bytes, path: str = "/o/") -> HttpRequest:
    return rf.generic("POST", path, data=body, content_type=JSON)


# -- multipart ------------------------------------------------------------------------------


def multipart_body(
    boundary: str,
    fields: Mapping[str, str | list[str]] | None = None,
    files: Mapping[str, tuple[str, bytes, str]] | None = None,
) -> tuple[bytes, str]:
    """A multipart/form-data body and its Content-Type, with this boundary."""
    data: dict[str, Any] = dict(fields or {})
    for name, (filename, content, content_type) in (files or {}).items():
        data[name] = SimpleUploadedFile(filename, content, content_type)
    return encode_multipart(boundary, data), f"multipart/form-data; boundary={boundary}"


def multipart_request(
    rf: RequestFactory,
    boundary: str = "boundary-one",
    fields: Mapping[str, str | list[str]] | None = None,
    files: Mapping[str, tuple[str, bytes, str]] | None = None,
    *,
    method: str = "POST",
    parsed_first: bool = False,
) -> HttpRequest:
    body, content_type = multipart_body(boundary, fields, files)
    request = rf.generic(method, "/o/", data=body, content_type=content_type)
    if parsed_first:
        assert request.POST is not None  # CsrfViewMiddleware does this; .body is gone now
    return request


RECEIPT = {"doc": ("receipt.txt", b"paid 10 EUR", "text/plain")}
SAME_SIZE = {"doc": ("receipt.txt", b"paid 99 EUR", "text/plain")}
NOTE = {"note": "first", "amount": "10"}


@pytest.mark.parametrize("parsed_first", [False, True], ids=["unparsed", "parsed-first"])
def test_multipart_boundary_does_not_count(rf: RequestFactory, parsed_first: bool) -> None:
    one = multipart_request(rf, "boundary-one", NOTE, RECEIPT, parsed_first=parsed_first)
    two = multipart_request(rf, "----WebKitFormBoundary7MA4YWxk", NOTE, RECEIPT)

    assert fingerprint(one) == fingerprint(two)


def test_multipart_retries_from_requests_with_random_boundaries_match(rf: RequestFactory) -> None:
    def sent_by_requests() -> tuple[HttpRequest, str]:
        prepared = requests.Request(
            "POST",
            "http://testserver/o/",
            data={"amount": "10"},
            files={"doc": ("receipt.txt", b"paid 10 EUR", "text/plain")},
        ).prepare()
        content_type = str(prepared.headers["Content-Type"])
        body = prepared.body
        assert isinstance(body, bytes)
        return rf.generic("POST", "/o/", data=body, content_type=content_type), content_type

    first, first_type = sent_by_requests()
    retry, retry_type = sent_by_requests()

    assert first_type != retry_type  # a new random boundary
    assert fingerprint(first) == fingerprint(retry)


@pytest.mark.parametrize(
    ("first_parsed", "second_parsed"), [(False, False), (True, True), (True, False)]
)
def test_multipart_file_contents_count_not_just_name_and_size(
    rf: RequestFactory, first_parsed: bool, second_parsed: bool
) -> None:
    first = multipart_request(rf, fields=NOTE, files=RECEIPT, parsed_first=first_parsed)
    other = multipart_request(rf, fields=NOTE, files=SAME_SIZE, parsed_first=second_parsed)

    assert fingerprint(first) != fingerprint(other)


@pytest.mark.parametrize(
    "changed",
    [
        {"fields": {**NOTE, "amount": "11"}},
        {"fields": {"note": "first"}},
        {"files": {"doc": ("other.txt", b"paid 10 EUR", "text/plain")}},
        {"files": {"doc": ("receipt.txt", b"paid 10 EUR", "application/pdf")}},
        {"files": {"scan": ("receipt.txt", b"paid 10 EUR", "text/plain")}},
        {"files": {}},
    ],
    ids=["field-value", "field-missing", "file-name", "file-type", "file-field", "no-file"],
)
def test_multipart_fingerprint_changes_with_any_field_or_file(
    rf: RequestFactory, changed: dict[str, Any]
) -> None:
    base = fingerprint(multipart_request(rf, fields=NOTE, files=RECEIPT))
    parts: dict[str, Any] = {"fields": NOTE, "files": RECEIPT, **changed}

    assert fingerprint(multipart_request(rf, "other-boundary", **parts)) != base


def test_multipart_keeps_the_order_of_repeated_values(rf: RequestFactory) -> None:
    ordered = multipart_request(rf, fields={"item": ["a", "b"]})
    reversed_ = multipart_request(rf, fields={"item": ["b", "a"]})

    assert fingerprint(ordered) != fingerprint(reversed_)


def test_multipart_is_not_the_same_request_as_a_url_encoded_form(rf: RequestFactory) -> None:
    """Different media types: the view may treat them differently, so they are different."""
    as_multipart = multipart_request(rf, fields={"amount": "10"})
    as_form = rf.post("/o/", data="amount=10", content_type=FORM)

    assert as_multipart.POST == as_form.POST
    assert fingerprint(as_multipart) != fingerprint(as_form)


def test_multipart_uploads_are_rewound_for_the_view(rf: RequestFactory) -> None:
    request = multipart_request(rf, fields=NOTE, files=RECEIPT)

    fingerprint(request)

    assert request.FILES["doc"].read() == b"paid 10 EUR"


class ChunksOnly(UploadedFile):  # type: ignore[type-arg]
    """An upload that refuses to be read whole: only ``chunks()`` may read it."""

    def __init__(self, content: bytes) -> None:
        super().__init__(io.BytesIO(content), "big.bin", "application/octet-stream", len(content))
        self.sizes: list[int] = []

    def read(self, size: int | None = -1) -> bytes:
        assert size is not None, "read the whole upload into memory"
        assert size > 0, "read the whole upload into memory"
        self.sizes.append(size)
        return self.file.read(size)  # type: ignore[union-attr,no-any-return]


def test_multipart_uploads_are_hashed_chunk_by_chunk(rf: RequestFactory) -> None:
    content = bytes(range(256)) * 1024  # 256 KiB: four 64 KiB chunks
    streamed = rf.post("/o/", data=b"--b--", content_type="multipart/form-data; boundary=b")
    upload = ChunksOnly(content)
    streamed._post, streamed._files = QueryDict(), MultiValueDict({"doc": [upload]})  # type: ignore[attr-defined]
    parsed = multipart_request(rf, files={"doc": ("big.bin", content, "application/octet-stream")})

    assert fingerprint(streamed) == fingerprint(parsed)
    assert len(upload.sizes) >= 4
    assert upload.tell() == 0


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1024, FILE_UPLOAD_MAX_MEMORY_SIZE=1024)
def test_multipart_uploads_beyond_the_body_size_limit_are_fingerprinted(
    rf: RequestFactory,
) -> None:
    big = {"doc": ("big.bin", b"x" * 100_000, "application/octet-stream")}
    bigger = {"doc": ("big.bin", b"x" * 99_999 + b"y", "application/octet-stream")}

    first = multipart_request(rf, "one", NOTE, big)
    assert fingerprint(first) == fingerprint(multipart_request(rf, "two", NOTE, big))
    assert fingerprint(first) != fingerprint(multipart_request(rf, "two", NOTE, bigger))
    assert first.FILES["doc"].read() == b"x" * 100_000  # spooled to disk, and rewound


def test_multipart_fields_limit_fields_and_files(rf: RequestFactory) -> None:
    fields = ("amount", "doc")
    base = multipart_request(rf, fields=NOTE, files=RECEIPT)
    other_note = multipart_request(rf, fields={**NOTE, "note": "second"}, files=RECEIPT)
    other_doc = multipart_request(rf, fields=NOTE, files=SAME_SIZE)
    no_amount = multipart_request(rf, fields={"note": "first"}, files=RECEIPT)
    empty_amount = multipart_request(rf, fields={"note": "first", "amount": ""}, files=RECEIPT)

    assert fingerprint(base, fields) == fingerprint(other_note, fields)
    assert fingerprint(base, fields) != fingerprint(other_doc, fields)
    assert fingerprint(no_amount, fields) != fingerprint(empty_amount, fields)


def test_a_malformed_multipart_post_raises_as_it_would_in_the_view(rf: RequestFactory) -> None:
    """Swallowing it would run the view with the empty POST Django leaves behind."""
    request = rf.generic(
        "POST", "/o/", data=b"no boundary here", content_type="multipart/form-data"
    )

    with pytest.raises(MultiPartParserError):
        fingerprint(request)


@pytest.mark.parametrize("method", ["PATCH", "PUT"])
def test_multipart_patch_is_parsed_from_a_copy(rf: RequestFactory, method: str) -> None:
    """Django parses multipart for POST only; the view gets its request untouched."""
    first = multipart_request(rf, "one", NOTE, RECEIPT, method=method)
    retry = multipart_request(rf, "two", NOTE, RECEIPT, method=method)
    other = multipart_request(rf, "two", NOTE, SAME_SIZE, method=method)

    assert fingerprint(first) == fingerprint(retry)
    assert fingerprint(first) != fingerprint(other)
    assert b"paid 10 EUR" in first.body
    assert not first.POST
    assert not first.FILES


def test_a_malformed_multipart_patch_is_compared_as_bytes(rf: RequestFactory) -> None:
    def patch(body: bytes) -> HttpRequest:
        return rf.generic("PATCH", "/o/", data=body, content_type="multipart/form-data")

    assert keys.canonical_body(patch(b"one")) == b"raw:one"
    assert fingerprint(patch(b"one")) != fingerprint(patch(b"two"))


def test_multipart_patch_the_application_parsed_itself(rf: RequestFactory) -> None:
    def parsed_by_the_app(files: dict[str, tuple[str, bytes, str]]) -> HttpRequest:
        request = multipart_request(rf, fields=NOTE, files=files, method="PATCH")
        request._post, request._files = request.parse_file_upload(request.META, request)  # type: ignore[attr-defined]
        return request

    assert fingerprint(parsed_by_the_app(RECEIPT)) == fingerprint(
        multipart_request(rf, "other", NOTE, RECEIPT, method="PATCH")
    )
    assert fingerprint(parsed_by_the_app(RECEIPT)) != fingerprint(parsed_by_the_app(SAME_SIZE))


# -- Django REST framework's Request --------------------------------------------------------


def drf(request: HttpRequest, *parsers: BaseParser) -> Request:
    return Request(request, parsers=list(parsers))


@pytest.mark.parametrize("data_first", [False, True], ids=["unparsed", "data-read-first"])
def test_drf_multipart_matches_the_plain_request(rf: RequestFactory, data_first: bool) -> None:
    wrapped = drf(multipart_request(rf, "one", NOTE, RECEIPT), MultiPartParser())
    if data_first:
        assert wrapped.data["note"] == "first"

    assert fingerprint(wrapped) == fingerprint(multipart_request(rf, "two", NOTE, RECEIPT))
    assert wrapped.data["doc"].read() == b"paid 10 EUR"


def test_drf_multipart_after_django_parsed_it(rf: RequestFactory) -> None:
    wrapped = drf(multipart_request(rf, "one", NOTE, RECEIPT, parsed_first=True), MultiPartParser())
    other = drf(multipart_request(rf, "two", NOTE, SAME_SIZE, parsed_first=True), MultiPartParser())

    assert fingerprint(wrapped) == fingerprint(multipart_request(rf, "two", NOTE, RECEIPT))
    assert fingerprint(wrapped) != fingerprint(other)


def test_drf_malformed_multipart_raises_drfs_parse_error(rf: RequestFactory) -> None:
    request = rf.generic("POST", "/o/", data=b"no boundary", content_type="multipart/form-data")

    with pytest.raises(ParseError):
        fingerprint(drf(request, MultiPartParser()))


def test_drf_view_without_a_multipart_parser_keeps_its_415(rf: RequestFactory) -> None:
    first = drf(multipart_request(rf, "one", NOTE, RECEIPT), JSONParser())
    retry = drf(multipart_request(rf, "two", NOTE, RECEIPT), JSONParser())
    other = drf(multipart_request(rf, "two", NOTE, SAME_SIZE), JSONParser())

    assert fingerprint(first) == fingerprint(retry)
    assert fingerprint(first) != fingerprint(other)
    with pytest.raises(UnsupportedMediaType):
        first.data  # noqa: B018 - the view still gets DRF's answer


class StreamingJSONParser(BaseParser):
    """A parser that reads the stream itself (DRF's own JSONParser reads ``request.body``)."""

    media_type = JSON

    def parse(self, stream: Any, media_type: Any = None, parser_context: Any = None) -> Any:
        return json.load(stream)


def test_drf_body_consumed_by_a_parser_is_fingerprinted_by_its_data(rf: RequestFactory) -> None:
    def parsed(body: bytes) -> Request:
        wrapped = drf(json_request(rf, body), StreamingJSONParser())
        assert wrapped.data is not None
        with pytest.raises(RawPostDataException):
            wrapped.body  # noqa: B018
        return wrapped

    compact = parsed(b'{"amount":10,"items":["a","b"]}')
    spaced = parsed(b'{"items": ["a", "b"], "amount": 10}')

    assert keys.canonical_body(compact) == b'data:{"amount":1e1,"items":["a","b"]}'
    assert fingerprint(compact) == fingerprint(spaced)
    assert fingerprint(compact) != fingerprint(parsed(b'{"amount":11,"items":["a","b"]}'))
    assert fingerprint(compact, ("amount",)) == fingerprint(
        parsed(b'{"amount":10,"items":[]}'), ("amount",)
    )


class StreamingFormParser(BaseParser):
    """A form parser that reads the stream itself, as DRF's own did before 3.16."""

    media_type = FORM

    def parse(self, stream: Any, media_type: Any = None, parser_context: Any = None) -> Any:
        return QueryDict(stream.read())


def test_drf_form_consumed_by_a_parser_counts_every_value(rf: RequestFactory) -> None:
    def parsed(body: bytes) -> Request:
        wrapped = drf(rf.post("/o/", body, FORM), StreamingFormParser())
        assert wrapped.data is not None
        return wrapped

    assert keys.canonical_body(parsed(b"b=1&a=1&a=2")) == b'data:{"a":["1","2"],"b":["1"]}'
    assert fingerprint(parsed(b"a=1&a=2")) != fingerprint(parsed(b"a=2&a=1"))


class Odd:
    def __str__(self) -> str:
        return "odd"


def test_drf_parsed_data_of_other_types_still_fingerprints(rf: RequestFactory) -> None:
    values = [float("nan"), Decimal("Infinity"), Odd(), SimpleUploadedFile("a.txt", b"a")]
    wrapped = drf(json_request(rf, b"{}"))
    wrapped._request._read_started = True  # type: ignore[attr-defined]
    wrapped._full_data = {"values": values}

    assert keys.canonical_body(wrapped) == (
        b'data:{"values":[nan,Infinity,object:"tests.test_fingerprints.Odd:odd",'
        b'file:["a.txt","text/plain",null,"' + hashlib.sha256(b"a").hexdigest().encode() + b'"]]}'
    )


def test_a_plain_request_whose_stream_was_read_cannot_be_fingerprinted(
    rf: RequestFactory,
) -> None:
    """Counting every such body as the same request would replay one response to another."""
    request = json_request(rf, b'{"amount": 10}')
    request.read()

    with pytest.raises(RawPostDataException, match="fingerprint="):
        fingerprint(request)


# -- query strings, JSON numbers and fields -------------------------------------------------


def test_repeated_query_values_keep_their_order(rf: RequestFactory) -> None:
    def query(path: str) -> str:
        return fingerprint(json_request(rf, b"{}", path))

    assert query("/o/?a=1&a=2") != query("/o/?a=2&a=1")
    assert query("/o/?a=1&b=3&a=2") == query("/o/?b=3&a=1&a=2")


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (b"0.1", b"0.1000000000000000055511151231257827"),
        (b"1", b"1.0000000000000000000000000001"),
        (b"1e400", b"1e401"),
        (str(10**400).encode(), str(10**400 + 1).encode()),
        (b"9007199254740993", b"9007199254740992"),
    ],
)
def test_json_numbers_are_compared_exactly(rf: RequestFactory, one: bytes, other: bytes) -> None:
    def amount(number: bytes) -> str:
        return fingerprint(json_request(rf, b'{"amount": ' + number + b"}"))

    assert amount(one) != amount(other)


@pytest.mark.parametrize("spelling", [b"1.0", b"1e0", b"10e-1", b"1.000E+0", b"0.01e2"])
def test_one_json_number_value_has_one_fingerprint(rf: RequestFactory, spelling: bytes) -> None:
    def amount(number: bytes) -> bytes:
        return keys.canonical_body(json_request(rf, b'{"amount": ' + number + b"}"))

    assert amount(spelling) == amount(b"1") == b'json:{"amount":1}'


def test_json_zero_has_one_fingerprint(rf: RequestFactory) -> None:
    bodies = [b"[0]", b"[-0]", b"[0.0]", b"[-0e5]"]

    assert {keys.canonical_body(json_request(rf, body)) for body in bodies} == {b"json:[0]"}


def test_canonical_json_numbers(rf: RequestFactory) -> None:
    body = b"[100, -120, 0.5, 1e400, 123456789012345678901234567890, 2.50]"

    assert keys.canonical_body(json_request(rf, body)) == (
        b"json:[1e2,-12e1,5e-1,1e400,12345678901234567890123456789e1,25e-1]"
    )


def test_an_absent_field_and_null_differ_under_fields(rf: RequestFactory) -> None:
    fields = ("amount", "note")
    absent = json_request(rf, b'{"amount": 1}')
    null = json_request(rf, b'{"amount": 1, "note": null}')

    assert fingerprint(absent, fields) != fingerprint(null, fields)
    assert fingerprint(absent, fields) == fingerprint(
        json_request(rf, b'{"amount": 1, "other": 2}'), fields
    )


def test_an_absent_form_field_and_an_empty_one_differ_under_fields(rf: RequestFactory) -> None:
    fields = ("amount", "note")

    assert fingerprint(rf.post("/o/", "amount=1", FORM), fields) != fingerprint(
        rf.post("/o/", "amount=1&note=", FORM), fields
    )


# -- hostile bodies -------------------------------------------------------------------------

DEEP = b"[" * 5000 + b"]" * 5000

HOSTILE_JSON = [
    pytest.param(DEEP, b"[" * 4999 + b"]" * 4999, id="deep-5000"),
    pytest.param(b"[" * 129 + b"]" * 129, b"[" * 130 + b"]" * 130, id="deeper-than-the-limit"),
    pytest.param(b'{"a": ' + b"9" * 5000 + b"}", b'{"a": ' + b"9" * 4999 + b"}", id="5000-digits"),
    pytest.param(b'{"a": 1e999999999999999999999}', b'{"a": 1e99999999999999999999}', id="exp"),
    pytest.param(b'{"a": NaN}', b'{"a": Infinity}', id="nan"),
    pytest.param(b'{"a": -Infinity}', b'{"a": Infinity}', id="infinity"),
    pytest.param(b'{"a": "\xff"}', b'{"a": "\xfe"}', id="invalid-utf8"),
    # Without the kind tag, the raw bytes would equal the canonical form of the escape.
    pytest.param(b'{"a":"\xed\xa0\x80"}', b'{"a":"\\ud800"}', id="encoded-surrogate"),
    pytest.param(b'{"a": "\\ud800"}', b'{"a": "\\udc00"}', id="lone-surrogate"),
    pytest.param(b'{"a": "\\ud800\\udc00"}', b'{"a": "\\udc00\\ud800"}', id="surrogate-pair"),
    pytest.param(b'{"a": "\\u0000"}', b'{"a": ""}', id="nul-escape"),
    pytest.param(b'{"a": "\x00"}', b'{"a": "\\u0000"}', id="raw-nul"),
    pytest.param(b"\x00", b"", id="nul-body"),
    pytest.param(b"\xef\xbb\xbf{}", b"{}", id="bom"),
]


@pytest.mark.parametrize(("body", "near"), HOSTILE_JSON)
def test_hostile_json_gets_a_defined_fingerprint(
    rf: RequestFactory, body: bytes, near: bytes
) -> None:
    value = fingerprint(json_request(rf, body))

    assert VERSION_3.fullmatch(value)
    assert value == fingerprint(json_request(rf, bytes(body)))
    assert value != fingerprint(json_request(rf, near))


@pytest.mark.parametrize(
    "body",
    [
        DEEP,
        b"[" * 129 + b"]" * 129,
        b'{"a": NaN}',
        b'{"a": 1e999999999999999999999}',
        b'{"a": "\xff"}',
        b'{"a": "\x00"}',
        b'{"a": "\xed\xa0\x80"}',
        b"\xef\xbb\xbf{}",
        '{"a": 1}'.encode("utf-16"),
    ],
)
def test_json_that_is_not_rfc_8259_is_compared_as_bytes(rf: RequestFactory, body: bytes) -> None:
    assert keys.canonical_body(json_request(rf, body)) == b"raw:" + body


def test_json_up_to_the_depth_limit_is_canonical(rf: RequestFactory) -> None:
    depth = keys.MAX_JSON_DEPTH
    nested = b"[" * depth + b"]" * depth

    assert keys.canonical_body(json_request(rf, nested + b" ")) == b"json:" + nested


def test_an_integer_longer_than_int_reads_is_still_canonical(rf: RequestFactory) -> None:
    """Integers parse as int in C; one past ``sys.get_int_max_str_digits`` (4300) is read
    as a Decimal instead, so the form never depends on a process's int limit."""
    long_int = b'{"a": 1' + b"0" * 5000 + b"}"

    assert keys.canonical_body(json_request(rf, long_int)) == b'json:{"a":1e5000}'
    assert fingerprint(json_request(rf, long_int)) == fingerprint(
        json_request(rf, b'{"a": 1e5000}')
    )


# -- Django's limits: what a body may cost before the view runs ------------------------------


def json_values(count: int) -> bytes:
    """A JSON array holding ``count`` values in all (the array is one of them)."""
    return b"[" + b",".join([b"1.5"] * (count - 1)) + b"]"


def form_fields(count: int) -> bytes:
    return b"&".join(b"f%d=%d" % (n, n) for n in range(count))


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"[" + b",".join([b"1.5"] * 10) + b"]", id="numbers"),
        pytest.param(b"[" + b",".join([b'"s"'] * 10) + b"]", id="strings"),
        pytest.param(b"[" + b",".join([b"null"] * 10) + b"]", id="nulls"),
        pytest.param(b"[" + b",".join([b"[]"] * 10) + b"]", id="arrays"),
        pytest.param(b"{" + b",".join(b'"k%d":1' % n for n in range(10)) + b"}", id="members"),
        pytest.param(b'{"a":[1,2,3,4],"b":{"c":[5,6,7]},"d":8}', id="nested"),
    ],
)
def test_json_of_more_values_than_django_allows_fields_is_compared_as_bytes(
    rf: RequestFactory, settings: Any, body: bytes
) -> None:
    """Every value counts (the body itself, each member and item); past
    ``DATA_UPLOAD_MAX_NUMBER_FIELDS`` the canonical form gives way to the bytes."""
    settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = 10

    assert keys.canonical_body(json_request(rf, body)) == b"raw:" + body


def test_json_of_exactly_the_allowed_number_of_values_is_canonical(
    rf: RequestFactory, settings: Any
) -> None:
    settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = 10
    nested = b'{"a":[1,2,3],"b":{"c":[5.0,6]},"d":null}'  # 10 values

    assert (
        keys.canonical_body(json_request(rf, nested))
        == b'json:{"a":[1,2,3],"b":{"c":[5,6]},"d":null}'
    )
    assert keys.canonical_body(json_request(rf, json_values(10))).startswith(b"json:")
    assert keys.canonical_body(json_request(rf, json_values(11))).startswith(b"raw:")


def test_without_djangos_limit_every_json_body_is_canonical(
    rf: RequestFactory, settings: Any
) -> None:
    settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = None
    body = json_values(5000)

    assert keys.canonical_body(json_request(rf, body)).startswith(b"json:")


def test_the_limit_counts_the_fields_compared_under_fingerprint_fields(
    rf: RequestFactory, settings: Any
) -> None:
    settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = 10
    body = b'{"amount": 10.50, "items": ' + json_values(50) + b"}"

    picked = keys.canonical_body(json_request(rf, body), fields=("amount",))

    assert picked == b'json:{"amount":105e-1}'


class CountingDecimal(Decimal):
    """``Decimal``, counting the values made; past twice the limit it stops the parse, so a
    parse that ignores the limit fails at once rather than after 650,000 of them."""

    made = 0

    def __new__(cls, *args: Any) -> CountingDecimal:
        CountingDecimal.made += 1
        if CountingDecimal.made > 2002:
            raise AssertionError("the parse went on past DATA_UPLOAD_MAX_NUMBER_FIELDS")
        return super().__new__(cls, *args)


def test_a_large_json_body_stops_being_parsed_at_the_limit(
    rf: RequestFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2.5 MiB array of numbers (the largest body Django reads by default) made 650,000
    Decimals and a canonical form of them: seconds and 100+ MB. Past
    ``DATA_UPLOAD_MAX_NUMBER_FIELDS`` (1000) values, the parse stops."""
    from idempotency_django.core import fingerprint as module

    monkeypatch.setattr(module, "Decimal", CountingDecimal)
    CountingDecimal.made = 0
    body = json_values(2_621_440 // 4)

    assert keys.canonical_body(json_request(rf, body)) == b"raw:" + body
    assert CountingDecimal.made <= 1001


@pytest.mark.parametrize(("count", "kind"), [(10, b"form:"), (11, b"raw:")])
def test_a_form_of_more_fields_than_django_allows_is_compared_as_bytes(
    rf: RequestFactory, settings: Any, count: int, kind: bytes
) -> None:
    """As Django's ``request.POST`` refuses it: ``DATA_UPLOAD_MAX_NUMBER_FIELDS``."""
    settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = 10
    body = form_fields(count)

    canonical = keys.canonical_body(rf.generic("POST", "/o/", data=body, content_type=FORM))

    assert canonical.startswith(kind)
    if kind == b"raw:":
        assert canonical == b"raw:" + body


def test_a_query_string_of_more_fields_than_django_allows_is_compared_as_it_is(
    rf: RequestFactory, settings: Any
) -> None:
    settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = 2

    def with_query(query: str) -> str:
        return fingerprint(json_request(rf, b"{}", f"/o/?{query}"))

    assert with_query("a=1&b=2") == with_query("b=2&a=1")  # within the limit: sorted
    assert with_query("a=1&b=2&c=3") != with_query("c=3&b=2&a=1")  # past it: as sent
    assert with_query("a=1&b=2&c=3") == with_query("a=1&b=2&c=3")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        pytest.param(form_fields(150_000), FORM, id="form"),
        pytest.param(json_values(500_000), JSON, id="json"),
    ],
)
def test_a_body_past_djangos_limits_is_protected_and_replayed(
    alice: User, client: Client, body: bytes, content_type: str
) -> None:
    assert len(body) > 1_000_000
    first = send(client, "/effect/", body, content_type)
    retry = send(client, "/effect/", body, content_type)
    other = send(
        client,
        "/effect/",
        body + b"&x=1" if content_type == FORM else body[:-1] + b",2]",
        content_type,
    )

    assert (first.status_code, retry.status_code, other.status_code) == (201, 201, 422)
    assert retry["Idempotent-Replayed"] == "true"
    assert effects() == 1


@pytest.mark.parametrize(
    ("body", "near"),
    [
        pytest.param(b"a=%FF", b"a=%FE", id="invalid-utf8-escape"),
        pytest.param(b"a=\xff", b"a=\xfe", id="invalid-utf8-byte"),
        pytest.param(b"a=%ED%A0%80", b"a=%ED%B0%80", id="encoded-surrogate"),
        pytest.param(b"a=%00", b"a=", id="nul-escape"),
        pytest.param(b"a=\x00", b"a=", id="nul-byte"),
        pytest.param(b"%00=1", b"=1", id="nul-name"),
        pytest.param(b"a=" + b"9" * 5000, b"a=" + b"9" * 4999, id="long-value"),
        pytest.param(b"&&&=&=%", b"=", id="junk"),
    ],
)
def test_hostile_forms_get_a_defined_fingerprint(
    rf: RequestFactory, body: bytes, near: bytes
) -> None:
    def form(payload: bytes) -> str:
        return fingerprint(rf.generic("POST", "/o/", data=payload, content_type=FORM))

    assert VERSION_3.fullmatch(form(body))
    assert form(body) == form(bytes(body))
    assert form(body) != form(near)


@pytest.mark.parametrize(
    ("query", "near"),
    [("a=%FF", "a=%FE"), ("a=%00", "a="), ("a=%ED%A0%80", "a=%ED%B0%80"), ("a=%", "a=")],
)
def test_hostile_query_strings_get_a_defined_fingerprint(
    rf: RequestFactory, query: str, near: str
) -> None:
    def with_query(value: str) -> str:
        return fingerprint(json_request(rf, b"{}", f"/o/?{value}"))

    assert VERSION_3.fullmatch(with_query(query))
    assert with_query(query) != with_query(near)


def test_hostile_multipart_values_get_a_defined_fingerprint(rf: RequestFactory) -> None:
    nul = multipart_request(rf, fields={"a": "\x00"}, files={"f\x00": ("n\x00", b"\x00", "x/y")})
    empty = multipart_request(rf, fields={"a": ""}, files={"f": ("n", b"", "x/y")})

    assert VERSION_3.fullmatch(fingerprint(nul))
    assert fingerprint(nul) != fingerprint(empty)


# -- the canonical writer -------------------------------------------------------------------


def test_a_canonical_form_never_equals_another_kinds_bytes(rf: RequestFactory) -> None:
    """``{"a":1}`` parsed, and the same bytes sent as text/plain, are different requests even
    under one media type label: each body form is tagged with its kind."""
    as_json = keys.canonical_body(json_request(rf, b'{"a":1}'))
    as_raw = keys.canonical_body(rf.generic("POST", "/o/", data=b'{"a":1}', content_type="x/y"))

    assert as_json == b'json:{"a":1}'
    assert as_raw == b'raw:{"a":1}'


# -- task fingerprints ----------------------------------------------------------------------

LABEL = "Task 'tests.refund'"


def task(work: Any, endpoint: str = "task:tests.refund") -> str:
    return keys.task_fingerprint(endpoint, work, LABEL)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        pytest.param(
            datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=timezone.utc),
            datetime(2024, 5, 1, 12, 0, 0, 123999, tzinfo=timezone.utc),
            id="datetime-microseconds",
        ),
        pytest.param(time(12, 0, 0, 1), time(12, 0, 0, 2), id="time-microseconds"),
        pytest.param(
            datetime(2024, 5, 1, 12, tzinfo=timezone.utc), datetime(2024, 5, 1, 12), id="aware"
        ),
        pytest.param(Decimal("0.1"), 0.1, id="decimal-vs-float"),
        pytest.param(
            Decimal("0.1"), Decimal("0.1000000000000000000000000000001"), id="decimal-exact"
        ),
        pytest.param(timedelta(microseconds=1), timedelta(microseconds=2), id="timedelta"),
        pytest.param(date(2024, 5, 1), "2024-05-01", id="date-vs-string"),
        pytest.param(datetime(2024, 5, 1, 12, 30), "2024-05-01T12:30:00", id="datetime-vs-string"),
        pytest.param(uuid.UUID(int=1), "00000000-0000-0000-0000-000000000001", id="uuid-vs-string"),
        pytest.param(Decimal("1.5"), "1.5", id="decimal-vs-string"),
        pytest.param({1: "a"}, {"1": "a"}, id="int-key-vs-str-key"),
        pytest.param({True: "a"}, {"true": "a"}, id="bool-key-vs-str-key"),
        pytest.param({None: "a"}, {"null": "a"}, id="none-key-vs-str-key"),
        pytest.param({2.5: "a"}, {"2.5": "a"}, id="float-key-vs-str-key"),
        pytest.param(True, 1, id="bool-vs-int"),
        pytest.param([1, 2], [2, 1], id="list-order"),
    ],
)
def test_task_fingerprint_tells_different_work_apart(one: Any, other: Any) -> None:
    assert task({"value": one}) != task({"value": other})


@pytest.mark.parametrize(
    ("one", "other"),
    [
        pytest.param(Decimal("1.50"), Decimal("1.5"), id="decimal-trailing-zero"),
        pytest.param(1, 1.0, id="int-vs-float"),
        pytest.param(Decimal("2"), 2, id="decimal-vs-int"),
        pytest.param((1, "a"), [1, "a"], id="tuple-vs-list"),
        pytest.param(lazy(lambda: "text", str)(), "text", id="lazy-string"),
        pytest.param(mark_safe("text"), "text", id="str-subclass"),
        pytest.param(OrderedDict(b=1, a=2), {"a": 2, "b": 1}, id="dict-subclass"),
        pytest.param({"b": 1, "a": 2}, {"a": 2, "b": 1}, id="key-order"),
    ],
)
def test_task_fingerprint_equal_values_are_the_same_work(one: Any, other: Any) -> None:
    assert task({"value": one}) == task({"value": other})


def test_task_fingerprint_is_versioned_and_counts_the_endpoint() -> None:
    assert VERSION_3.fullmatch(task({"order": 7}))
    assert VERSION_3.fullmatch(task(b"raw"))
    assert task({"order": 7}) != task({"order": 7}, endpoint="task:tests.other")
    assert task(b"1") != task("1")


def test_task_fingerprint_writes_full_precision() -> None:
    at = datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=timezone.utc)
    work = {"at": at, "amount": Decimal("10.50"), "ref": uuid.UUID(int=1), "n": 2**70}
    expected = (
        b'{"amount":105e-1,"at":datetime:"2024-05-01T12:00:00.123456+00:00",'
        b'"n":1180591620717411303424,"ref":uuid:"00000000-0000-0000-0000-000000000001"}'
    )
    parts = [b"task", b"task:tests.refund", b"json", expected]
    prefixed = b"".join(len(part).to_bytes(8, "big") + part for part in parts)

    assert task(work) == keyed(hashlib.sha256(prefixed).digest())


def test_task_fingerprint_of_deeply_nested_work() -> None:
    deep: list[Any] = []
    for _ in range(10_000):
        deep = [deep]

    assert VERSION_3.fullmatch(task(deep))


def test_task_fingerprint_names_an_argument_it_cannot_write() -> None:
    with pytest.raises(TypeError) as excinfo:
        task({"order": 7, "user": object()})

    assert str(excinfo.value) == (
        f"{LABEL}: cannot fingerprint its arguments (argument 'user', a object): Object of "
        "type object is not JSON serializable. Name the arguments that define the work "
        "with fingerprint_args=, or give fingerprint=."
    )


def cyclic() -> list[Any]:
    loop: list[Any] = []
    loop.append(loop)
    return loop


@pytest.mark.parametrize(
    "work",
    [
        pytest.param(float("nan"), id="nan"),
        pytest.param(float("inf"), id="inf"),
        pytest.param(Decimal("NaN"), id="decimal-nan"),
        pytest.param({1: "mixed", "key": "types"}, id="mixed-keys"),
        pytest.param({(1, 2): "tuple key"}, id="tuple-key"),
        pytest.param({float("nan"): 1}, id="nan-key"),
        pytest.param(cyclic(), id="cycle"),
        pytest.param({1, 2}, id="set"),
    ],
)
def test_task_fingerprint_refuses_what_has_no_canonical_form(work: Any) -> None:
    with pytest.raises(TypeError, match=r"^Task 'tests.refund': cannot fingerprint its arguments"):
        task(work)


# -- versions -------------------------------------------------------------------------------


def test_default_fingerprint_is_version_2_and_fits_the_column(rf: RequestFactory) -> None:
    value = fingerprint(json_request(rf, b"{}"))

    assert VERSION_3.fullmatch(value)
    assert len(value) <= FINGERPRINT_MAX_LENGTH
    assert IdempotencyRecord._meta.get_field("fingerprint").max_length == FINGERPRINT_MAX_LENGTH


LEGACY = "a" * 64
V2 = "2:" + "b" * 64


@pytest.mark.parametrize(
    ("stored", "current", "match"),
    [
        pytest.param(V2, V2, True, id="equal"),
        pytest.param(LEGACY, LEGACY, True, id="equal-legacy"),
        pytest.param(V2, "2:" + "c" * 64, False, id="same-version-differs"),
        pytest.param(LEGACY, "c" * 64, False, id="legacy-differs"),
        pytest.param(LEGACY, V2, True, id="legacy-vs-2"),
        pytest.param(V2, LEGACY, True, id="2-vs-legacy"),
        pytest.param("3:" + "d" * 64, V2, True, id="3-vs-2"),
        pytest.param("custom", V2, False, id="unversioned-vs-2"),
        pytest.param(V2, "custom", False, id="2-vs-unversioned"),
        pytest.param("A" * 64, V2, False, id="uppercase-hex-is-not-legacy"),
        pytest.param("a" * 63, V2, False, id="63-hex-is-not-legacy"),
        pytest.param("custom", "other", False, id="unversioned"),
    ],
)
def test_fingerprints_match(stored: str, current: str, match: bool) -> None:
    assert keys.fingerprints_match(stored, current) is match


@pytest.mark.parametrize(
    ("stored", "current", "match"),
    [
        pytest.param("custom:100:EUR", "custom:100:EUR", True, id="equal"),
        pytest.param("custom:100:EUR", "custom:250:EUR", False, id="numbers-are-not-versions"),
        pytest.param("custom:3:" + "d" * 64, "custom:2:" + "d" * 64, False, id="look-versioned"),
        pytest.param("custom:" + V2, V2, False, id="custom-vs-library"),
        pytest.param(V2, "custom:" + LEGACY, False, id="library-vs-custom"),
        pytest.param("100:EUR", V2, False, id="previous-release-custom-vs-library"),
        # Stored by the previous release, which kept a custom value as it was.
        pytest.param("100:EUR", "custom:100:EUR", True, id="previous-release-same"),
        pytest.param("100:EUR", "custom:250:EUR", False, id="previous-release-differs"),
        pytest.param(LEGACY, "custom:" + LEGACY, True, id="previous-release-hex-digest"),
    ],
)
def test_custom_fingerprints_match_only_the_same_value(
    stored: str, current: str, match: bool
) -> None:
    assert keys.fingerprints_match(stored, current) is match


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize(
    ("stored", "value", "match"),
    [
        pytest.param("custom:x", "x", True, id="namespaced"),
        pytest.param("custom:x", "custom:x", False, id="namespaced-is-not-unwrapped"),
        pytest.param("custom:x", "y", False, id="namespaced-other"),
        pytest.param("custom-sha256:" + sha("v" * 80), "v" * 80, True, id="namespaced-digest"),
        pytest.param("custom-sha256:" + sha("v" * 80), "w" * 80, False, id="digest-other"),
        pytest.param("x", "x", True, id="as-it-was"),
        pytest.param("sha256:" + sha("v" * 80), "v" * 80, True, id="as-fit-made-it"),
        pytest.param("2:" + "a" * 64, "2:" + "a" * 64, True, id="as-it-was-looking-versioned"),
        pytest.param("2:" + "a" * 64, "x", False, id="a-library-version-2"),
        pytest.param("a" * 64, "x", False, id="a-library-version-1"),
    ],
)
def test_a_custom_value_matches_the_forms_earlier_releases_stored_it_in(
    stored: str, value: str, match: bool
) -> None:
    assert keys.fingerprints_match(stored, keys.custom_fingerprint(value)) is match


@pytest.mark.parametrize("size", [1, 73, 74, 80, 81, 500])
def test_a_custom_fingerprint_fits_and_matches_what_the_previous_release_stored(
    size: int,
) -> None:
    value = "v" * size
    current = keys.custom_fingerprint(value)

    assert len(current) <= FINGERPRINT_MAX_LENGTH
    assert keys.fingerprints_match(keys.fit(value, FINGERPRINT_MAX_LENGTH), current)
    assert not keys.fingerprints_match(keys.fit(value + "w", FINGERPRINT_MAX_LENGTH), current)
    assert not keys.fingerprints_match(keys.custom_fingerprint(value + "w"), current)


def amount_and_currency(request: HttpRequest, endpoint: str, **options: Any) -> str:
    """A project's own FINGERPRINT, of the shape that read as "version 100"."""
    body = json.loads(request.body)
    return f"{body['amount']}:{body['currency']}"


def amount_and_digest(request: HttpRequest, endpoint: str, **options: Any) -> str:
    """One shaped exactly like the library's own: "<number>:" and 64 hex characters."""
    body = json.loads(request.body)
    return f"{body['amount']}:{hashlib.sha256(body['currency'].encode()).hexdigest()}"


@pytest.mark.django_db(transaction=True)
class TestCustomFingerprintSetting:
    @pytest.fixture(autouse=True, params=[amount_and_currency, amount_and_digest])
    def _custom(self, settings: Any, request: pytest.FixtureRequest) -> None:
        settings.IDEMPOTENCY = {"FINGERPRINT": request.param}
        self.custom = request.param

    def value_of(self, amount: int) -> str:
        """What the project's FINGERPRINT returns for ``charge(client, amount)``."""
        body = json.dumps({"amount": amount, "currency": "EUR"})
        request = RequestFactory().generic("POST", "/effect/", data=body, content_type=JSON)
        return str(self.custom(request, "POST /effect/"))

    def test_another_amount_with_the_key_is_422_not_a_replay(
        self, alice: User, client: Client
    ) -> None:
        first = charge(client, 100)
        second = charge(client, 250)

        assert first.status_code == 201
        assert second.status_code == 422
        assert second.json()["type"] == "urn:idempotency-django:problem:key-mismatch"
        assert effects() == 1

    def test_the_same_amount_is_replayed(self, alice: User, client: Client) -> None:
        first = charge(client, 100)
        retry = charge(client, 100)

        assert retry.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert effects() == 1

    @pytest.mark.parametrize(
        "stored_as",
        [
            pytest.param(lambda value: "custom:" + value, id="namespaced"),
            pytest.param(lambda value: value, id="as-it-was"),
        ],
    )
    def test_a_record_an_earlier_release_stored_still_matches(
        self, alice: User, client: Client, stored_as: Callable[[str], str]
    ) -> None:
        first = charge(client, 100)
        # The previous release stored a custom value namespaced; the one before as it was.
        records.update(fingerprint=stored_as(self.value_of(100)))

        retry = charge(client, 100)
        other = charge(client, 250)

        assert retry.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert other.status_code == 422
        assert effects() == 1


# -- keyed: what a stored fingerprint reveals, and SECRET_KEY rotation -----------------------


def pin_guesses() -> dict[str, str]:
    """Every 4-digit PIN's fingerprint as an unkeyed digest of the canonical form would
    give it (version 2: "2:" and a SHA-256), by its hex digest: what anyone holding a stored
    value could try."""
    guesses = {}
    for number in range(10_000):
        pin = f"{number:04d}"
        body = b'json:{"pin":"' + pin.encode() + b'"}'
        guesses[keys.digest(b"POST", b"POST /effect/", b"[]", JSON.encode(), body)] = pin
    return guesses


def pin_only(request: HttpRequest, endpoint: str, **options: Any) -> str:
    """A project's own FINGERPRINT: the short value that makes the request."""
    return str(json.loads(request.body)["pin"])


def post_json(client: Client, body: Any, key: str = "k1") -> Any:
    return client.post(
        "/effect/",
        data=json.dumps(body),
        content_type=JSON,
        headers={"Idempotency-Key": key, "X-User": "alice"},
    )


@pytest.mark.django_db(transaction=True)
class TestKeyedFingerprints:
    """The stored fingerprint (a table row, a Redis value) is keyed with SECRET_KEY: a short
    body cannot be guessed back from it, and it still matches across a key rotation."""

    def test_a_short_body_cannot_be_guessed_back_from_the_stored_value(
        self, alice: User, client: Client
    ) -> None:
        assert post_json(client, {"pin": "4821"}).status_code == 201
        stored = records.get().fingerprint
        guesses = pin_guesses()

        # Any unkeyed digest of a guess, whole or cut to the stored length, would give it away.
        assert [pin for digest, pin in guesses.items() if digest[:56] in stored] == []
        assert VERSION_3.fullmatch(stored)
        assert stored == keyed(hashlib.sha256(_parts_of_pin("4821")).digest())

    def test_a_custom_value_is_never_stored_as_it_is(
        self, alice: User, client: Client, settings: Any
    ) -> None:
        settings.IDEMPOTENCY = {"FINGERPRINT": pin_only}

        first = post_json(client, {"pin": "4821", "at": 1})
        retry = post_json(client, {"pin": "4821", "at": 2})
        other = post_json(client, {"pin": "4822", "at": 3})
        stored = records.get().fingerprint

        assert "4821" not in stored
        assert hashlib.sha256(b"4821").hexdigest() not in stored
        assert VERSION_3.fullmatch(stored)
        assert (first.status_code, retry.status_code, other.status_code) == (201, 201, 422)
        assert retry["Idempotent-Replayed"] == "true"
        assert effects() == 1

    def test_a_record_keyed_with_a_fallback_key_still_tells_retries_from_others(
        self, alice: User, client: Client, settings: Any
    ) -> None:
        settings.SECRET_KEY = "the-old-key"
        first = post_json(client, {"amount": 1})
        settings.SECRET_KEY = "the-new-key"
        settings.SECRET_KEY_FALLBACKS = ["an-older-key", "the-old-key"]

        retry = post_json(client, {"amount": 1})
        other = post_json(client, {"amount": 2})

        assert first.status_code == 201
        assert retry.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert other.status_code == 422
        assert effects() == 1

    def test_a_record_keyed_with_a_key_no_longer_held_is_replayed_never_run_again(
        self, alice: User, client: Client, settings: Any, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Rotated without a fallback, a record cannot be compared: it counts as the same
        request (a replay, as across an upgrade), never as a reason to run the view."""
        settings.SECRET_KEY = "the-old-key"
        first = post_json(client, {"amount": 1})
        settings.SECRET_KEY = "the-new-key"
        settings.SECRET_KEY_FALLBACKS = []

        retry = post_json(client, {"amount": 1})
        other = post_json(client, {"amount": 2})

        assert retry.status_code == other.status_code == 201
        assert retry["Idempotent-Replayed"] == other["Idempotent-Replayed"] == "true"
        assert retry.content == other.content == first.content
        assert effects() == 1
        warnings = [r for r in caplog.records if "does not hold" in r.getMessage()]
        assert len(warnings) == 1  # once per key and process

    def test_new_records_are_keyed_with_the_current_key(
        self, alice: User, client: Client, settings: Any
    ) -> None:
        settings.SECRET_KEY = "the-new-key"
        settings.SECRET_KEY_FALLBACKS = ["the-old-key"]
        post_json(client, {"pin": "4821"})

        expected = keyed(hashlib.sha256(_parts_of_pin("4821")).digest(), "the-new-key")
        assert records.get().fingerprint == expected

    def test_a_record_of_version_2_is_replayed_after_the_upgrade(
        self, alice: User, client: Client
    ) -> None:
        first = post_json(client, {"pin": "4821"})
        # As the previous release stored it: "2:" and the plain digest.
        records.update(fingerprint="2:" + hashlib.sha256(_parts_of_pin("4821")).hexdigest())

        retry = post_json(client, {"pin": "4821"})

        assert retry.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert effects() == 1


def _parts_of_pin(pin: str) -> bytes:
    """The length-prefixed parts of ``POST /effect/`` with ``{"pin": pin}``."""
    body = b'json:{"pin":"' + pin.encode() + b'"}'
    parts = [b"POST", b"POST /effect/", b"[]", JSON.encode(), body]
    return b"".join(len(part).to_bytes(8, "big") + part for part in parts)


@pytest.mark.parametrize(
    ("stored", "shown"),
    [
        pytest.param("2:" + "a" * 64, "written by an earlier release, unkeyed: not shown", id="v2"),
        pytest.param("a" * 64, "written by an earlier release, unkeyed: not shown", id="v1"),
        pytest.param("custom:4821", "written by an earlier release, unkeyed: not shown", id="c"),
    ],
)
def test_the_admin_never_shows_an_unkeyed_fingerprint(stored: str, shown: str) -> None:
    assert keys.fingerprint_display(stored) == shown


def test_the_admin_shows_a_short_prefix_and_the_key_of_a_keyed_fingerprint(
    settings: Any,
) -> None:
    settings.SECRET_KEY = "the-old-key"
    old = keys.custom_fingerprint("4821")
    settings.SECRET_KEY = "the-new-key"
    new = keys.custom_fingerprint("4821")

    assert keys.fingerprint_display(new) == f"{new[10:22]}… (keyed with SECRET_KEY, id {new[2:10]})"
    assert keys.fingerprint_display(old).endswith(
        f"(keyed with a key this server does not hold, id {old[2:10]})"
    )
    settings.SECRET_KEY_FALLBACKS = ["the-old-key"]
    assert keys.fingerprint_display(old).endswith(
        f"(keyed with a key in SECRET_KEY_FALLBACKS, id {old[2:10]})"
    )


def charge(client: Client, amount: int) -> Any:
    return client.post(
        "/effect/",
        data=json.dumps({"amount": amount, "currency": "EUR"}),
        content_type=JSON,
        headers={"Idempotency-Key": "k1", "X-User": "alice"},
    )


# -- through @idempotent and IdempotentMixin ------------------------------------------------

UPLOAD_ROUTES = ["/upload/", "/api/upload/", "/api/upload-parsed/"]


def send(client: Client, path: str, body: bytes, content_type: str, key: str = "k1") -> Any:
    return client.post(
        path,
        data=body,
        content_type=content_type,
        headers={"Idempotency-Key": key, "X-User": "alice"},
    )


@pytest.fixture
def api(alice: User) -> APIClient:
    client = APIClient()
    client.force_authenticate(alice)
    return client


@pytest.mark.urls("tests.project.fingerprint_urls")
@pytest.mark.django_db(transaction=True)
class TestMultipartThroughViews:
    @pytest.fixture
    def sender(self, alice: User, api: APIClient, client: Client) -> Any:
        def post(path: str, *args: Any, **kwargs: Any) -> Any:
            return send(api if path.startswith("/api/") else client, path, *args, **kwargs)

        return post

    @pytest.mark.parametrize("path", UPLOAD_ROUTES)
    def test_a_retry_with_a_new_boundary_is_replayed(self, sender: Any, path: str) -> None:
        first = sender(path, *multipart_body("boundary-one", NOTE, RECEIPT))
        retry = sender(path, *multipart_body("----WebKitFormBoundaryQ2x", NOTE, RECEIPT))

        assert first.status_code == retry.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert effects() == 1
        assert json.loads(first.content)["files"]["doc"][0]["sha256"] == (
            hashlib.sha256(b"paid 10 EUR").hexdigest()
        )

    @pytest.mark.parametrize("path", UPLOAD_ROUTES)
    def test_other_contents_under_the_same_name_and_size_are_422(
        self, sender: Any, path: str
    ) -> None:
        sender(path, *multipart_body("boundary-one", NOTE, RECEIPT))
        other = sender(path, *multipart_body("boundary-one", NOTE, SAME_SIZE))

        assert other.status_code == 422
        assert "Idempotent-Replayed" not in other
        assert effects() == 1

    @pytest.mark.parametrize("path", UPLOAD_ROUTES)
    @override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1024, FILE_UPLOAD_MAX_MEMORY_SIZE=1024)
    def test_an_upload_larger_than_the_body_limit_is_fingerprinted_not_refused(
        self, sender: Any, path: str
    ) -> None:
        content = bytes(range(256)) * 400  # 100 KiB, spooled to a temporary file
        files = {"doc": ("scan.bin", content, "application/octet-stream")}
        first = sender(path, *multipart_body("one", NOTE, files))
        retry = sender(path, *multipart_body("two", NOTE, files))

        assert first.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        seen = json.loads(first.content)["files"]["doc"][0]
        assert seen == {
            "name": "scan.bin",
            "sha256": hashlib.sha256(content).hexdigest(),
            "spooled": True,
        }
        assert effects() == 1

    def test_a_malformed_multipart_post_is_400_and_claims_nothing(self, sender: Any) -> None:
        response = sender("/upload/", b"no boundary", "multipart/form-data")

        assert response.status_code == 400
        assert effects() == 0
        assert not records.exists()

    @pytest.mark.parametrize("body", [DEEP, b'{"a": NaN}', b'{"a": "\\ud800\xff"}', b"\x00"])
    def test_hostile_json_is_fingerprinted_not_refused(self, sender: Any, body: bytes) -> None:
        first = sender("/upload/", body, JSON)
        retry = sender("/upload/", body, JSON)

        assert first.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert records.get().fingerprint.startswith("3:")


@pytest.mark.urls("tests.project.fingerprint_urls")
@pytest.mark.django_db(transaction=True)
class TestAfterCsrfViewMiddleware:
    """``csrf_protect`` reads the token from ``request.POST``: the multipart body is parsed
    before ``@idempotent`` sees it, as under ``CsrfViewMiddleware``."""

    TOKEN = "a" * 32

    @pytest.fixture
    def csrf_client(self, alice: User) -> Client:
        client = Client(enforce_csrf_checks=True)
        client.cookies["csrftoken"] = self.TOKEN
        return client

    def form(self, boundary: str, files: dict[str, tuple[str, bytes, str]]) -> tuple[bytes, str]:
        return multipart_body(boundary, {**NOTE, "csrfmiddlewaretoken": self.TOKEN}, files)

    def test_the_token_is_read_from_the_multipart_body(self, csrf_client: Client) -> None:
        body, content_type = multipart_body("one", {**NOTE, "csrfmiddlewaretoken": "b" * 32})

        response = send(csrf_client, "/upload-after-csrf/", body, content_type)

        assert response.status_code == 403
        assert effects() == 0

    def test_a_retry_with_a_new_boundary_is_replayed(self, csrf_client: Client) -> None:
        first = send(csrf_client, "/upload-after-csrf/", *self.form("one", RECEIPT))
        retry = send(csrf_client, "/upload-after-csrf/", *self.form("two", RECEIPT))

        assert first.status_code == retry.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert effects("upload_after_csrf") == 1

    def test_other_contents_under_the_same_name_and_size_are_422(self, csrf_client: Client) -> None:
        send(csrf_client, "/upload-after-csrf/", *self.form("one", RECEIPT))
        other = send(csrf_client, "/upload-after-csrf/", *self.form("two", SAME_SIZE))

        assert other.status_code == 422
        assert effects("upload_after_csrf") == 1


# -- views that read request.body -----------------------------------------------------------

# Signed with a shared secret (a webhook's signature over the raw body): protected by the
# decorator, the DRF mixin, and IdempotencyMiddleware (a plain view and a DRF view).
SIGNED_ROUTES = ["/signed/", "/api/signed/", "/mw/signed/", "/api/mw/signed/"]


@pytest.mark.urls("tests.project.fingerprint_urls")
@pytest.mark.django_db(transaction=True)
class TestViewsThatReadTheBody:
    """A body that fits ``DATA_UPLOAD_MAX_MEMORY_SIZE`` is read (``request.body``) before
    the fingerprint parses it: the view gets both the raw body and ``request.POST``/``FILES``.
    Larger uploads are streamed: ``request.FILES`` works, ``request.body`` is refused as
    Django refuses it after ``request.POST``."""

    @pytest.fixture(autouse=True)
    def middleware(self, settings: Any) -> None:
        settings.MIDDLEWARE = [
            *settings.MIDDLEWARE,
            "idempotency_django.middleware.IdempotencyMiddleware",
        ]

    @pytest.fixture
    def sender(self, alice: User, api: APIClient, client: Client) -> Any:
        def post(path: str, body: bytes, content_type: str, key: str = "k1") -> Any:
            sent = api if path.startswith("/api/") else client
            return sent.post(
                path,
                data=body,
                content_type=content_type,
                headers={
                    "Idempotency-Key": key,
                    "X-User": "alice",
                    "X-Signature": fingerprint_views.signature(body),
                },
            )

        return post

    @pytest.mark.parametrize("path", SIGNED_ROUTES)
    def test_a_multipart_view_reading_the_raw_body_runs_once_and_is_replayed(
        self, sender: Any, path: str
    ) -> None:
        body, content_type = multipart_body("boundary-one", NOTE, RECEIPT)
        first = sender(path, body, content_type)
        retry = sender(path, *multipart_body("----WebKitFormBoundaryQ2x", NOTE, RECEIPT))

        assert first.status_code == 201, first.content
        seen = json.loads(first.content)
        assert seen["signature"] == fingerprint_views.signature(body)
        assert seen["fields"] == {"note": ["first"], "amount": ["10"]}
        assert seen["files"]["doc"][0]["sha256"] == hashlib.sha256(b"paid 10 EUR").hexdigest()
        assert retry.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert effects() == 1

    def test_an_async_view_reading_the_raw_body_under_asgi(self, alice: User) -> None:
        """ASGI's request (its body spooled by the handler) behaves the same."""
        body, content_type = multipart_body("boundary-one", NOTE, RECEIPT)

        async def send() -> Any:
            return await AsyncClient().post(
                "/async/signed/",
                data=body,
                content_type=content_type,
                headers={
                    "Idempotency-Key": "k1",
                    "X-User": "alice",
                    "X-Signature": fingerprint_views.signature(body),
                },
            )

        first = async_to_sync(send)()
        retry = async_to_sync(send)()

        assert first.status_code == 201, first.content
        assert json.loads(first.content)["signature"] == fingerprint_views.signature(body)
        assert json.loads(first.content)["files"]["doc"][0]["name"] == "receipt.txt"
        assert retry["Idempotent-Replayed"] == "true"
        assert effects() == 1

    @pytest.mark.parametrize("path", SIGNED_ROUTES)
    def test_a_webhook_verifying_its_json_body_runs_once_and_is_replayed(
        self, sender: Any, path: str
    ) -> None:
        body = b'{"type": "charge.succeeded", "id": "evt_1"}'
        first = sender(path, body, JSON)
        retry = sender(path, body, JSON)
        other = sender(path, b'{"type": "charge.refunded", "id": "evt_1"}', JSON)

        assert first.status_code == 201, first.content
        assert json.loads(first.content)["signature"] == fingerprint_views.signature(body)
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert other.status_code == 422
        assert effects() == 1

    @pytest.mark.parametrize("path", ["/upload/", "/api/upload/", "/mw/upload/"])
    @override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1024, FILE_UPLOAD_MAX_MEMORY_SIZE=1024)
    def test_an_upload_above_the_body_limit_is_streamed_and_reaches_request_files(
        self, sender: Any, path: str
    ) -> None:
        """Had the body been read first, Django would have refused it (413)."""
        content = bytes(range(256)) * 400  # 100 KiB, spooled to a temporary file
        files = {"doc": ("scan.bin", content, "application/octet-stream")}
        first = sender(path, *multipart_body("one", NOTE, files))
        retry = sender(path, *multipart_body("two", NOTE, files))
        other = sender(
            path,
            *multipart_body(
                "two", NOTE, {"doc": ("scan.bin", content[::-1], "application/octet-stream")}
            ),
        )

        assert first.status_code == 201, first.content
        seen = json.loads(first.content)["files"]["doc"][0]
        assert seen == {
            "name": "scan.bin",
            "sha256": hashlib.sha256(content).hexdigest(),
            "spooled": True,
        }
        assert retry["Idempotent-Replayed"] == "true"
        assert other.status_code == 422
        assert effects() == 1

    @pytest.mark.parametrize("path", SIGNED_ROUTES)
    @override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1024)
    def test_a_view_reading_the_raw_body_of_a_larger_upload_gets_djangos_refusal(
        self, alice: User, path: str
    ) -> None:
        """As after ``request.POST`` in any view: ``RawPostDataException``. The view failed,
        so its key is released, never stored."""
        body, content_type = multipart_body(
            "one", NOTE, {"doc": ("scan.bin", b"x" * 4096, "text/plain")}
        )
        client = APIClient(raise_request_exception=False)
        client.force_authenticate(alice)
        response = client.post(
            path,
            data=body,
            content_type=content_type,
            headers={
                "Idempotency-Key": "k1",
                "X-User": "alice",
                "X-Signature": fingerprint_views.signature(body),
            },
        )

        assert response.status_code == 500
        assert effects() == 0
        assert not records.exists()
