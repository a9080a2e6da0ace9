from __future__ import annotations

import inspect
import json
from typing import TYPE_CHECKING

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import BadRequest
from django.http import HttpResponse, HttpResponseRedirect, JsonResponse

from idempotency_django import exceptions
from idempotency_django.exceptions import (
    AnonymousNotAllowed,
    BodyTooLarge,
    IdempotencyError,
    InFlight,
    KeyMalformed,
    KeyMismatch,
    KeyMissing,
    QuotaExceeded,
    ResponseNotStored,
    StoreUnavailable,
    WorkNotCommitted,
)
from idempotency_django.responses import (
    NEVER_STORED_HEADERS,
    StoredResponse,
    capture,
    is_definitive,
    problem_response,
    replay,
    stored_header_names,
)
from tests import records
from tests.conftest import Post

if TYPE_CHECKING:
    from pytest_django import Settings

DEFAULT_TYPE_BASE = "urn:idempotency-django:problem:"

# is_definitive


@pytest.mark.parametrize("status", [200, 201, 204, 302, 303, 400, 401, 402, 403, 404, 410, 422])
def test_is_definitive_for_success_redirect_and_lasting_client_errors(status: int) -> None:
    assert is_definitive(status) is True


@pytest.mark.parametrize("status", [100, 408, 409, 425, 429, 500, 501, 502, 503, 504])
def test_is_not_definitive_for_transient_and_server_errors(status: int) -> None:
    assert is_definitive(status) is False


# capture


def test_capture_keeps_status_body_and_content_type() -> None:
    response = JsonResponse({"id": 7}, status=201)
    stored = capture(response)
    assert stored.status == 201
    assert stored.body == b'{"id": 7}'
    assert isinstance(stored.body, bytes)
    assert ("Content-Type", "application/json") in stored.headers


def test_capture_keeps_location() -> None:
    stored = capture(HttpResponseRedirect("/orders/7"))
    assert stored.status == 302
    assert ("Location", "/orders/7") in stored.headers


def test_capture_drops_headers_not_on_the_allow_list(settings: Settings) -> None:
    settings.IDEMPOTENCY = {}
    response = HttpResponse(b"ok", content_type="text/plain")
    response["X-Request-Id"] = "r-1"
    response["ETag"] = '"v1"'
    stored = capture(response)
    assert stored.headers == [("Content-Type", "text/plain")]


def test_capture_keeps_cache_control_for_the_replays(settings: Settings) -> None:
    response = HttpResponse(b"ok", content_type="text/plain")
    response["Cache-Control"] = "private, max-age=60"
    stored = capture(response)
    assert stored.headers == [
        ("Content-Type", "text/plain"),
        ("Cache-Control", "private, max-age=60"),
    ]


def test_capture_keeps_headers_named_in_stored_headers(settings: Settings) -> None:
    settings.IDEMPOTENCY = {"STORED_HEADERS": ("X-Request-Id", "ETag")}
    response = HttpResponse(b"ok", content_type="text/plain")
    response["x-request-id"] = "r-1"
    response["ETag"] = '"v1"'
    response["X-Other"] = "dropped"
    stored = capture(response)
    assert dict(stored.headers) == {
        "Content-Type": "text/plain",
        "X-Request-Id": "r-1",
        "ETag": '"v1"',
    }


def test_capture_skips_allow_listed_headers_the_response_lacks(settings: Settings) -> None:
    settings.IDEMPOTENCY = {"STORED_HEADERS": ("X-Request-Id",)}
    response = HttpResponse(b"ok")
    del response["Content-Type"]
    assert capture(response).headers == []


@pytest.mark.parametrize(
    "name", ["Set-Cookie", "set-cookie", "Authorization", "Cookie", "WWW-Authenticate"]
)
def test_capture_never_keeps_credentials_even_if_listed(settings: Settings, name: str) -> None:
    settings.IDEMPOTENCY = {"STORED_HEADERS": (name, "X-Request-Id")}
    response = HttpResponse(b"ok", content_type="text/plain")
    response[name] = "secret"
    response["X-Request-Id"] = "r-1"
    stored = capture(response)
    assert all(header.lower() != name.lower() for header, _ in stored.headers)
    assert all("secret" not in value for _, value in stored.headers)
    assert ("X-Request-Id", "r-1") in stored.headers


def test_capture_never_keeps_cookies_set_with_set_cookie(settings: Settings) -> None:
    settings.IDEMPOTENCY = {"STORED_HEADERS": ("Set-Cookie",)}
    response = HttpResponse(b"ok", content_type="text/plain")
    response.set_cookie("sessionid", "secret")
    stored = capture(response)
    assert stored.headers == [("Content-Type", "text/plain")]
    assert not replay(stored).cookies


# Credentials, authentication challenges and hop-by-hop headers (RFC 9110 §7.6.1): never
# stored and never replayed, whatever STORED_HEADERS says.
NEVER_REPLAYED = [
    "Set-Cookie",
    "Cookie",
    "Authorization",
    "WWW-Authenticate",
    "Proxy-Authenticate",
    "Authentication-Info",
    "Proxy-Authorization",
    "Proxy-Authentication-Info",
    "Connection",
    "Keep-Alive",
    "Proxy-Connection",
    "Transfer-Encoding",
    "Upgrade",
    "TE",
    "Trailer",
]


@pytest.mark.parametrize("name", [*NEVER_REPLAYED, "proxy-authenticate", "KEEP-ALIVE"])
def test_capture_never_keeps_per_connection_or_auth_headers(settings: Settings, name: str) -> None:
    settings.IDEMPOTENCY = {"STORED_HEADERS": (name, "X-Request-Id")}
    response = HttpResponse(b"ok", content_type="text/plain")
    response[name] = "first-exchange-only"
    response["X-Request-Id"] = "r-1"

    stored = capture(response)

    assert stored.headers == [("Content-Type", "text/plain"), ("X-Request-Id", "r-1")]
    assert name.lower() not in {header.lower() for header in stored_header_names()}


def test_never_stored_headers_name_them_all_in_lower_case() -> None:
    assert {name.lower() for name in NEVER_REPLAYED} <= NEVER_STORED_HEADERS
    assert all(name == name.lower() for name in NEVER_STORED_HEADERS)


def test_capture_drops_headers_the_connection_header_names(settings: Settings) -> None:
    """``Connection: X-Hop`` makes ``X-Hop`` hop-by-hop for that one response."""
    settings.IDEMPOTENCY = {"STORED_HEADERS": ("X-Hop", "X-Request-Id")}
    response = HttpResponse(b"ok", content_type="text/plain")
    response["Connection"] = "close, X-HOP"
    response["X-Hop"] = "this connection only"
    response["X-Request-Id"] = "r-1"

    assert capture(response).headers == [("Content-Type", "text/plain"), ("X-Request-Id", "r-1")]


def test_replay_drops_them_from_a_record_stored_before_they_were_forbidden() -> None:
    """A record written by an older version (or by hand) holds them: the replay drops them."""
    stored = StoredResponse(
        status=201,
        body=b"{}",
        headers=[
            ("Content-Type", "application/json"),
            *((name, "stale") for name in NEVER_REPLAYED),
            ("proxy-authenticate", "Basic"),
            ("X-Request-Id", "r-1"),
        ],
    )

    replayed = replay(stored)

    assert dict(replayed.items()) == {
        "Content-Type": "application/json",
        "X-Request-Id": "r-1",
        "Cache-Control": "no-store",
        "Idempotent-Replayed": "true",
    }
    assert not replayed.cookies


@pytest.mark.django_db
def test_a_stored_record_replays_without_them(alice: User, post: Post, settings: Settings) -> None:
    """Through the decorator: the record in the store holds them, the retry gets none."""
    settings.IDEMPOTENCY = {"STORED_HEADERS": ("X-Request-Id",)}
    first = post("/effect/", {"amount": 1})
    record = records.get()
    records.update(
        response_headers=[*record.response_headers, *([name, "stale"] for name in NEVER_REPLAYED)]
    )

    retry = post("/effect/", {"amount": 1})

    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert retry["X-Request-Id"] == first["X-Request-Id"]
    for name in NEVER_REPLAYED:
        assert not retry.has_header(name), name
    assert not retry.cookies


# replay


def test_replay_rebuilds_status_body_and_headers(settings: Settings) -> None:
    settings.IDEMPOTENCY = {"STORED_HEADERS": ("X-Request-Id",)}
    original = HttpResponse(b'{"id": 7}', status=201, content_type="application/json")
    original["Location"] = "/orders/7"
    original["X-Request-Id"] = "r-1"
    replayed = replay(capture(original))
    assert replayed.status_code == 201
    assert replayed.content == b'{"id": 7}'
    assert replayed["Content-Type"] == "application/json"
    assert replayed["Location"] == "/orders/7"
    assert replayed["X-Request-Id"] == "r-1"
    assert dict(replayed.items()) == {
        "Content-Type": "application/json",
        "Location": "/orders/7",
        "X-Request-Id": "r-1",
        "Cache-Control": "no-store",
        "Idempotent-Replayed": "true",
    }


def test_replay_of_a_stored_record_is_exact() -> None:
    stored = StoredResponse(
        status=422,
        body=b"\x00binary\xff",
        headers=[("Content-Type", "application/octet-stream"), ("X-Trace", "t")],
    )
    replayed = replay(stored)
    assert replayed.status_code == 422
    assert replayed.content == b"\x00binary\xff"
    assert [(k, v) for k, v in replayed.items() if k != "Idempotent-Replayed"] == [
        *stored.headers,
        ("Cache-Control", "no-store"),  # the first response said nothing of caching
    ]


def test_replay_adds_the_replayed_header() -> None:
    replayed = replay(StoredResponse(status=200, body=b"ok"))
    assert replayed["Idempotent-Replayed"] == "true"


def test_replay_header_name_comes_from_settings(settings: Settings) -> None:
    settings.IDEMPOTENCY = {"REPLAY_HEADER": "X-Was-Replayed"}
    replayed = replay(StoredResponse(status=200, body=b"ok"))
    assert replayed["X-Was-Replayed"] == "true"
    assert not replayed.has_header("Idempotent-Replayed")


def test_replay_without_content_type_does_not_gain_the_default() -> None:
    replayed = replay(StoredResponse(status=204, body=b"", headers=[]))
    assert not replayed.has_header("Content-Type")


def test_round_trip_of_a_response_without_content_type() -> None:
    original = HttpResponse(b"raw", status=200)
    del original["Content-Type"]
    replayed = replay(capture(original))
    assert not replayed.has_header("Content-Type")
    assert replayed.content == b"raw"


def test_replay_keeps_the_stored_content_type_over_the_default() -> None:
    replayed = replay(
        StoredResponse(status=200, body=b"a,b", headers=[("Content-Type", "text/csv")])
    )
    assert replayed["Content-Type"] == "text/csv"


def test_capture_of_a_replay_matches_the_original(settings: Settings) -> None:
    settings.IDEMPOTENCY = {"STORED_HEADERS": ("X-Request-Id",)}
    original = HttpResponseRedirect("/next")
    original["X-Request-Id"] = "r-2"
    stored = capture(original)
    again = capture(replay(stored))
    assert again.status == stored.status
    assert again.body == stored.body
    # The replay's "no-store" (the first response said nothing of caching) is kept: a
    # replay of the replay says the same.
    assert again.headers == [*stored.headers[:2], ("Cache-Control", "no-store"), stored.headers[2]]
    assert replay(again).items() == replay(stored).items()


# problem_response


def build_problem(error: IdempotencyError) -> HttpResponse:
    response = problem_response(error)
    assert isinstance(response, HttpResponse)
    return response


EXPECTED = [
    pytest.param(IdempotencyError, 400, "error", id="IdempotencyError"),
    pytest.param(KeyMissing, 400, "key-missing", id="KeyMissing"),
    pytest.param(KeyMalformed, 400, "key-malformed", id="KeyMalformed"),
    pytest.param(BodyTooLarge, 413, "body-too-large", id="BodyTooLarge"),
    pytest.param(AnonymousNotAllowed, 403, "anonymous", id="AnonymousNotAllowed"),
    pytest.param(KeyMismatch, 422, "key-mismatch", id="KeyMismatch"),
    pytest.param(InFlight, 409, "in-flight", id="InFlight"),
    pytest.param(ResponseNotStored, 409, "response-not-stored", id="ResponseNotStored"),
    pytest.param(QuotaExceeded, 429, "quota-exceeded", id="QuotaExceeded"),
    pytest.param(StoreUnavailable, 503, "store-unavailable", id="StoreUnavailable"),
    pytest.param(WorkNotCommitted, 500, "work-not-committed", id="WorkNotCommitted"),
]


def test_every_exception_class_is_covered() -> None:
    defined = {
        obj
        for _, obj in inspect.getmembers(exceptions, inspect.isclass)
        if issubclass(obj, IdempotencyError)
    }
    assert defined == {param.values[0] for param in EXPECTED}


@pytest.mark.parametrize(("error_class", "status", "slug"), EXPECTED)
def test_problem_response_per_exception(
    error_class: type[IdempotencyError], status: int, slug: str
) -> None:
    error = error_class("What went wrong.")
    response = build_problem(error)
    assert response.status_code == status
    assert response["Content-Type"] == "application/problem+json"
    body = json.loads(response.content)
    assert body == {
        "type": DEFAULT_TYPE_BASE + slug,
        "title": error_class.title,
        "status": status,
        "detail": "What went wrong.",
    }
    assert not response.has_header("Retry-After")


@pytest.mark.parametrize("error_class", [KeyMissing, KeyMalformed, BodyTooLarge])
def test_client_errors_are_django_bad_requests(error_class: type[IdempotencyError]) -> None:
    assert issubclass(error_class, BadRequest)


def test_problem_types_are_distinct() -> None:
    slugs = [param.values[2] for param in EXPECTED]
    assert len(slugs) == len(set(slugs))


def test_problem_response_detail_defaults_to_the_title() -> None:
    body = json.loads(build_problem(KeyMismatch()).content)
    assert body["detail"] == KeyMismatch.title


@pytest.mark.parametrize("error_class", [InFlight, StoreUnavailable])
def test_problem_response_has_retry_after_when_the_error_has_one(
    error_class: type[IdempotencyError],
) -> None:
    response = build_problem(error_class("Try again.", retry_after=3))
    assert response["Retry-After"] == "3"


def test_problem_type_base_comes_from_settings(settings: Settings) -> None:
    settings.IDEMPOTENCY = {"PROBLEM_TYPE_BASE": "https://errors.example.com/"}
    body = json.loads(build_problem(InFlight()).content)
    assert body["type"] == "https://errors.example.com/in-flight"
