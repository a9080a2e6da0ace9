"""The decision table of docs/guarantees.md, through ``@idempotent`` views and the test client.

These tests commit for real (``transaction=True``): the default mode claims in a
transaction of its own, which a test wrapped in a transaction would hide.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import OperationalError, ProgrammingError, connection
from django.utils import timezone

from idempotency_django import signals
from idempotency_django.core import claims, shell
from idempotency_django.models import IdempotencyRecord
from tests import records
from tests.conftest import Post, effects

pytestmark = pytest.mark.django_db(transaction=True)

State = IdempotencyRecord.State


def problem(response: object) -> dict[str, object]:
    assert response["Content-Type"] == "application/problem+json"  # type: ignore[index]
    return json.loads(response.content)  # type: ignore[attr-defined,no-any-return]


def test_first_request_runs_the_view_and_stores_the_outcome(alice: User, post: Post) -> None:
    response = post("/effect/", {"amount": 1})

    assert response.status_code == 201
    assert "Idempotent-Replayed" not in response
    assert effects() == 1
    record = records.get()
    assert record.state == State.COMPLETED
    assert (record.account, record.endpoint, record.key) == (str(alice.pk), "POST /effect/", "k1")
    assert bytes(record.response_body) == response.content
    assert record.lease_expires_at is None


def test_retry_replays_status_body_and_allowed_headers(alice: User, post: Post) -> None:
    first = post("/effect/", {"amount": 1})
    retry = post("/effect/", {"amount": 1})

    assert effects() == 1
    assert retry.status_code == 201
    assert retry.content == first.content
    assert retry["Content-Type"] == first["Content-Type"]
    assert retry["Location"] == first["Location"]
    assert retry["Idempotent-Replayed"] == "true"
    assert "X-Request-Id" not in retry
    assert not retry.cookies
    assert first.cookies["session"].value == "secret"


def test_stored_headers_setting_adds_headers_to_replays(alice: User, post: Post, settings) -> None:  # type: ignore[no-untyped-def]
    settings.IDEMPOTENCY = {"STORED_HEADERS": ["X-Request-Id"]}
    first = post("/effect/", {})
    retry = post("/effect/", {})

    assert retry["X-Request-Id"] == first["X-Request-Id"]


def test_json_key_order_and_whitespace_are_the_same_request(
    alice: User, post: Post, client
) -> None:  # type: ignore[no-untyped-def]
    post("/effect/", {"a": 1, "b": 2})
    retry = client.post(
        "/effect/",
        data='{ "b" : 2,\n "a": 1 }',
        content_type="application/json",
        headers={"Idempotency-Key": "k1", "X-User": "alice"},
    )

    assert retry.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert effects() == 1


def test_key_reused_with_another_body_is_422_and_runs_nothing(alice: User, post: Post) -> None:
    post("/effect/", {"amount": 1})
    response = post("/effect/", {"amount": 2})

    assert response.status_code == 422
    assert problem(response)["type"] == "urn:idempotency-django:problem:key-mismatch"
    assert effects() == 1


def test_key_reused_with_another_query_string_is_422(alice: User, post: Post) -> None:
    post("/effect/?currency=usd", {})
    response = post("/effect/?currency=eur", {})

    assert response.status_code == 422
    assert effects() == 1


def test_same_key_on_another_path_is_another_operation(alice: User, post: Post) -> None:
    first = post("/effect/1/", {})
    second = post("/effect/2/", {})

    assert (first.status_code, second.status_code) == (201, 201)
    assert "Idempotent-Replayed" not in second
    assert effects() == 2


def test_missing_key_is_400_and_runs_nothing(alice: User, post: Post) -> None:
    response = post("/effect/", {}, key=None)

    assert response.status_code == 400
    body = problem(response)
    assert body["type"] == "urn:idempotency-django:problem:key-missing"
    assert body["status"] == 400
    assert effects() == 0


@pytest.mark.parametrize(
    "key",
    ["", "   ", "a" * 256, '"' + "a" * 256 + '"', "with space", "tab\there", "é", '"open', '"a"b'],
)
def test_malformed_key_is_400_and_runs_nothing(alice: User, post: Post, key: str) -> None:
    response = post("/effect/", {}, key=key)

    assert response.status_code == 400
    assert problem(response)["type"] == "urn:idempotency-django:problem:key-malformed"
    assert effects() == 0
    assert not records.exists()


@pytest.mark.parametrize("joined", ["k1,k2", "k1, k2", "k1,k1", '"k1","k2"', '"k1,k2"'])
def test_two_key_header_lines_are_400_and_run_nothing(alice: User, post: Post, joined: str) -> None:
    """A WSGI server hands two ``Idempotency-Key`` lines to Django joined by a comma."""
    post("/effect/", {}, key="k1")

    response = post("/effect/", {}, key=joined)

    assert response.status_code == 400
    assert problem(response)["type"] == "urn:idempotency-django:problem:key-malformed"
    assert effects() == 1


# -- the endpoint: one route, with or without its trailing slash ------------------------------


@pytest.mark.parametrize(
    ("first", "retry"),
    [
        ("/optional-slash", "/optional-slash/"),
        ("/optional-slash/", "/optional-slash"),
        ("/optional-slash/7", "/optional-slash/7/"),
    ],
)
def test_a_retry_that_differs_only_in_the_trailing_slash_is_replayed(
    alice: User, post: Post, first: str, retry: str
) -> None:
    original = post(first, {"amount": 1})
    again = post(retry, {"amount": 1})

    assert original.status_code == 201
    assert again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == original.content
    assert effects() == 1


def test_routes_a_slash_apart_keep_their_own_keys(alice: User, post: Post) -> None:
    without = post("/apart", {"amount": 1})
    with_slash = post("/apart/", {"amount": 1})

    assert without.status_code == with_slash.status_code == 201
    assert "Idempotent-Replayed" not in with_slash
    assert effects("effect") == 1
    assert effects("slash-twin") == 1


def test_other_arguments_of_one_route_keep_their_own_keys(alice: User, post: Post) -> None:
    one = post("/optional-slash/1", {"amount": 1})
    two = post("/optional-slash/2/", {"amount": 1})

    assert one.status_code == two.status_code == 201
    assert "Idempotent-Replayed" not in two
    assert effects() == 2


def test_slash_twins_that_resolve_to_other_arguments_keep_their_own_keys(
    alice: User, post: Post
) -> None:
    """The same view, but its argument is ``"7"`` at one path and ``"7/"`` at the other:
    two different requests to it, not one retried, so two endpoints."""
    without = post("/captures-slash/7", {"amount": 1})
    with_slash = post("/captures-slash/7/", {"amount": 1})

    assert without.status_code == with_slash.status_code == 201
    assert "Idempotent-Replayed" not in with_slash
    assert effects() == 2
    assert sorted(r.endpoint for r in records.all()) == [
        "POST /captures-slash/7",
        "POST /captures-slash/7/",
    ]


@pytest.mark.parametrize("retry", ["/optional-slash/", "/optional-slash"])
def test_a_record_stored_under_the_previous_endpoint_format_is_replayed(
    alice: User, post: Post, settings: Any, retry: str
) -> None:
    # The previous release's default endpoint: the method and the concrete path.
    settings.IDEMPOTENCY = {"ENDPOINT": lambda request: f"{request.method} {request.path}"}
    original = post("/optional-slash/", {"amount": 1})
    settings.IDEMPOTENCY = {}

    again = post(retry, {"amount": 1})

    assert again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == original.content
    assert effects() == 1


def test_bare_and_structured_field_forms_name_the_same_key(alice: User, post: Post) -> None:
    post("/effect/", {}, key="abc")
    retry = post("/effect/", {}, key='"abc"')

    assert retry["Idempotent-Replayed"] == "true"
    assert effects() == 1
    assert records.get().key == "abc"


def test_255_character_key_is_accepted(alice: User, post: Post) -> None:
    assert post("/effect/", {}, key="k" * 255).status_code == 201


def test_optional_key_runs_unprotected_without_a_key(alice: User, post: Post) -> None:
    post("/optional/", {}, key=None)
    post("/optional/", {}, key=None)

    assert effects() == 2
    assert not records.exists()


def test_optional_key_still_protects_when_a_key_is_sent(alice: User, post: Post) -> None:
    post("/optional/", {}, key="k")
    retry = post("/optional/", {}, key="k")

    assert retry["Idempotent-Replayed"] == "true"
    assert effects() == 1


def test_safe_methods_are_not_protected(alice: User, client) -> None:  # type: ignore[no-untyped-def]
    for _ in range(2):
        response = client.get("/effect/", headers={"Idempotency-Key": "k", "X-User": "alice"})
        assert response.status_code == 201
        assert "Idempotent-Replayed" not in response
    assert effects() == 2


def test_put_is_protected_only_where_configured(alice: User, post: Post) -> None:
    post("/with-put/", {}, method="put")
    retry = post("/with-put/", {}, method="put")
    post("/effect/", {}, method="put", key="unprotected")
    post("/effect/", {}, method="put", key="unprotected")

    assert retry["Idempotent-Replayed"] == "true"
    assert effects("with_put") == 1
    assert effects("effect") == 2


def test_patch_is_protected_by_default(alice: User, post: Post) -> None:
    post("/effect/", {}, method="patch")
    retry = post("/effect/", {}, method="patch")

    assert retry["Idempotent-Replayed"] == "true"
    assert effects() == 1


def test_anonymous_requests_are_refused_and_cannot_read_stored_responses(
    alice: User, post: Post
) -> None:
    stored = post("/effect/", {"amount": 1})
    response = post("/effect/", {"amount": 1}, user=None)

    assert response.status_code == 403
    assert problem(response)["type"] == "urn:idempotency-django:problem:anonymous"
    assert stored.content not in response.content
    assert effects() == 1


def test_anonymous_bypass_runs_unprotected(post: Post, settings, db) -> None:  # type: ignore[no-untyped-def]
    settings.IDEMPOTENCY = {"ANONYMOUS": "bypass"}
    post("/effect/", {}, user=None)
    post("/effect/", {}, user=None)

    assert effects() == 2
    assert not records.exists()


def test_two_accounts_with_one_key_are_independent(alice: User, bob: User, post: Post) -> None:
    for_alice = post("/effect/", {"amount": 1}, user="alice")
    for_bob = post("/effect/", {"amount": 1}, user="bob")
    alice_retry = post("/effect/", {"amount": 1}, user="alice")
    bob_retry = post("/effect/", {"amount": 1}, user="bob")

    assert for_alice.status_code == for_bob.status_code == 201
    assert "Idempotent-Replayed" not in for_bob
    assert json.loads(for_bob.content)["effect"] != json.loads(for_alice.content)["effect"]
    # Each retry is its own account's first response, replayed: one run per account.
    assert (alice_retry.status_code, alice_retry.content) == (201, for_alice.content)
    assert (bob_retry.status_code, bob_retry.content) == (201, for_bob.content)
    assert alice_retry["Idempotent-Replayed"] == bob_retry["Idempotent-Replayed"] == "true"
    assert effects() == 2

    # One account's body is no mismatch for the other's request under the same key.
    bob_with_other_body = post("/effect/", {"amount": 2}, user="bob", key="k2")
    alice_with_another = post("/effect/", {"amount": 3}, user="alice", key="k2")
    assert bob_with_other_body.status_code == alice_with_another.status_code == 201
    assert effects() == 4


def test_a_retry_is_answered_with_its_own_endpoints_record(alice: User, post: Post) -> None:
    """One account, one key, three endpoints: the retry's claim loses, and the read that
    follows must find its endpoint's record. The other two were written first and their
    endpoints sort on either side, so a read that ignored the endpoint would find one of
    them first, whatever order the database returns rows in."""
    firsts = {
        path: post(path, {"amount": 1}) for path in ("/effect/1/", "/effect/3/", "/effect/2/")
    }
    retry = post("/effect/2/", {"amount": 1})

    assert [first.status_code for first in firsts.values()] == [201, 201, 201]
    assert retry.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == firsts["/effect/2/"].content
    assert effects() == 3


def test_custom_account_callable_scopes_keys(alice: User, bob: User, post: Post, settings) -> None:  # type: ignore[no-untyped-def]
    settings.IDEMPOTENCY = {"ACCOUNT": lambda request: "one-tenant"}
    post("/effect/", {}, user="alice")
    from_bob = post("/effect/", {}, user="bob")

    assert from_bob["Idempotent-Replayed"] == "true"
    assert records.get().account == "one-tenant"


def test_exception_releases_the_key_and_a_retry_runs(alice: User, post: Post, client) -> None:  # type: ignore[no-untyped-def]
    client.raise_request_exception = False
    failed = post("/effect/", {"raise": True})
    assert failed.status_code == 500
    assert not records.exists()

    retry = post("/effect/", {"raise": True}, key="k1")
    assert retry.status_code == 500
    assert effects() == 2


def test_5xx_response_releases_the_key(alice: User, post: Post) -> None:
    first = post("/effect/", {"status": 503})
    retry = post("/effect/", {"status": 503})

    assert first.status_code == retry.status_code == 503
    assert "Idempotent-Replayed" not in retry
    assert effects() == 2
    assert not records.exists()


@pytest.mark.parametrize("status", [408, 409, 425, 429])
def test_transient_4xx_is_not_stored(alice: User, post: Post, status: int) -> None:
    post("/effect/", {"status": status})
    retry = post("/effect/", {"status": status})

    assert "Idempotent-Replayed" not in retry
    assert effects() == 2


@pytest.mark.parametrize("status", [200, 302, 400, 402, 404, 422])
def test_definitive_outcomes_are_stored_and_replayed(alice: User, post: Post, status: int) -> None:
    first = post("/effect/", {"status": status})
    retry = post("/effect/", {"status": status})

    assert retry.status_code == status
    assert retry.content == first.content
    assert retry["Idempotent-Replayed"] == "true"
    assert effects() == 1


def test_store_statuses_per_view(alice: User, post: Post) -> None:
    post("/only-201/", {"status": 402})
    declined_again = post("/only-201/", {"status": 402})

    assert "Idempotent-Replayed" not in declined_again
    assert effects() == 2


def test_store_statuses_setting(alice: User, post: Post, settings) -> None:  # type: ignore[no-untyped-def]
    settings.IDEMPOTENCY = {"STORE_STATUSES": lambda status: status < 600}
    post("/effect/", {"status": 500})
    retry = post("/effect/", {"status": 500})

    assert retry.status_code == 500
    assert retry["Idempotent-Replayed"] == "true"
    assert effects() == 1


@contextlib.contextmanager
def completed_once_a_duplicate_waits() -> Iterator[None]:
    """Turn the one completed record back into its request in flight: inside, the key is
    claimed (same scope and fingerprint, a live lease), and the first time a duplicate
    reports it in flight (``in_flight``, sent as it starts to wait) it completes with the
    outcome it had, as its first request would. Sleep-free: the duplicate's next look finds
    the stored outcome, if it still waits by then."""
    from idempotency_django.responses import StoredResponse

    done = records.get()
    records.delete()
    policy = claims.ClaimPolicy(
        "default", lease=60, ttl=3600, in_flight="conflict", wait_seconds=0, retry_after=1
    )
    scope = claims.Scope(str(done.account), str(done.endpoint), str(done.key))
    claim = shell.claim_or_replay(scope, done.fingerprint, policy)
    assert isinstance(claim, claims.Claim)
    outcome = StoredResponse(
        int(done.response_status or 0),
        bytes(done.response_body or b""),
        [(str(name), str(value)) for name, value in done.response_headers or []],
    )

    def complete(**kwargs: Any) -> None:
        assert shell.complete(claim, outcome)

    signals.in_flight.connect(complete, weak=False)
    try:
        yield
    finally:
        signals.in_flight.disconnect(complete)


def test_a_views_own_wait_seconds_bounds_its_wait_not_the_setting(
    alice: User, post: Post, settings: Any
) -> None:
    """``/waiting/`` declares ``wait_seconds=20``; ``WAIT_SECONDS = 0`` would answer its
    duplicate 409 at once. Its own bound is the one it waits by: the duplicate waits, and
    gets the replay once the first request completes."""
    settings.IDEMPOTENCY = {"WAIT_SECONDS": 0}
    first = post("/waiting/", {"amount": 1})

    with completed_once_a_duplicate_waits():
        duplicate = post("/waiting/", {"amount": 1})

    assert first.status_code == 201
    assert duplicate.status_code == 201
    assert duplicate["Idempotent-Replayed"] == "true"
    assert duplicate.content == first.content
    assert effects("waiting") == 1


def test_in_flight_duplicate_gets_409_with_retry_after(alice: User, post: Post) -> None:
    records.create(
        account=str(alice.pk),
        endpoint="POST /effect/",
        key="k1",
        fingerprint=_fingerprint_of(post, {"amount": 1}),
        token="a" * 32,
        created_at=timezone.now(),
        lease_expires_at=timezone.now() + timedelta(seconds=30),
        expires_at=timezone.now() + timedelta(days=1),
    )
    response = post("/effect/", {"amount": 1})

    assert response.status_code == 409
    assert response["Retry-After"] == "1"
    assert problem(response)["type"] == "urn:idempotency-django:problem:in-flight"
    assert effects() == 0


@pytest.mark.parametrize(
    ("retry_after", "left", "expected"),
    [
        (None, 9.5, "1"),  # renewed on schedule: the request may end any moment
        (None, 4.2, "5"),  # it missed its renewals: nothing changes for 4.2 s
        (3, 9.5, "3"),
        (3, 4.2, "5"),
        (3, 0.5, "3"),  # never less than RETRY_AFTER_SECONDS
    ],
)
def test_an_in_flight_409_says_how_long_is_left_of_a_lease_that_missed_its_renewals(
    alice: User, post: Post, settings: Any, retry_after: int | None, left: float, expected: str
) -> None:
    """A worker renews its lease every third of it (10 s here): with half of it or less
    left, its worker died or lost the store, and a retry before the lease lapses gets
    another 409. Retry-After says when it lapses, rounded up."""
    if retry_after is not None:
        settings.IDEMPOTENCY = {"RETRY_AFTER_SECONDS": retry_after}
    now = timezone.now()
    records.create(
        account=str(alice.pk),
        endpoint="POST /effect/",
        key="k1",
        fingerprint=_fingerprint_of(post, {"amount": 1}),
        token="a" * 32,
        created_at=now - timedelta(seconds=30),
        lease_expires_at=now + timedelta(seconds=left),
        expires_at=now + timedelta(days=1),
    )
    response = post("/effect/", {"amount": 1})

    assert response.status_code == 409
    assert response["Retry-After"] == expected
    assert effects() == 0


def test_mismatch_wins_over_in_flight(alice: User, post: Post) -> None:
    records.create(
        account=str(alice.pk),
        endpoint="POST /effect/",
        key="k1",
        fingerprint=_fingerprint_of(post, {"amount": 2}),  # another request
        token="a" * 32,
        created_at=timezone.now(),
        lease_expires_at=timezone.now() + timedelta(seconds=30),
        expires_at=timezone.now() + timedelta(days=1),
    )

    assert post("/effect/", {"amount": 1}).status_code == 422


def test_lapsed_lease_is_taken_over_and_runs_once(alice: User, post: Post) -> None:
    fingerprint = _fingerprint_of(post, {"amount": 1})
    records.create(
        account=str(alice.pk),
        endpoint="POST /effect/",
        key="k1",
        fingerprint=fingerprint,
        token="a" * 32,
        created_at=timezone.now() - timedelta(seconds=60),
        lease_expires_at=timezone.now() - timedelta(seconds=1),
        expires_at=timezone.now() + timedelta(days=1),
    )
    response = post("/effect/", {"amount": 1})
    retry = post("/effect/", {"amount": 1})

    assert response.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert effects() == 1
    record = records.get()
    assert record.token != "a" * 32
    assert record.state == State.COMPLETED


def test_lapsed_lease_with_another_body_is_still_422(alice: User, post: Post) -> None:
    records.create(
        account=str(alice.pk),
        endpoint="POST /effect/",
        key="k1",
        fingerprint=_fingerprint_of(post, {"amount": 2}),  # another request
        token="a" * 32,
        created_at=timezone.now() - timedelta(seconds=60),
        lease_expires_at=timezone.now() - timedelta(seconds=1),
        expires_at=timezone.now() + timedelta(days=1),
    )

    assert post("/effect/", {"amount": 1}).status_code == 422
    assert effects() == 0


def test_completed_key_past_its_ttl_counts_as_absent(alice: User, post: Post) -> None:
    post("/effect/", {"amount": 1})
    records.update(expires_at=timezone.now() - timedelta(seconds=1))

    again = post("/effect/", {"amount": 2})

    assert again.status_code == 201
    assert "Idempotent-Replayed" not in again
    assert effects() == 2
    assert records.count() == 1


def test_ttl_setting_sets_expiry(alice: User, post: Post, settings) -> None:  # type: ignore[no-untyped-def]
    settings.IDEMPOTENCY = {"TTL_SECONDS": 3600}
    before = timezone.now()
    post("/effect/", {})
    record = records.get()

    assert (
        before + timedelta(seconds=3590) < record.expires_at <= timezone.now() + timedelta(hours=1)
    )


def test_fingerprint_fields_ignore_other_fields(alice: User, post: Post) -> None:
    post("/fields/", {"amount": 1, "note": "first"})
    retry = post("/fields/", {"amount": 1, "note": "edited"})
    other = post("/fields/", {"amount": 2, "note": "first"})

    assert retry["Idempotent-Replayed"] == "true"
    assert other.status_code == 422
    assert effects() == 1


def test_fingerprint_callable(alice: User, post: Post) -> None:
    post("/custom-fingerprint/", {"amount": 1, "note": "a"})
    retry = post("/custom-fingerprint/", {"amount": 1, "note": "b"})
    other = post("/custom-fingerprint/", {"amount": 3})

    assert retry["Idempotent-Replayed"] == "true"
    assert other.status_code == 422


def test_class_based_view_with_method_decorator(alice: User, post: Post) -> None:
    post("/class-based/", {})
    retry = post("/class-based/", {})

    assert retry["Idempotent-Replayed"] == "true"
    assert effects("class_based") == 1


def test_disabled_switch_turns_protection_off(alice: User, post: Post, settings) -> None:  # type: ignore[no-untyped-def]
    settings.IDEMPOTENCY = {"ENABLED": False}
    post("/effect/", {}, key=None)
    post("/effect/", {})
    post("/effect/", {})

    assert effects() == 3
    assert not records.exists()


def test_streaming_response_is_delivered_and_a_retry_is_told_it_ran(
    alice: User, post: Post
) -> None:
    first = post("/stream/", {})
    retry = post("/stream/", {})

    assert first.status_code == 201
    assert b"".join(first.streaming_content) == b"chunk-1,chunk-2"
    assert retry.status_code == 409
    body = problem(retry)
    assert body["type"] == "urn:idempotency-django:problem:response-not-stored"
    assert "201" in str(body["detail"])
    assert "Retry-After" not in retry
    assert effects("stream") == 1


def test_response_over_the_limit_is_delivered_but_not_stored(
    alice: User, post: Post, settings
) -> None:  # type: ignore[no-untyped-def]
    settings.IDEMPOTENCY = {"MAX_RESPONSE_BYTES": 10}
    first = post("/effect/", {"amount": 1})
    retry = post("/effect/", {"amount": 1})

    assert first.status_code == 201
    assert retry.status_code == 409
    assert problem(retry)["type"] == "urn:idempotency-django:problem:response-not-stored"
    assert effects() == 1


def test_body_over_django_upload_limit_is_413(alice: User, post: Post, settings) -> None:  # type: ignore[no-untyped-def]
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 100
    response = post("/effect/", {"blob": "x" * 500})

    assert response.status_code == 413
    assert problem(response)["type"] == "urn:idempotency-django:problem:body-too-large"
    assert effects() == 0


def test_non_utf8_and_non_json_bodies_are_fingerprinted_as_bytes(alice: User, post: Post) -> None:
    first = post("/effect/", b"\xff\xfe raw", content_type="application/octet-stream")
    retry = post("/effect/", b"\xff\xfe raw", content_type="application/octet-stream")
    other = post("/effect/", b"\xff\xfe other", content_type="application/octet-stream")
    bad_json = post("/effect/", b"\xff{not json", content_type="application/json", key="k2")

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert other.status_code == 422
    assert bad_json.status_code == 201


@pytest.fixture
def store_down() -> Iterator[list[str]]:
    """Make every statement on the records table fail as if the database went away.

    Uses Django's ``execute_wrapper`` hook; tests with a server that really goes away live
    with the end-to-end tests.
    """
    failed: list[str] = []

    def fail_on_records(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
        if IdempotencyRecord._meta.db_table in sql:
            failed.append(sql)
            raise OperationalError("server closed the connection unexpectedly")
        return execute(sql, params, many, context)

    with connection.execute_wrapper(fail_on_records):
        yield failed


@pytest.mark.database_store("injects SQL failures; the Redis store's failures: test_redis_store")
def test_store_down_fails_closed_with_503(alice: User, post: Post, store_down: list[str]) -> None:
    response = post("/effect/", {})

    assert store_down
    assert response.status_code == 503
    assert response["Retry-After"] == "1"
    assert problem(response)["type"] == "urn:idempotency-django:problem:store-unavailable"
    assert effects() == 0


@pytest.mark.database_store("injects SQL failures; the Redis store's failures: test_redis_store")
def test_store_down_in_atomic_mode_fails_closed(
    alice: User, post: Post, store_down: list[str]
) -> None:
    response = post("/atomic/", {})

    assert response.status_code == 503
    assert effects() == 0


@pytest.mark.database_store("injects SQL failures; the Redis store's failures: test_redis_store")
def test_store_down_fails_open_when_configured(
    alice: User, post: Post, settings, store_down
) -> None:  # type: ignore[no-untyped-def]
    settings.IDEMPOTENCY = {"ON_STORE_ERROR": "open"}
    response = post("/effect/", {})

    assert response.status_code == 201
    assert effects() == 1


@pytest.mark.database_store("injects SQL failures; the Redis store's failures: test_redis_store")
def test_a_store_that_answers_with_an_error_fails_closed_even_when_open(
    alice: User, post: Post, settings: Any
) -> None:
    """Failing open is for a store that cannot be reached. A store that answers with an
    error (a missing table, a broken migration) is not that: the view never runs unclaimed."""
    settings.IDEMPOTENCY = {"ON_STORE_ERROR": "open"}
    table = IdempotencyRecord._meta.db_table

    def missing_table(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
        if table in sql:
            raise ProgrammingError(f'relation "{table}" does not exist')
        return execute(sql, params, many, context)

    with connection.execute_wrapper(missing_table):
        response = post("/effect/", {})

    assert response.status_code == 503
    assert problem(response)["type"] == "urn:idempotency-django:problem:store-unavailable"
    assert effects() == 0


@pytest.mark.database_store("injects SQL failures; the Redis store's failures: test_redis_store")
def test_completion_failure_still_sends_the_response_and_keeps_the_claim(
    alice: User, post: Post, caplog: pytest.LogCaptureFixture
) -> None:
    def fail_updates(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
        if sql.startswith("UPDATE") and IdempotencyRecord._meta.db_table in sql:
            raise OperationalError("server closed the connection unexpectedly")
        return execute(sql, params, many, context)

    with (
        caplog.at_level(logging.ERROR, logger="idempotency_django"),
        connection.execute_wrapper(fail_updates),
    ):
        response = post("/effect/", {})

    assert response.status_code == 201
    assert effects() == 1
    assert "completing a key" in caplog.text
    record = records.get()
    assert record.state == State.IN_PROGRESS
    assert post("/effect/", {}).status_code == 409


def test_claim_lost_completion_does_not_overwrite_the_new_owner(
    alice: User, post: Post, caplog: pytest.LogCaptureFixture
) -> None:
    """A view that outlives its lease (no heartbeat here) and is taken over does not store."""
    from idempotency_django.core import claims, shell

    scope = claims.Scope(str(alice.pk), "POST /effect/", "k1")
    options = claims.ClaimPolicy(
        "default", lease=10, ttl=60, in_flight="conflict", wait_seconds=0, retry_after=1
    )
    first = shell.claim_or_replay(scope, "f" * 64, options)
    assert isinstance(first, claims.Claim)
    records.update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    second = shell.claim_or_replay(scope, "f" * 64, options)
    assert isinstance(second, claims.Claim)

    from idempotency_django.responses import StoredResponse

    with caplog.at_level(logging.ERROR, logger="idempotency_django"):
        assert shell.complete(first, StoredResponse(201, b"first")) is False
    assert "claim lost" in caplog.text
    assert shell.complete(second, StoredResponse(201, b"second")) is True
    assert bytes(records.get().response_body) == b"second"
    shell.release(first)
    assert records.count() == 1


def _fingerprint_of(post: Post, body: object) -> str:
    """The fingerprint the default settings give ``POST /effect/`` with this JSON body."""
    from django.test import RequestFactory

    from idempotency_django.keys import default_fingerprint

    request = RequestFactory().post(
        "/effect/", data=json.dumps(body), content_type="application/json"
    )
    return default_fingerprint(request, "POST /effect/")


def test_in_progress_record_without_a_lease_counts_as_lapsed(alice: User, post: Post) -> None:
    post("/effect/", {"amount": 1})
    records.update(state=State.IN_PROGRESS, lease_expires_at=None)

    response = post("/effect/", {"amount": 1})

    assert response.status_code == 201
    assert "Idempotent-Replayed" not in response
    assert effects() == 2


def test_no_ttl_keeps_the_key_forever(alice: User, post: Post, settings) -> None:  # type: ignore[no-untyped-def]
    from idempotency_django.store import never

    settings.IDEMPOTENCY = {"TTL_SECONDS": None}
    post("/effect/", {"amount": 1})
    retry = post("/effect/", {"amount": 1})

    assert retry["Idempotent-Replayed"] == "true"
    assert records.get().expires_at == never()


@pytest.mark.parametrize("other", ["ABC", '"abc "', "abC"])
def test_keys_compare_exactly_on_every_database(alice: User, post: Post, other: str) -> None:
    """MariaDB's default collation would make these one key (case, trailing spaces)."""
    post("/effect/", {}, key="abc")
    response = post("/effect/", {}, key=other)

    assert response.status_code == 201
    assert "Idempotent-Replayed" not in response
    assert effects() == 2


def test_a_retried_claim_recognises_its_own_unacknowledged_row(alice: User) -> None:
    """A claim that committed while its connection died is this request's, on the retry."""
    from idempotency_django.core import claims, shell
    from idempotency_django.exceptions import InFlight

    scope = claims.Scope(str(alice.pk), "POST /effect/", "k1")
    options = claims.ClaimPolicy(
        "default", lease=10, ttl=60, in_flight="conflict", wait_seconds=0, retry_after=1
    )
    first = shell.claim_or_replay(scope, "f" * 64, options, token="t" * 32)
    again = shell.claim_or_replay(scope, "f" * 64, options, token="t" * 32)

    assert isinstance(again, claims.Claim)
    assert again.token == first.token == "t" * 32  # type: ignore[union-attr]
    with pytest.raises(InFlight):
        shell.claim_or_replay(scope, "f" * 64, options)


def test_a_claim_resumed_after_its_lost_reply_is_told_as_claimed(alice: User) -> None:
    """The view runs under the resumed claim: ``claimed`` is sent for it (the metrics count
    it as claimed, the soak's ledger records its execution), as for any new claim."""
    from idempotency_django import signals
    from idempotency_django.core import claims, shell

    scope = claims.Scope(str(alice.pk), "POST /effect/", "k1")
    options = claims.ClaimPolicy(
        "default", lease=10, ttl=60, in_flight="conflict", wait_seconds=0, retry_after=1
    )
    told: list[str] = []
    signals.claimed.connect(
        lambda **kwargs: told.append(signals.raw_key()), weak=False, dispatch_uid="resumed"
    )
    try:
        shell.claim_or_replay(scope, "f" * 64, options, token="t" * 32)
        resumed = shell.claim_or_replay(scope, "f" * 64, options, token="t" * 32)
    finally:
        signals.claimed.disconnect(dispatch_uid="resumed")

    assert isinstance(resumed, claims.Claim)
    assert told == ["k1", "k1"]


def test_a_retried_completion_is_not_reported_lost(
    alice: User, caplog: pytest.LogCaptureFixture
) -> None:
    from idempotency_django.core import claims, shell
    from idempotency_django.responses import StoredResponse

    scope = claims.Scope(str(alice.pk), "POST /effect/", "k1")
    options = claims.ClaimPolicy(
        "default", lease=10, ttl=60, in_flight="conflict", wait_seconds=0, retry_after=1
    )
    claim = shell.claim_or_replay(scope, "f" * 64, options)
    assert isinstance(claim, claims.Claim)
    assert shell.complete(claim, StoredResponse(201, b"{}"))
    with caplog.at_level(logging.ERROR, logger="idempotency_django"):
        assert shell.complete(claim, StoredResponse(201, b"{}"))
    assert "claim lost" not in caplog.text


# --- refused at decoration time, not at the first request -------------------------------------


def test_a_drf_view_class_is_refused_with_a_pointer_to_the_mixin() -> None:
    """docs/decorator.md promises the refusal; without it the class became a function, and the
    URLconf failed with "'function' object has no attribute 'as_view'"."""
    from rest_framework.views import APIView
    from rest_framework.viewsets import ViewSet

    from idempotency_django.decorators import idempotent

    class ChargeView(APIView):
        pass

    class ChargeViewSet(ViewSet):
        pass

    with pytest.raises(TypeError, match=r"ChargeView.*IdempotentMixin"):
        idempotent(ChargeView)
    with pytest.raises(TypeError, match=r"ChargeViewSet.*IdempotentMixin"):
        idempotent(ttl_seconds=3600)(ChargeViewSet)


def test_a_django_view_class_is_refused_with_a_pointer_to_method_decorator() -> None:
    from django.views import View

    from idempotency_django.decorators import idempotent

    class ChargeView(View):
        pass

    with pytest.raises(TypeError, match=r"method_decorator\(idempotent, name='dispatch'\)"):
        idempotent(ChargeView)


def test_an_idempotent_function_called_by_an_idempotent_view_runs_under_its_claim(
    alice: User,
) -> None:
    """No middleware: the view's own @idempotent claims, the function it calls (same
    account, endpoint and key) runs inside that claim instead of answering it 409."""
    from django.test import RequestFactory

    from idempotency_django.decorators import idempotent
    from tests.project.middleware_views import charge

    @idempotent
    def view(request: Any) -> Any:
        return charge(request)

    def send() -> Any:
        request = RequestFactory().post(
            "/charges/",
            {"amount": 1},
            content_type="application/json",
            headers={"Idempotency-Key": "k1"},
        )
        request.user = alice
        return view(request)

    first = send()
    retry = send()

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert effects("mw_charge") == 1
    assert records.count() == 1
