"""RESPONSE_CODEC, REDACT_RESPONSE and REPLAY_HOOK, through real requests and the stored row.

Encryption with Fernet is in ``test_codecs_encryption.py``; here a toy codec (reversed
bytes) shows the framing, the records stored before a codec was configured, and the
records a codec cannot open.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.http import HttpResponse

from idempotency_django.checks import check_codec_settings
from idempotency_django.codecs import (
    SEALED,
    UNSTORABLE,
    ResponseUnreadable,
    drop_json_fields,
    get_codec,
    seal,
    unseal,
)
from idempotency_django.core import codecs
from idempotency_django.exceptions import ResponseNotStored
from idempotency_django.models import IdempotencyRecord
from idempotency_django.responses import StoredResponse, replay
from tests import records
from tests.conftest import Post, effects

if TYPE_CHECKING:
    from pytest_django import Settings

pytestmark = pytest.mark.django_db

PROBLEM = "urn:idempotency-django:problem:"
CARD = {"number": "4242424242424242", "cvc": "123", "brand": "visa"}


SCOPE = {"account": "1", "endpoint": "POST /effect/", "key": "k1"}


@pytest.fixture(autouse=True)
def _users(alice: User) -> None:
    """``post`` sends its requests as alice."""


class Reversed:
    """A codec anyone can read: what a codec does to the row is visible in the test."""

    def encode(self, data: bytes, /) -> bytes:
        return data[::-1]

    def decode(self, data: bytes, /) -> bytes:
        return data[::-1]


class Refuses(Reversed):
    """A codec that cannot open anything (a key that is gone)."""

    def decode(self, data: bytes, /) -> bytes:
        raise ValueError("not mine")


class Unframed(Reversed):
    """A codec that 'decodes' into bytes that are not the app's framing."""

    def decode(self, data: bytes, /) -> bytes:
        return b"garbage without a header line"


class Lossy(Reversed):
    def decode(self, data: bytes, /) -> bytes:
        return b""


def drop_echo(outcome: StoredResponse) -> StoredResponse:
    return drop_json_fields("echo")(outcome)


def fails(outcome: StoredResponse) -> StoredResponse:
    raise RuntimeError("the redaction hook has a bug")


def returns_bytes(outcome: StoredResponse) -> bytes:
    return outcome.body


def add_header(response: HttpResponse, stored: StoredResponse) -> None:
    response["X-Replayed-Status"] = str(stored.status)


def replace_response(response: HttpResponse, stored: StoredResponse) -> HttpResponse:
    return HttpResponse(b"replaced", status=stored.status)


def row() -> IdempotencyRecord:
    return records.get()


def stored_body(record: IdempotencyRecord) -> bytes:
    return bytes(record.response_body)


def configure(settings: Settings, **values: Any) -> None:
    settings.IDEMPOTENCY = {**getattr(settings, "IDEMPOTENCY", {}), **values}


def assert_same_response(first: Any, second: Any) -> None:
    assert second.status_code == first.status_code
    assert second.content == first.content
    assert second["Content-Type"] == first["Content-Type"]
    assert second["Location"] == first["Location"]
    assert second["Idempotent-Replayed"] == "true"


# --- the default: bytes as they are ----------------------------------------------------------


def test_without_a_codec_the_row_holds_the_response_bytes(post: Post) -> None:
    first = post("/effect/", {"card": CARD})
    record = row()

    assert stored_body(record) == first.content
    assert ["Location", first["Location"]] in record.response_headers
    assert_same_response(first, post("/effect/", {"card": CARD}))
    assert effects() == 1


def test_seal_and_unseal_are_identities_by_default() -> None:
    outcome = StoredResponse(201, b"\x00binary", [("Content-Type", "image/png")])
    assert seal(outcome, **SCOPE) is outcome
    assert unseal(outcome, **SCOPE) is outcome


# --- a codec: headers and body sealed, status in clear ---------------------------------------


def test_a_codec_seals_body_and_headers_and_replays_them_exactly(
    post: Post, settings: Settings
) -> None:
    configure(settings, RESPONSE_CODEC="tests.test_codecs.Reversed")
    first = post("/effect/", {"card": CARD})
    record = row()

    body = stored_body(record)
    assert body.startswith(SEALED)
    assert b"4242424242424242" not in body
    assert b'"4242424242424242"'[::-1] in body  # what the toy codec did to it
    assert record.response_headers == []  # Location can carry an id: sealed too
    assert record.response_status == 201  # in clear: the admin filters on it

    assert_same_response(first, post("/effect/", {"card": CARD}))
    assert effects() == 1


@pytest.mark.parametrize("form", ["path", "class", "object"])
def test_the_codec_setting_takes_a_path_a_class_or_an_object(settings: Settings, form: str) -> None:
    value = {"path": "tests.test_codecs.Reversed", "class": Reversed, "object": Reversed()}[form]
    configure(settings, RESPONSE_CODEC=value)
    assert isinstance(get_codec(), Reversed)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("tests.test_codecs.Nowhere", "cannot import 'tests.test_codecs.Nowhere'"),
        ("tests.test_codecs.row", "is not a codec"),
        (object(), "is not a codec"),
    ],
)
def test_a_setting_that_is_not_a_codec_is_named(
    settings: Settings, value: Any, message: str
) -> None:
    configure(settings, RESPONSE_CODEC=value)
    with pytest.raises(ImproperlyConfigured, match=message):
        get_codec()


def test_a_record_stored_before_the_codec_was_configured_replays_as_stored(
    post: Post, settings: Settings
) -> None:
    first = post("/effect/", {"card": CARD})
    configure(settings, RESPONSE_CODEC="tests.test_codecs.Reversed")

    assert_same_response(first, post("/effect/", {"card": CARD}))
    assert effects() == 1


@pytest.mark.parametrize(
    "later",
    [None, "tests.test_codecs.Refuses", "tests.test_codecs.Unframed", "tests.test_codecs.Lossy"],
)
def test_a_sealed_record_the_codec_cannot_open_is_a_409_never_garbage_never_a_rerun(
    post: Post, settings: Settings, later: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    configure(settings, RESPONSE_CODEC="tests.test_codecs.Reversed")
    assert post("/effect/", {"n": 1}).status_code == 201
    configure(settings, RESPONSE_CODEC=later)

    with caplog.at_level(logging.INFO, logger="idempotency_django"):
        retry = post("/effect/", {"n": 1})

    assert retry.status_code == 409
    assert retry["Content-Type"] == "application/problem+json"
    problem = json.loads(retry.content)
    assert problem["type"] == PROBLEM + "response-unreadable"
    assert "completed with status 201" in problem["detail"]
    assert effects() == 1
    assert any(
        r.levelno == logging.ERROR and "cannot be decoded" in r.getMessage() for r in caplog.records
    )


def test_unreadable_is_a_kind_of_not_stored() -> None:
    """Error handlers and the task API that know ResponseNotStored handle it too."""
    assert issubclass(ResponseUnreadable, ResponseNotStored)
    assert ResponseUnreadable.status == 409


# --- redaction ------------------------------------------------------------------------------


def test_redaction_stores_less_the_first_client_gets_everything_replays_get_the_redacted(
    post: Post, settings: Settings
) -> None:
    configure(settings, REDACT_RESPONSE=drop_json_fields("echo.card.number", "echo.card.cvc"))

    first = post("/effect/", {"card": CARD})
    replayed = post("/effect/", {"card": CARD})

    assert json.loads(first.content)["echo"]["card"] == CARD
    assert b"4242424242424242" not in stored_body(row())
    assert json.loads(replayed.content)["echo"]["card"] == {"brand": "visa"}
    assert replayed.status_code == 201
    assert replayed["Location"] == first["Location"]
    assert effects() == 1


def test_redaction_by_dotted_path_then_encoding(post: Post, settings: Settings) -> None:
    configure(
        settings,
        REDACT_RESPONSE="tests.test_codecs.drop_echo",
        RESPONSE_CODEC="tests.test_codecs.Reversed",
    )
    first = post("/effect/", {"card": CARD})
    replayed = post("/effect/", {"card": CARD})

    decoded = stored_body(row())[len(SEALED) :][::-1]
    assert b"4242" not in decoded
    assert json.loads(replayed.content) == {"effect": json.loads(first.content)["effect"]}


@pytest.mark.parametrize("hook", ["tests.test_codecs.fails", "tests.test_codecs.returns_bytes"])
def test_a_failing_redaction_stores_nothing_readable_and_never_reruns(
    post: Post, settings: Settings, hook: str, caplog: pytest.LogCaptureFixture
) -> None:
    configure(settings, REDACT_RESPONSE=hook)

    with caplog.at_level(logging.INFO, logger="idempotency_django"):
        first = post("/effect/", {"card": CARD})
    retry = post("/effect/", {"card": CARD})

    assert first.status_code == 201
    assert json.loads(first.content)["echo"]["card"] == CARD
    assert stored_body(row()) == UNSTORABLE
    assert retry.status_code == 409
    assert json.loads(retry.content)["type"] == PROBLEM + "response-not-stored"
    assert effects() == 1
    assert any("REDACT_RESPONSE or RESPONSE_CODEC failed" in r.getMessage() for r in caplog.records)


def test_a_codec_that_cannot_load_at_completion_stores_nothing_and_never_reruns(
    post: Post, settings: Settings
) -> None:
    configure(settings, RESPONSE_CODEC="tests.test_codecs.Nowhere")

    first = post("/effect/", {"card": CARD})
    retry = post("/effect/", {"card": CARD})

    assert first.status_code == 201
    assert stored_body(row()) == UNSTORABLE
    assert retry.status_code == 409
    assert effects() == 1


@pytest.mark.parametrize(
    ("body", "content_type", "kept"),
    [
        (
            {"id": 1, "card": {"number": "4242", "brand": "visa"}, "cvc": "1"},
            "application/json",
            {"id": 1, "card": {"brand": "visa"}},
        ),
        (
            {"items": [{"number": "1", "x": 1}, {"number": "2"}, 3]},
            "application/vnd.api+json; charset=utf-8",
            {"items": [{"x": 1}, {}, 3]},
        ),
        ({"card": "not an object"}, "application/json", {"card": "not an object"}),
        ([{"cvc": "1", "id": 2}], "application/json", [{"id": 2}]),
    ],
)
def test_drop_json_fields(body: Any, content_type: str, kept: Any) -> None:
    redact = drop_json_fields("card.number", "cvc", "items.number")
    outcome = StoredResponse(201, json.dumps(body).encode(), [("Content-Type", content_type)])

    redacted = redact(outcome)

    assert json.loads(redacted.body) == kept
    assert (redacted.status, redacted.headers) == (outcome.status, outcome.headers)


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        (b'{"cvc": "1"}', [("Content-Type", "text/plain")]),
        (b'{"cvc": "1"}', []),
        (b"{not json", [("Content-Type", "application/json")]),
    ],
)
def test_drop_json_fields_leaves_what_is_not_json_alone(
    body: bytes, headers: list[tuple[str, str]]
) -> None:
    outcome = StoredResponse(201, body, headers)
    assert drop_json_fields("cvc")(outcome) == outcome


# --- the replay hook ------------------------------------------------------------------------


def test_the_replay_hook_adjusts_replays_and_never_the_stored_row(
    post: Post, settings: Settings
) -> None:
    configure(settings, REPLAY_HOOK="tests.test_codecs.add_header")
    first = post("/effect/", {"n": 1})
    before = row()

    replays = [post("/effect/", {"n": 1}) for _ in range(2)]

    assert "X-Replayed-Status" not in first  # the first response is the view's own
    for replayed in replays:
        assert replayed["X-Replayed-Status"] == "201"
        assert_same_response(first, replayed)
    after = row()
    assert stored_body(after) == stored_body(before) == first.content
    assert after.response_headers == before.response_headers
    assert (after.response_status, after.completed_at, after.expires_at) == (
        before.response_status,
        before.completed_at,
        before.expires_at,
    )
    assert effects() == 1


def test_the_replay_hook_sees_the_decoded_response(post: Post, settings: Settings) -> None:
    seen: list[StoredResponse] = []
    configure(
        settings,
        RESPONSE_CODEC="tests.test_codecs.Reversed",
        REPLAY_HOOK=lambda response, stored: seen.append(stored),
    )
    first = post("/effect/", {"n": 1})
    post("/effect/", {"n": 1})

    assert [s.body for s in seen] == [first.content]
    assert ("Location", first["Location"]) in seen[0].headers


def test_a_replay_hook_may_return_another_response(settings: Settings) -> None:
    configure(settings, REPLAY_HOOK="tests.test_codecs.replace_response")
    response = replay(StoredResponse(201, b"stored", [("Content-Type", "text/plain")]))
    assert (response.status_code, response.content) == (201, b"replaced")


def test_a_replay_hook_that_returns_something_else_is_named(settings: Settings) -> None:
    configure(settings, REPLAY_HOOK=lambda response, stored: "text")
    with pytest.raises(TypeError, match="REPLAY_HOOK returned str"):
        replay(StoredResponse(201, b"stored"))


# --- system checks --------------------------------------------------------------------------


def check_ids(settings: Settings, **values: Any) -> list[str]:
    settings.IDEMPOTENCY = values
    return [message.id or "" for message in check_codec_settings()]


def test_no_codec_no_hooks_no_messages(settings: Settings) -> None:
    assert check_ids(settings) == []


def test_a_setting_that_is_not_a_dict_is_left_to_e001(settings: Settings) -> None:
    settings.IDEMPOTENCY = "not a dict"
    assert check_codec_settings() == []


def test_a_working_codec_passes(settings: Settings) -> None:
    assert check_ids(settings, RESPONSE_CODEC="tests.test_codecs.Reversed") == []


def test_check_e020_a_codec_that_cannot_load(settings: Settings) -> None:
    assert check_ids(settings, RESPONSE_CODEC="tests.test_codecs.Nowhere") == [
        "idempotency_django.E020"
    ]


def test_check_e023_a_codec_that_does_not_round_trip(settings: Settings) -> None:
    assert check_ids(settings, RESPONSE_CODEC=Lossy) == ["idempotency_django.E023"]


@pytest.mark.parametrize("name", codecs.HOOKS)
def test_check_e024_a_hook_that_cannot_be_called(settings: Settings, name: str) -> None:
    assert check_ids(settings, **{name: "tests.test_codecs.nothing_here"}) == [
        "idempotency_django.E024"
    ]
    assert check_ids(settings, **{name: 42}) == ["idempotency_django.E024"]


def test_check_w020_keys_without_a_codec(settings: Settings) -> None:
    assert check_ids(settings, ENCRYPTION_KEYS=["a key"]) == ["idempotency_django.W020"]


@pytest.mark.django_db(databases="__all__")  # Django 6.1 checks every database
def test_the_codec_checks_are_registered(settings: Settings) -> None:
    settings.IDEMPOTENCY = {"RESPONSE_CODEC": "tests.test_codecs.Nowhere"}
    with pytest.raises(SystemCheckError, match=r"idempotency_django\.E020"):
        call_command("check")


def test_an_unreadable_record_is_not_reported_as_replayed(post: Post, settings: Settings) -> None:
    from idempotency_django import signals

    replays: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        replays.append(kwargs)

    configure(settings, RESPONSE_CODEC="tests.test_codecs.Reversed")
    post("/effect/", {"n": 1})
    signals.replayed.connect(receiver)
    try:
        assert post("/effect/", {"n": 1}).status_code == 201  # readable: a replay
        configure(settings, RESPONSE_CODEC="tests.test_codecs.Refuses")
        assert post("/effect/", {"n": 1}).status_code == 409  # unreadable: refused
    finally:
        signals.replayed.disconnect(receiver)

    assert len(replays) == 1
