"""The FernetCodec with real keys: what the row holds, replays, rotation, a key that is gone,
and the checks for keys and for ``cryptography`` itself. Run on every database."""

from __future__ import annotations

import json
import logging
import re
import sys
from io import StringIO
from typing import TYPE_CHECKING, Any

import pytest
from cryptography.fernet import Fernet, InvalidToken
from django.contrib.auth.models import User
from django.core.management import CommandError, ManagementUtility, call_command
from rest_framework.test import APIClient

from idempotency_django.checks import check_codec_settings
from idempotency_django.codecs import (
    SEALED,
    SEALED_UNBOUND,
    UNSTORABLE,
    FernetCodec,
)
from idempotency_django.core import codecs
from idempotency_django.models import IdempotencyRecord
from idempotency_django.tasks import TaskResultNotStored, claim_once
from tests import records
from tests.conftest import Post, effects
from tests.project.factories import IdempotencyRecordFactory

if TYPE_CHECKING:
    from pytest_django import Settings

pytestmark = pytest.mark.django_db

FERNET = "idempotency_django.codecs.FernetCodec"
OLD_KEY = Fernet.generate_key().decode()
NEW_KEY = Fernet.generate_key().decode()
OTHER_KEY = Fernet.generate_key().decode()
CARD = {"number": "4242424242424242", "cvc": "123"}
PROBLEM = "urn:idempotency-django:problem:"


@pytest.fixture(autouse=True)
def _users(alice: User) -> None:
    """``post`` sends its requests as alice."""


def encrypt_with(settings: Settings, *keys: Any) -> None:
    settings.IDEMPOTENCY = {"RESPONSE_CODEC": FERNET, "ENCRYPTION_KEYS": list(keys)}


def token_of(path: str = "/effect/") -> bytes:
    """The Fernet token in the row, as the database holds it."""
    body = bytes(records.get(endpoint=f"POST {path}").response_body)
    assert body.startswith(SEALED)
    return body[len(SEALED) :]


@pytest.mark.parametrize(
    "path",
    ["/effect/", pytest.param("/atomic/", marks=pytest.mark.database_store("atomic mode"))],
)
def test_the_row_holds_ciphertext_and_the_replay_is_the_first_response(
    post: Post, settings: Settings, path: str
) -> None:
    encrypt_with(settings, NEW_KEY)

    first = post(path, {"card": CARD})
    record = records.get()
    replayed = post(path, {"card": CARD})

    stored = bytes(record.response_body)
    assert b"4242424242424242" not in stored
    assert first["Location"].encode() not in stored
    assert record.response_headers == []
    assert record.response_status == 201
    frame = Fernet(NEW_KEY).decrypt(token_of(path))  # it is Fernet, under the first key
    assert first.content in frame

    assert replayed.status_code == first.status_code == 201
    assert replayed.content == first.content
    assert replayed["Content-Type"] == first["Content-Type"]
    assert replayed["Location"] == first["Location"]
    assert replayed["Idempotent-Replayed"] == "true"
    assert effects() == 1


def test_rotation_old_records_replay_and_new_ones_use_the_new_key(
    post: Post, settings: Settings
) -> None:
    encrypt_with(settings, OLD_KEY)
    first = post("/effect/", {"n": 1}, key="before")

    encrypt_with(settings, NEW_KEY, OLD_KEY)
    replayed = post("/effect/", {"n": 1}, key="before")
    second = post("/effect/", {"n": 2}, key="after")

    assert (replayed.status_code, replayed.content) == (201, first.content)
    assert replayed["Idempotent-Replayed"] == "true"
    newest = bytes(records.get(key="after").response_body)[len(SEALED) :]
    assert second.content in Fernet(NEW_KEY).decrypt(newest)
    with pytest.raises(InvalidToken):
        Fernet(OLD_KEY).decrypt(newest)
    assert effects() == 2


def test_a_record_sealed_by_a_key_no_longer_listed_is_a_409_problem_not_a_rerun(
    post: Post, settings: Settings
) -> None:
    encrypt_with(settings, OLD_KEY)
    assert post("/effect/", {"n": 1}).status_code == 201

    encrypt_with(settings, OTHER_KEY)
    retry = post("/effect/", {"n": 1})

    assert retry.status_code == 409
    assert retry["Content-Type"] == "application/problem+json"
    problem = json.loads(retry.content)
    assert problem["type"] == "urn:idempotency-django:problem:response-unreadable"
    assert problem["status"] == 409
    assert effects() == 1


def test_plain_records_from_before_encryption_still_replay(post: Post, settings: Settings) -> None:
    first = post("/effect/", {"n": 1})
    encrypt_with(settings, NEW_KEY)

    replayed = post("/effect/", {"n": 1})

    assert (replayed.status_code, replayed.content) == (201, first.content)
    assert effects() == 1


def test_keys_that_are_wrong_at_completion_store_nothing_and_never_rerun(
    post: Post, settings: Settings
) -> None:
    encrypt_with(settings, "not a fernet key")

    first = post("/effect/", {"n": 1})
    retry = post("/effect/", {"n": 1})

    assert first.status_code == 201
    assert bytes(records.get().response_body) == UNSTORABLE
    assert retry.status_code == 409
    assert effects() == 1


def test_task_results_are_encrypted_and_repeat_the_first_result(settings: Settings) -> None:
    encrypt_with(settings, NEW_KEY)
    runs = []

    for _ in range(2):
        with claim_once("shop", "order-7", name="charge-card") as run:
            if not run.done:
                runs.append(1)
                run.result = {"card": CARD["number"]}
        assert run.result == {"card": CARD["number"]}

    assert runs == [1]
    assert b"4242" not in bytes(records.get().response_body)


# --- keys and checks --------------------------------------------------------------------------


def test_the_codec_can_be_given_its_keys_in_code() -> None:
    codec = FernetCodec([NEW_KEY.encode(), OLD_KEY])
    token = codec.encode(b"data")
    assert Fernet(NEW_KEY).decrypt(token) == b"data"
    assert FernetCodec([OLD_KEY, NEW_KEY]).decode(token) == b"data"


def check_ids(settings: Settings, **values: Any) -> list[tuple[str, str]]:
    settings.IDEMPOTENCY = {"RESPONSE_CODEC": FERNET, **values}
    return [(message.id or "", message.msg) for message in check_codec_settings()]


def test_working_keys_pass_the_checks(settings: Settings) -> None:
    assert check_ids(settings, ENCRYPTION_KEYS=[NEW_KEY, OLD_KEY]) == []


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ((), "ENCRYPTION_KEYS is empty"),
        (NEW_KEY, "must be a list of Fernet keys"),
        ([NEW_KEY, NEW_KEY[:-4]], "ENCRYPTION_KEYS[1] is not a Fernet key"),
        ([42], "ENCRYPTION_KEYS[0] is a int, not a Fernet key"),
        ([NEW_KEY, [NEW_KEY]], "ENCRYPTION_KEYS[1] is a list, not a Fernet key"),
    ],
)
def test_check_e022_missing_or_invalid_keys_named_by_position_never_shown(
    settings: Settings, keys: Any, message: str
) -> None:
    [(check_id, text)] = check_ids(settings, ENCRYPTION_KEYS=keys)
    assert check_id == "idempotency_django.E022"
    assert message in text
    assert NEW_KEY[:-4] not in text  # a secret, even a broken one, stays out of the output


def test_check_e021_cryptography_not_installed(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    codecs._multi_fernet.cache_clear()
    monkeypatch.setitem(sys.modules, "cryptography.fernet", None)  # import fails
    try:
        [(check_id, text)] = check_ids(settings, ENCRYPTION_KEYS=[NEW_KEY])
    finally:
        codecs._multi_fernet.cache_clear()
    assert check_id == "idempotency_django.E021"
    assert "idempotency-django[encryption]" in text


# --- through the DRF mixin ---------------------------------------------------------------------


def drf_post(client: APIClient, body: Any) -> Any:
    return client.post(
        "/api/charges/",
        data=json.dumps(body),
        content_type="application/json",
        headers={"Idempotency-Key": "drf-1"},
    )


def test_the_drf_mixin_replays_encrypted_responses_and_their_hook(
    alice: User, settings: Settings
) -> None:
    encrypt_with(settings, NEW_KEY)
    settings.IDEMPOTENCY = {
        **settings.IDEMPOTENCY,
        "REPLAY_HOOK": lambda response, stored: response.headers.setdefault("X-Hooked", "1"),
    }
    client = APIClient()
    client.force_authenticate(alice)

    first = drf_post(client, {"amount": 5})
    replayed = drf_post(client, {"amount": 5})

    assert first["Location"].encode() not in token_of("/api/charges/")
    assert (replayed.status_code, replayed.content) == (201, first.content)
    assert replayed["Location"] == first["Location"]
    assert replayed["X-Hooked"] == "1"
    assert effects("drf") == 1

    encrypt_with(settings, OTHER_KEY)
    unreadable = drf_post(client, {"amount": 5})

    assert unreadable.status_code == 409
    assert json.loads(unreadable.content)["type"].endswith(":response-unreadable")
    assert effects("drf") == 1


# --- resealing: rotation done at once ---------------------------------------------------------


@pytest.mark.database_store(
    "the reseal command rewrites database rows (records in Redis are not resealed)"
)
def test_reseal_moves_old_records_to_the_new_key_so_the_old_one_can_go(
    post: Post, settings: Settings
) -> None:
    first = post("/effect/", {"n": 0}, key="plain")  # stored before encryption
    encrypt_with(settings, OLD_KEY)
    second = post("/effect/", {"n": 1}, key="old")
    encrypt_with(settings, OLD_KEY)
    codec_of_another_time = FernetCodec([OTHER_KEY])
    lost = completed_record("lost", codec_of_another_time.encode(b"[]\nsecret"))
    not_stored = completed_record("unstorable", UNSTORABLE)

    encrypt_with(settings, NEW_KEY, OLD_KEY)
    out, err = StringIO(), StringIO()
    call_command("reseal_idempotency_responses", "--batch-size", "1", stdout=out, stderr=err)

    assert out.getvalue() == (
        "Resealed 2 stored responses; 1 could not be opened with the configured keys (left as "
        "they are); 1 completed without a stored response (streamed or over "
        "MAX_RESPONSE_BYTES: nothing to seal).\n"
    )
    assert "restore the key" in err.getvalue()
    for key in ("plain", "old"):
        body = bytes(records.get(key=key).response_body)
        assert body.startswith(SEALED)
        Fernet(NEW_KEY).decrypt(body[len(SEALED) :])  # under the new key now
    assert bytes(records.get(pk=lost.pk).response_body) == bytes(lost.response_body)
    assert bytes(records.get(pk=not_stored.pk).response_body) == UNSTORABLE

    encrypt_with(settings, NEW_KEY)  # the old key dropped at once
    for key, response, body in (("plain", first, {"n": 0}), ("old", second, {"n": 1})):
        replayed = post("/effect/", body, key=key)
        assert (replayed.status_code, replayed.content) == (201, response.content)
        assert replayed["Location"] == response["Location"]
    assert effects() == 2


def completed_record(key: str, sealed_token: bytes) -> IdempotencyRecord:
    """A record sealed as before frames were bound to their record (or not stored)."""
    body = sealed_token if sealed_token == UNSTORABLE else SEALED_UNBOUND + sealed_token
    return IdempotencyRecordFactory(
        key=key,
        state=IdempotencyRecord.State.COMPLETED,
        lease_expires_at=None,
        response_status=201,
        response_body=body,
        response_headers=[],
    )


def test_reseal_without_a_codec_is_refused(settings: Settings) -> None:
    settings.IDEMPOTENCY = {}
    with pytest.raises(CommandError, match="RESPONSE_CODEC is not set"):
        call_command("reseal_idempotency_responses")


@pytest.mark.parametrize(
    "args", [["--database", "nope"], ["--batch-size", "0"], ["--batch-size", "x"]]
)
def test_reseal_bad_options_exit_2(settings: Settings, args: list[str]) -> None:
    encrypt_with(settings, NEW_KEY)
    with pytest.raises(CommandError) as error:
        call_command("reseal_idempotency_responses", *args)
    assert error.value.returncode == 2


def test_reseal_leaves_a_record_deleted_or_claimed_again_since_it_was_listed(
    settings: Settings,
) -> None:
    encrypt_with(settings, NEW_KEY)
    record = completed_record("k", FernetCodec([NEW_KEY]).encode(b"[]\nbody"))
    records = IdempotencyRecord.objects.all()

    assert codecs.reseal_one(records, record.pk, "another claim's token", FernetCodec()) == "gone"
    assert codecs.reseal_one(records, record.pk + 1, record.token, FernetCodec()) == "gone"
    assert bytes(records.get().response_body) == bytes(record.response_body)
    assert codecs.reseal_one(records, record.pk, record.token, FernetCodec()) == "resealed"


@pytest.mark.database_store(
    "the reseal command rewrites database rows (records in Redis are not resealed)"
)
def test_reseal_with_everything_readable_writes_no_warning(post: Post, settings: Settings) -> None:
    encrypt_with(settings, NEW_KEY)
    post("/effect/", {"n": 1})
    out, err = StringIO(), StringIO()

    call_command("reseal_idempotency_responses", stdout=out, stderr=err)

    assert out.getvalue() == (
        "Resealed 1 stored responses; 0 could not be opened with the configured keys "
        "(left as they are).\n"
    )  # nothing about records without a stored response: there were none
    assert err.getvalue() == ""


def test_reseal_bad_options_on_the_command_line_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        ManagementUtility(
            ["manage.py", "reseal_idempotency_responses", "--batch-size", "0"]
        ).execute()
    assert exited.value.code == 2
    assert "must be a positive integer" in capsys.readouterr().err


def test_a_task_result_no_key_opens_is_refused_as_such_and_never_reruns(
    settings: Settings,
) -> None:
    encrypt_with(settings, OLD_KEY)
    runs = []
    with claim_once("shop", "order-8", name="charge-card") as run:
        runs.append(1)
        run.result = {"ok": True}
    encrypt_with(settings, NEW_KEY)  # the old key dropped

    with (
        pytest.raises(TaskResultNotStored) as refused,
        claim_once("shop", "order-8", name="charge-card"),
    ):
        runs.append(1)

    assert runs == [1]
    assert "MAX_RESPONSE_BYTES" not in str(refused.value)
    assert "cannot be read back" in str(refused.value)


# --- sealed responses are bound to their record -----------------------------------------------


def body_of(**lookup: Any) -> bytes:
    return bytes(records.get(**lookup).response_body)


def unbind(body: bytes, key: str = NEW_KEY) -> bytes:
    """The same response as it was sealed before frames were bound to their record."""
    assert body.startswith(SEALED)
    binding, frame = Fernet(key).decrypt(body[len(SEALED) :]).split(b"\n", 1)
    assert re.fullmatch(rb"[0-9a-f]{64}", binding)
    return SEALED_UNBOUND + Fernet(key).encrypt(frame)


def assert_refused_as_unreadable(response: Any) -> None:
    assert response.status_code == 409
    assert response["Content-Type"] == "application/problem+json"
    assert "Idempotent-Replayed" not in response
    assert json.loads(response.content)["type"] == PROBLEM + "response-unreadable"


@pytest.mark.parametrize(
    ("victim", "thief"),
    [
        # another account, same endpoint and key: the swap the binding exists for
        ({"path": "/effect/", "user": "alice", "key": "k1"}, {"user": "bob"}),
        ({"path": "/effect/", "user": "alice", "key": "k1"}, {"key": "k2"}),
        pytest.param(
            {"path": "/effect/", "user": "alice", "key": "k1"},
            {"path": "/atomic/"},
            marks=pytest.mark.database_store("the other endpoint is in atomic mode"),
        ),
    ],
    ids=["account", "key", "endpoint"],
)
def test_a_sealed_response_copied_into_another_record_is_refused_never_replayed(
    post: Post,
    settings: Settings,
    bob: User,
    victim: dict[str, str],
    thief: dict[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A row-level swap (one record's sealed body copied into another's) is refused like
    an unreadable response: a 409, no rerun, nothing of the first account's response."""
    encrypt_with(settings, NEW_KEY)
    theirs = {**victim, **thief}
    first = post(victim["path"], {"card": CARD}, user=victim["user"], key=victim["key"])
    own = post(theirs["path"], {"n": 1}, user=theirs["user"], key=theirs["key"])
    assert first.status_code == own.status_code == 201
    robbed = records.get(
        account=str(User.objects.get(username=victim["user"]).pk),
        endpoint=f"POST {victim['path']}",
        key=victim["key"],
    )
    others = [r for r in records.all() if r.pk != robbed.pk]
    assert others
    for other in others:
        records.update({"pk": other.pk}, response_body=robbed.response_body)

    with caplog.at_level(logging.ERROR, logger="idempotency_django"):
        swapped = post(theirs["path"], {"n": 1}, user=theirs["user"], key=theirs["key"])

    assert_refused_as_unreadable(swapped)
    assert b"4242" not in swapped.content
    assert any("sealed for another record" in r.getMessage() for r in caplog.records)
    replayed = post(victim["path"], {"card": CARD}, user=victim["user"], key=victim["key"])
    assert (replayed.status_code, replayed.content) == (201, first.content)
    assert effects() == 2


def test_a_sealed_response_whose_status_was_altered_is_refused(
    post: Post, settings: Settings
) -> None:
    encrypt_with(settings, NEW_KEY)
    assert post("/effect/", {"status": 402}).status_code == 402
    records.update(response_status=201)

    assert_refused_as_unreadable(post("/effect/", {"status": 402}))
    assert effects() == 1


def test_a_response_sealed_before_binding_still_replays(post: Post, settings: Settings) -> None:
    encrypt_with(settings, NEW_KEY)
    first = post("/effect/", {"card": CARD})
    records.update(response_body=unbind(body_of()))

    replayed = post("/effect/", {"card": CARD})

    assert (replayed.status_code, replayed.content) == (201, first.content)
    assert replayed["Location"] == first["Location"]
    assert replayed["Idempotent-Replayed"] == "true"
    assert effects() == 1


@pytest.mark.database_store(
    "the reseal command rewrites database rows (records in Redis are not resealed)"
)
def test_reseal_binds_responses_sealed_before_binding_so_a_swap_is_refused(
    post: Post, settings: Settings, bob: User
) -> None:
    encrypt_with(settings, NEW_KEY)
    first = post("/effect/", {"card": CARD}, user="alice")
    post("/effect/", {"n": 1}, user="bob")
    for record in IdempotencyRecord.objects.all():
        record.response_body = unbind(bytes(record.response_body))
        record.save(update_fields=["response_body"])
    alices = str(User.objects.get(username="alice").pk)

    out = StringIO()
    call_command("reseal_idempotency_responses", stdout=out)

    assert "Resealed 2 stored responses; 0 could not be opened" in out.getvalue()
    assert all(bytes(r.response_body).startswith(SEALED) for r in IdempotencyRecord.objects.all())
    IdempotencyRecord.objects.filter(account=str(bob.pk)).update(
        response_body=body_of(account=alices)
    )
    assert_refused_as_unreadable(post("/effect/", {"n": 1}, user="bob"))
    replayed = post("/effect/", {"card": CARD}, user="alice")
    assert (replayed.status_code, replayed.content) == (201, first.content)
    assert effects() == 2


@pytest.mark.database_store(
    "the reseal command rewrites database rows (records in Redis are not resealed)"
)
def test_reseal_leaves_a_response_bound_to_another_record_as_it_is(
    post: Post, settings: Settings, bob: User
) -> None:
    encrypt_with(settings, NEW_KEY)
    post("/effect/", {"card": CARD}, user="alice")
    post("/effect/", {"n": 1}, user="bob")
    stolen = body_of(account=str(User.objects.get(username="alice").pk))
    IdempotencyRecord.objects.filter(account=str(bob.pk)).update(response_body=stolen)

    out = StringIO()
    call_command("reseal_idempotency_responses", stdout=out, stderr=StringIO())

    assert "Resealed 1 stored responses; 1 could not be opened" in out.getvalue()
    assert body_of(account=str(bob.pk)) == stolen


# --- REQUIRE_BOUND_RESPONSES: once resealed, unbound responses are refused ---------------------


def require_bound(settings: Settings, *keys: str) -> None:
    settings.IDEMPOTENCY = {
        "RESPONSE_CODEC": FERNET,
        "ENCRYPTION_KEYS": list(keys),
        "REQUIRE_BOUND_RESPONSES": True,
    }


@pytest.mark.parametrize("stored", ["in-clear", "sealed-unbound"])
def test_under_require_bound_responses_an_unbound_response_is_refused_never_rerun(
    post: Post, settings: Settings, caplog: pytest.LogCaptureFixture, stored: str
) -> None:
    """A response stored in clear (before the codec) or sealed before binding proves no
    record: it may have been copied from another account's row. Refused like an unreadable
    one: a 409 problem, nothing of the body, and the view does not run again."""
    if stored == "in-clear":
        first = post("/effect/", {"card": CARD})
    else:
        encrypt_with(settings, NEW_KEY)
        first = post("/effect/", {"card": CARD})
        records.update(response_body=unbind(body_of()))
    assert first.status_code == 201
    require_bound(settings, NEW_KEY)

    with caplog.at_level(logging.ERROR, logger="idempotency_django"):
        refused = post("/effect/", {"card": CARD})

    assert_refused_as_unreadable(refused)
    assert b"4242" not in refused.content
    assert any("bound to no record" in r.getMessage() for r in caplog.records)
    assert effects() == 1


def test_under_require_bound_responses_a_bound_response_replays(
    post: Post, settings: Settings
) -> None:
    require_bound(settings, NEW_KEY)
    first = post("/effect/", {"card": CARD})

    replayed = post("/effect/", {"card": CARD})

    assert (replayed.status_code, replayed.content) == (201, first.content)
    assert replayed["Idempotent-Replayed"] == "true"
    assert effects() == 1


def test_require_bound_responses_without_a_codec_changes_nothing_and_is_warned(
    post: Post, settings: Settings
) -> None:
    settings.IDEMPOTENCY = {"REQUIRE_BOUND_RESPONSES": True}
    first = post("/effect/", {"n": 1})

    replayed = post("/effect/", {"n": 1})

    assert (replayed.status_code, replayed.content) == (201, first.content)
    assert [m.id for m in check_codec_settings()] == ["idempotency_django.W021"]


@pytest.mark.database_store(
    "the reseal command rewrites database rows (records in Redis are not resealed)"
)
def test_reseal_then_require_bound_responses_every_old_record_still_replays(
    post: Post, settings: Settings, bob: User
) -> None:
    """The documented order: reseal (binding each old response to its own record), then
    turn the setting on. Nothing replayable is lost on the way, for any account."""
    in_clear = post("/effect/", {"n": 0}, key="plain")
    encrypt_with(settings, NEW_KEY)
    sealed_first = post("/effect/", {"n": 1}, key="old", user="bob")
    records.update({"key": "old"}, response_body=unbind(body_of(key="old")))
    bound = post("/effect/", {"n": 2}, key="new")

    out = StringIO()
    call_command("reseal_idempotency_responses", "--batch-size", "2", stdout=out)
    require_bound(settings, NEW_KEY)

    assert "Resealed 3 stored responses; 0 could not be opened" in out.getvalue()
    for key, user, body, first in (
        ("plain", "alice", {"n": 0}, in_clear),
        ("old", "bob", {"n": 1}, sealed_first),
        ("new", "alice", {"n": 2}, bound),
    ):
        replayed = post("/effect/", body, key=key, user=user)
        assert (replayed.status_code, replayed.content) == (201, first.content), key
    assert effects() == 3


@pytest.mark.database_store(
    "the reseal command rewrites database rows (records in Redis are not resealed)"
)
def test_reseal_binds_each_response_only_to_the_record_it_was_read_from(
    post: Post, settings: Settings, bob: User
) -> None:
    """Several accounts, keys and batches: after the reseal, each record's response opens
    in its own record only. Swapped after it, any two are refused."""
    encrypt_with(settings, NEW_KEY)
    sent = [
        (user, key, {"n": n}, post("/effect/", {"n": n}, key=key, user=user))
        for n, (user, key) in enumerate(
            [("alice", "k1"), ("bob", "k1"), ("alice", "k2"), ("bob", "k3"), ("alice", "k4")]
        )
    ]
    for record in IdempotencyRecord.objects.all():
        record.response_body = unbind(bytes(record.response_body))
        record.save(update_fields=["response_body"])

    call_command("reseal_idempotency_responses", "--batch-size", "2", stdout=StringIO())
    require_bound(settings, NEW_KEY)

    for user, key, body, first in sent:
        replayed = post("/effect/", body, key=key, user=user)
        assert (replayed.status_code, replayed.content) == (201, first.content), (user, key)
    alices_k1 = IdempotencyRecord.objects.get(
        account=str(User.objects.get(username="alice").pk), key="k1"
    )
    IdempotencyRecord.objects.filter(account=str(bob.pk), key="k1").update(
        response_body=alices_k1.response_body
    )
    assert_refused_as_unreadable(post("/effect/", {"n": 1}, key="k1", user="bob"))
    assert effects() == 5


@pytest.mark.database_store(
    "the reseal command rewrites database rows (records in Redis are not resealed)"
)
def test_under_require_bound_responses_reseal_never_binds_an_unbound_response(
    post: Post, settings: Settings, bob: User
) -> None:
    """Once the setting is on, the app writes nothing unbound: an unbound response found
    then came from somewhere else (alice's, copied into bob's record as it was sealed
    before binding). A later reseal (a key rotation) leaves it unbound, and refused,
    rather than bind it to the record it was copied into."""
    require_bound(settings, NEW_KEY)
    post("/effect/", {"card": CARD}, user="alice")
    post("/effect/", {"n": 1}, user="bob")
    alices = str(User.objects.get(username="alice").pk)
    IdempotencyRecord.objects.filter(account=str(bob.pk)).update(
        response_body=unbind(body_of(account=alices))
    )
    require_bound(settings, OTHER_KEY, NEW_KEY)  # a rotation, then its reseal

    out = StringIO()
    call_command("reseal_idempotency_responses", stdout=out)

    assert out.getvalue() == (
        "Resealed 1 stored responses; 0 could not be opened with the configured keys (left as "
        "they are); 1 bound to no record, left as they are (REQUIRE_BOUND_RESPONSES is on: "
        "they are refused on replay).\n"
    )
    stolen = body_of(account=str(bob.pk))
    assert stolen.startswith(SEALED_UNBOUND)
    refused = post("/effect/", {"n": 1}, user="bob")
    assert_refused_as_unreadable(refused)
    assert b"4242" not in refused.content
    assert post("/effect/", {"card": CARD}, user="alice")["Idempotent-Replayed"] == "true"
    assert effects() == 2


@pytest.mark.parametrize("value", ["no", 0, None])
def test_require_bound_responses_that_is_not_a_bool_counts_as_on(
    post: Post, settings: Settings, value: object
) -> None:
    """E014 reports it; until then it refuses unbound responses (the safe side)."""
    first = post("/effect/", {"n": 1})
    settings.IDEMPOTENCY = {
        "RESPONSE_CODEC": FERNET,
        "ENCRYPTION_KEYS": [NEW_KEY],
        "REQUIRE_BOUND_RESPONSES": value,
    }

    assert first.status_code == 201
    assert_refused_as_unreadable(post("/effect/", {"n": 1}))
