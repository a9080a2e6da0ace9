"""What a replay says about its body and about caching: the length of the bytes it sends
(not a stored one, which redaction made wrong), and ``Cache-Control`` as the first response
said it, or ``no-store``. This module is the URLconf of its tests."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path
from django.utils.cache import patch_cache_control

from idempotency_django.decorators import idempotent
from tests.conftest import Post

pytestmark = [pytest.mark.django_db, pytest.mark.urls(__name__)]

CARD = {"amount": 1000, "card": "4242424242424242"}


@idempotent
def with_length(request: HttpRequest) -> HttpResponse:
    response = JsonResponse(CARD, status=201)
    response["Content-Length"] = str(len(response.content))
    return response


@idempotent
def no_cache_control(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"id": "ch_1"}, status=201)


@idempotent
def private_cache(request: HttpRequest) -> HttpResponse:
    response = JsonResponse({"id": "ch_1"}, status=201)
    patch_cache_control(response, private=True, max_age=60)
    return response


urlpatterns = [
    path("with-length/", with_length),
    path("no-cache-control/", no_cache_control),
    path("private-cache/", private_cache),
]


def test_a_redacted_replay_does_not_carry_the_first_responses_length(
    alice: User, post: Post, settings: Any
) -> None:
    settings.IDEMPOTENCY = {
        **getattr(settings, "IDEMPOTENCY", {}),
        "STORED_HEADERS": ["Content-Length"],
        "REDACT_RESPONSE": "tests.test_replay_headers.without_card",
    }

    first = post("/with-length/", {})
    replay = post("/with-length/", {})

    assert first["Content-Length"] == str(len(first.content))
    assert replay["Idempotent-Replayed"] == "true"
    assert json.loads(replay.content) == {"amount": 1000}
    assert len(replay.content) < len(first.content)
    assert replay.get("Content-Length", str(len(replay.content))) == str(len(replay.content))


def without_card(outcome: Any) -> Any:
    from idempotency_django.codecs import drop_json_fields

    return drop_json_fields("card")(outcome)


def test_a_stored_length_is_never_replayed(alice: User, post: Post, settings: Any) -> None:
    """Even one written by an older version, or by hand, into the stored headers."""
    from idempotency_django.responses import StoredResponse, replay

    response = replay(StoredResponse(201, b"{}", [("Content-Length", "999")]))

    assert "Content-Length" not in response
    assert response.content == b"{}"


def test_a_replay_says_no_store_when_the_first_response_said_nothing_of_caching(
    alice: User, post: Post
) -> None:
    first = post("/no-cache-control/", {})
    replay = post("/no-cache-control/", {})

    assert "Cache-Control" not in first  # the first response is the view's own
    assert replay["Idempotent-Replayed"] == "true"
    assert replay["Cache-Control"] == "no-store"


def test_a_replay_keeps_the_caching_the_view_allowed(alice: User, post: Post) -> None:
    first = post("/private-cache/", {})
    replay = post("/private-cache/", {})

    assert first["Cache-Control"] == "private, max-age=60"
    assert replay["Idempotent-Replayed"] == "true"
    assert replay["Cache-Control"] == "private, max-age=60"


def test_naming_content_length_among_the_stored_headers_is_reported(settings: Any) -> None:
    from idempotency_django.checks import check_settings

    settings.IDEMPOTENCY = {"STORED_HEADERS": ["X-Request-Id", "content-length"]}

    assert [e.id for e in check_settings()] == ["idempotency_django.W041"]
