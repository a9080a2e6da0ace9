"""Never two executions for one key, never a 2xx for work that did not commit (docs/guarantees.md).

Each test is one scenario from an independent review: what a client would see (status,
headers, the replay) and how many side effects were really performed. Connection kills are
real on PostgreSQL and MariaDB (the server closes the connection); SQLite has no server, so
there the store raises the error a lost connection raises.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.db import OperationalError, connection, connections
from django.test import Client
from django.utils import timezone

from idempotency_django.core import claims, shell
from idempotency_django.decorators import idempotent
from idempotency_django.exceptions import InFlight, KeyMismatch
from idempotency_django.models import IdempotencyRecord
from idempotency_django.purge import purge_records
from idempotency_django.responses import StoredResponse
from idempotency_django.store.base import Write
from tests import records
from tests.conftest import Post, effects
from tests.project.views import gate, terminate_backend

pytestmark = pytest.mark.django_db(transaction=True)

State = IdempotencyRecord.State
TABLE = IdempotencyRecord._meta.db_table


def problem(response: Any) -> dict[str, Any]:
    assert response["Content-Type"] == "application/problem+json"
    return json.loads(response.content)  # type: ignore[no-any-return]


def is_completion(sql: str, params: Any) -> bool:
    return (
        sql.lstrip().upper().startswith("UPDATE") and TABLE in sql and "completed" in (params or ())
    )


@contextmanager
def connection_killed_before(matches: Callable[[str, Any], bool]) -> Iterator[list[str]]:
    """Kill the store's connection just before it runs the first statement ``matches``
    accepts: the statement then fails as on a real server crash or failover."""
    killed: list[str] = []

    def kill_first(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
        if not killed and matches(sql, params):
            killed.append(sql)
            if connection.vendor == "sqlite":
                raise OperationalError("server closed the connection unexpectedly")
            terminate_backend()
        return execute(sql, params, many, context)

    with connection.execute_wrapper(kill_first):
        yield killed


@pytest.fixture
def atomic_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(connections["default"].settings_dict, "ATOMIC_REQUESTS", True)


# --- 1. a completion that fails inside a transaction ----------------------------------------


@pytest.mark.database_store("atomic mode")
@pytest.mark.parametrize("path", ["/atomic/", "/api/atomic-charge/"])
def test_atomic_mode_completion_lost_with_the_connection_is_a_503_not_a_201(
    alice: User, post: Post, path: str
) -> None:
    with connection_killed_before(is_completion) as killed:
        response = post(path, {"amount": 1})

    assert killed
    assert response.status_code == 503
    assert response["Retry-After"] == "1"
    assert problem(response)["type"].endswith("store-unavailable")
    assert effects() == 0  # the work rolled back with the completion
    assert not records.exists()

    retry = post(path, {"amount": 1})
    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry
    assert effects() == 1


@pytest.mark.database_store("atomic mode / ATOMIC_REQUESTS")
def test_atomic_requests_completion_lost_is_a_503_and_the_retry_runs_once(
    alice: User, post: Post, atomic_requests: None
) -> None:
    with connection_killed_before(is_completion) as killed:
        response = post("/effect/", {"amount": 1})

    assert killed
    assert response.status_code == 503
    assert response["Retry-After"] == "1"
    assert effects() == 0  # ATOMIC_REQUESTS rolled the view's work back
    # The rollback is certain (the COMMIT was never sent): the key is released, so the
    # retry runs at once instead of waiting for a lease that nobody renews.
    assert not records.exists()

    retry = post("/effect/", {"amount": 1})
    again = post("/effect/", {"amount": 1})
    assert retry.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert effects() == 1


@pytest.mark.database_store("kills the database connection before the completion's SQL")
def test_a_completion_that_fails_without_a_transaction_still_sends_the_committed_work(
    alice: User, post: Post
) -> None:
    """Commit mode, no request transaction: the work committed before the completion, so
    its 201 is the truth, and the completion is stored on a new connection (one reconnect)."""
    with connection_killed_before(is_completion) as killed:
        response = post("/effect/", {"amount": 1})

    assert killed
    assert response.status_code == 201
    assert effects() == 1
    assert post("/effect/", {"amount": 1})["Idempotent-Replayed"] == "true"


# --- 2. a TTL shorter than a running request --------------------------------------------------


def options(**overrides: Any) -> claims.ClaimPolicy:
    values: dict[str, Any] = {
        "alias": "default",
        "lease": 10,
        "ttl": 1,
        "in_flight": "conflict",
        "wait_seconds": 0,
        "retry_after": 1,
    }
    return claims.ClaimPolicy(**{**values, **overrides})


SCOPE = claims.Scope("1", "POST /charges/", "long-running")
FINGERPRINT = "2:" + "a" * 64
OTHER = "2:" + "b" * 64


def claim_past_its_ttl() -> claims.Claim:
    claim = shell.claim_or_replay(SCOPE, FINGERPRINT, options())
    assert isinstance(claim, claims.Claim)
    # The TTL has passed; the lease is live (the heartbeat renews it while the view runs).
    records.update(expires_at=timezone.now() - timedelta(seconds=30))
    return claim


def test_a_live_lease_is_never_taken_over_whatever_the_ttl() -> None:
    claim_past_its_ttl()

    with pytest.raises(InFlight):
        shell.claim_or_replay(SCOPE, FINGERPRINT, options())
    with pytest.raises(KeyMismatch):
        shell.claim_or_replay(SCOPE, OTHER, options())
    assert records.get().token is not None


def test_the_purge_agrees_with_the_engine_on_a_live_lease() -> None:
    claim_past_its_ttl()

    assert purge_records().total == 0
    assert records.count() == 1


def test_after_the_lease_lapses_an_expired_claim_counts_as_absent() -> None:
    claim_past_its_ttl()
    records.update(lease_expires_at=timezone.now() - timedelta(seconds=1))

    taken = shell.claim_or_replay(SCOPE, OTHER, options())
    assert isinstance(taken, claims.Claim)


def test_a_late_release_never_deletes_a_completed_record() -> None:
    """A release is fenced by the claim's token and by the state: one that arrives after
    the completion (resent after its first reply was lost, or from any other path) leaves
    the outcome, and the key still replays it instead of running again. Every store."""
    claim = shell.claim_or_replay(SCOPE, FINGERPRINT, options(ttl=3600))
    assert isinstance(claim, claims.Claim)
    assert shell.complete(claim, StoredResponse(201, b'{"id": 1}', []))

    shell.release(claim)
    again = shell.claim_or_replay(SCOPE, FINGERPRINT, options(ttl=3600))

    assert isinstance(again, StoredResponse)
    assert (again.status, again.body) == (201, b'{"id": 1}')
    assert records.get().state == IdempotencyRecord.State.COMPLETED


def test_a_view_running_past_its_ttl_keeps_its_key(alice: User, post: Post, settings: Any) -> None:
    settings.IDEMPOTENCY = {"TTL_SECONDS": 120}
    first: list[Any] = []
    thread = threading.Thread(
        target=lambda: first.append(send({"amount": 1, "gate": True})), daemon=True
    )
    thread.start()
    assert gate.entered.wait(10)
    # 150 s into a 120 s TTL: expires_at is behind us, the lease is live.
    records.update(expires_at=timezone.now() - timedelta(seconds=30))

    retry = post("/effect/", {"amount": 1, "gate": True})
    gate.release.set()
    thread.join(10)

    assert retry.status_code == 409
    assert first[0].status_code == 201
    assert effects() == 1


def send(body: dict[str, Any]) -> Any:
    try:
        return Client().post(
            "/effect/",
            data=json.dumps(body),
            content_type="application/json",
            headers={"Idempotency-Key": "k1", "X-User": "alice"},
        )
    finally:
        connections.close_all()


def test_the_ttl_counts_from_completion(alice: User, post: Post, settings: Any) -> None:
    settings.IDEMPOTENCY = {"TTL_SECONDS": 120}
    post("/effect/", {"amount": 1})

    record = records.get()
    assert records.lasts(record.expires_at, record.completed_at, 120)


def test_no_ttl_without_time_zones_stores_a_naive_forever(
    alice: User, post: Post, settings: Any
) -> None:
    settings.USE_TZ = False
    settings.IDEMPOTENCY = {"TTL_SECONDS": None}

    first = post("/effect/", {"amount": 1})
    retry = post("/effect/", {"amount": 1})

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert effects() == 1


# --- 3. fail-open never turns contention into a second execution -------------------------------


@pytest.mark.concurrency
@pytest.mark.database_store("a row lock held by an uncommitted claim (atomic mode)")
def test_a_lock_timeout_on_a_duplicate_is_a_409_even_when_failing_open(
    alice: User, post: Post, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.IDEMPOTENCY = {"ON_STORE_ERROR": "open"}
    options_dict = connections["default"].settings_dict.setdefault("OPTIONS", {})
    if connection.vendor == "postgresql":
        monkeypatch.setitem(options_dict, "options", "-c lock_timeout=300")
    else:
        monkeypatch.setitem(
            options_dict, "init_command", "SET SESSION innodb_lock_wait_timeout = 1"
        )
    connections.close_all()  # the next connections take the option
    first: list[Any] = []

    def hold_the_key() -> None:
        try:
            first.append(
                Client().post(
                    "/atomic/",
                    data=json.dumps({"amount": 1, "gate": True}),
                    content_type="application/json",
                    headers={"Idempotency-Key": "k1", "X-User": "alice"},
                )
            )
        finally:
            connections.close_all()

    thread = threading.Thread(target=hold_the_key, daemon=True)
    thread.start()
    assert gate.entered.wait(10)  # its claim is uncommitted: a duplicate waits on its row

    duplicate = post("/atomic/", {"amount": 1, "gate": True})
    gate.release.set()
    thread.join(10)

    assert duplicate.status_code == 409
    assert duplicate["Retry-After"] == "1"
    assert first[0].status_code == 201
    assert effects("atomic") == 1


# --- 4. the DRF mixin under ATOMIC_REQUESTS ---------------------------------------------------


def test_drf_under_atomic_requests_stores_a_validation_error_without_warnings(
    alice: User, post: Post, atomic_requests: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="idempotency_django"):
        invalid = post("/api/writes-then-fails/", {"amount": 0})
        retry = post("/api/writes-then-fails/", {"amount": 0})

    assert invalid.status_code == 400
    assert retry.status_code == 400
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == invalid.content
    assert effects("drf-partial") == 0  # the write before the error rolled back
    assert [r.getMessage() for r in caplog.records if r.name == "idempotency_django"] == []
    assert records.get().response_status == 400


def test_drf_under_atomic_requests_commits_the_work_with_its_completion(
    alice: User, post: Post, atomic_requests: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="idempotency_django"):
        first = post("/api/writes-then-fails/", {"amount": 5})
        retry = post("/api/writes-then-fails/", {"amount": 5})

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert effects("drf-partial") == 2  # one execution, two rows
    assert [r.getMessage() for r in caplog.records if r.name == "idempotency_django"] == []


def test_drf_under_atomic_requests_a_crash_rolls_back_and_releases(
    alice: User, post: Post, atomic_requests: None, client: Client
) -> None:
    client.raise_request_exception = False
    crashed = post("/api/charges/", {"amount": 1, "crash": True})

    assert crashed.status_code == 500
    assert effects("drf") == 0
    assert not records.exists()


def test_drf_mixin_gives_its_view_the_request_transaction_back(
    alice: User, post: Post, atomic_requests: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DRF view still runs inside a transaction (the mixin opted it out only so that
    the claim could commit first)."""
    from tests.project.atomicity_views import WritesThenFailsView

    seen: list[bool] = []
    original = WritesThenFailsView.post

    def spy(self: Any, request: Any) -> Any:
        seen.append(connection.in_atomic_block)
        return original(self, request)

    monkeypatch.setattr(WritesThenFailsView, "post", spy)
    post("/api/writes-then-fails/", {"amount": 1})

    assert seen == [True]


# --- 7 and 8. arguments and placement are checked when the code is loaded ----------------------


@pytest.mark.parametrize(
    "arguments",
    [
        {"lease_seconds": -1},
        {"lease_seconds": 0.5},
        {"ttl_seconds": -5},
        {"wait_seconds": float("inf")},
        {"max_run_seconds": "long"},
        {"mode": "fast"},
        {"in_flight": "queue"},
        {"on_store_error": "ignore"},
        {"on_disconnect": "abandon"},
        {"required": "yes"},
        {"methods": "POST"},
        {"store_statuses": 42},
    ],
)
def test_idempotent_validates_every_argument_naming_the_view(arguments: dict[str, Any]) -> None:
    def charge(request: Any) -> Any: ...

    with pytest.raises(ImproperlyConfigured, match="charge"):
        idempotent(**arguments)(charge)


def test_drf_class_attributes_are_validated_at_class_creation() -> None:
    from rest_framework.views import APIView

    from idempotency_django.drf import IdempotentMixin

    with pytest.raises(ImproperlyConfigured, match=r"Refunds.*lease_seconds"):

        class Refunds(IdempotentMixin, APIView):
            idempotency_lease_seconds = -1


def test_task_arguments_are_validated_at_declaration() -> None:
    from idempotency_django.tasks import idempotent_task

    with pytest.raises(ImproperlyConfigured, match=r"send_receipt.*lease_seconds"):

        @idempotent_task(scope="receipts", key="message_id", lease_seconds=-1)
        def send_receipt(message_id: str) -> None: ...


def test_the_mixin_after_the_drf_view_is_refused_at_class_creation() -> None:
    from rest_framework import viewsets

    from idempotency_django.drf import IdempotentMixin

    with pytest.raises(ImproperlyConfigured, match="IdempotentMixin must come before"):

        class Charges(viewsets.ModelViewSet, IdempotentMixin):  # type: ignore[type-arg]
            pass


def test_idempotent_on_a_method_is_refused_at_decoration() -> None:
    with pytest.raises(ImproperlyConfigured, match="method_decorator"):

        class Charges:
            @idempotent
            def post(self, request: Any) -> Any: ...


def test_method_decorator_on_a_drf_action_says_to_use_the_mixin(alice: User, post: Post) -> None:
    from django.utils.decorators import method_decorator
    from rest_framework.response import Response
    from rest_framework.views import APIView

    class Charges(APIView):
        @method_decorator(idempotent)
        def post(self, request: Any) -> Any:
            return Response(status=201)

    from django.test import RequestFactory

    view = Charges.as_view()
    raw = RequestFactory().post(
        "/charges/", data="{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY="k1"
    )
    raw.user = alice
    raw._dont_enforce_csrf_checks = True  # type: ignore[attr-defined]
    with pytest.raises(ImproperlyConfigured, match="IdempotentMixin"):
        view(raw)


# --- 11. the claim tells a duplicate from any other insert error ------------------------------


def test_an_insert_error_other_than_a_duplicate_is_not_a_409() -> None:
    from django.db import DatabaseError

    from idempotency_django.store import store

    if connection.vendor == "sqlite":
        pytest.skip("SQLite does not enforce column lengths")
    values = Write(
        SCOPE,
        "t" * 32,
        "x" * 500,  # longer than the column: strict mode refuses it
        timezone.now(),
        timedelta(0),
        timedelta(seconds=60),
    )
    with pytest.raises(DatabaseError):
        store.claim(values)


# --- what the lifecycle does when the work's own transaction is rolled back or unknown -------


@pytest.mark.database_store("atomic mode / ATOMIC_REQUESTS")
def test_drf_atomic_mode_under_atomic_requests_stores_its_validation_error(
    alice: User, post: Post, atomic_requests: None
) -> None:
    """DRF asks for the transaction (claim included) to be rolled back when it answers an
    exception; the definitive 400 is stored all the same, by a new claim."""
    invalid = post("/api/atomic-charge/", {"amount": 0})
    retry = post("/api/atomic-charge/", {"amount": 0})

    assert invalid.status_code == 400
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == invalid.content
    assert effects("drf-atomic") == 0
    assert records.get().response_status == 400


@contextmanager
def connection_killed_at_commit(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Kill the connection just before Django sends COMMIT: the client cannot know whether
    the transaction committed, as when a server crashes during the commit."""
    killed: list[bool] = []
    wrapper_class = type(connections["default"])
    original = wrapper_class._commit

    def commit_after_a_kill(self: Any) -> None:
        if not killed and self.alias == "default":
            killed.append(True)
            if self.vendor == "sqlite":
                raise OperationalError("server closed the connection unexpectedly")
            terminate_backend()
        original(self)

    monkeypatch.setattr(wrapper_class, "_commit", commit_after_a_kill)
    yield killed


def test_a_commit_whose_outcome_is_unknown_is_a_503_and_keeps_the_key(
    alice: User, post: Post, atomic_requests: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with connection_killed_at_commit(monkeypatch) as killed:
        response = post("/effect/", {"amount": 1})
    monkeypatch.undo()
    monkeypatch.setitem(connections["default"].settings_dict, "ATOMIC_REQUESTS", True)

    assert killed
    assert response.status_code == 503
    assert response["Retry-After"] == "1"
    assert effects() == 0
    # Did it commit? The app cannot know: the key stays claimed until its lease lapses
    # (the same rule as a worker that died), so a retry is refused for now, not run twice.
    assert records.get().state == State.IN_PROGRESS
    assert post("/effect/", {"amount": 1}).status_code == 409
    assert effects() == 0


@pytest.mark.database_store("loses the database COMMIT's answer")
def test_a_commit_whose_answer_is_lost_is_a_503_and_the_retry_gets_the_replay(
    alice: User, post: Post, atomic_requests: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other unknown outcome: the COMMIT of the work and its completion went through,
    and the connection broke before its answer came back. Still a 503 (the app cannot know),
    and the key is kept: the retry gets the committed outcome instead of doing it again."""
    lost: list[bool] = []
    wrapper_class = type(connections["default"])
    original = wrapper_class._commit

    def commit_then_lose_the_answer(self: Any) -> None:
        original(self)
        if not lost and self.alias == "default":
            lost.append(True)
            raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(wrapper_class, "_commit", commit_then_lose_the_answer)
    response = post("/effect/", {"amount": 1})
    monkeypatch.undo()

    assert lost
    assert response.status_code == 503
    assert problem(response)["type"].endswith("store-unavailable")
    retry = post("/effect/", {"amount": 1})
    assert retry.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert effects() == 1


def test_a_record_of_an_older_fingerprint_version_is_replayed(alice: User, post: Post) -> None:
    """A retry across an upgrade of the canonical form gets its replay, not a 422."""
    now = timezone.now()
    records.create(
        account=str(alice.pk),
        endpoint="POST /effect/",
        key="k1",
        fingerprint="0" * 64,  # version 1
        state=State.COMPLETED,
        token="a" * 32,
        response_status=201,
        response_headers=[["Content-Type", "application/json"]],
        response_body=b'{"effect": 41}',
        created_at=now,
        completed_at=now,
        expires_at=now + timedelta(days=1),
    )

    response = post("/effect/", {"amount": 1})

    assert response.status_code == 201
    assert response["Idempotent-Replayed"] == "true"
    assert response.content == b'{"effect": 41}'
    assert effects() == 0


@pytest.mark.concurrency
@pytest.mark.database_store("a row lock timeout on the claim's SQL")
def test_under_the_wait_policy_a_contended_claim_waits_then_replays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A duplicate whose insert times out on a lock waits (under ``wait``) and replays once
    the first attempt commits; it never runs unprotected."""
    options_dict = connections["default"].settings_dict.setdefault("OPTIONS", {})
    if connection.vendor == "postgresql":
        monkeypatch.setitem(options_dict, "options", "-c lock_timeout=200")
    else:
        monkeypatch.setitem(
            options_dict, "init_command", "SET SESSION innodb_lock_wait_timeout = 1"
        )
    connections.close_all()
    from django.db import transaction

    from idempotency_django.responses import StoredResponse

    holding, release = threading.Event(), threading.Event()

    def first_attempt() -> None:
        try:
            with transaction.atomic():
                claim = shell.claim_or_replay(SCOPE, FINGERPRINT, options())
                assert isinstance(claim, claims.Claim)
                holding.set()
                release.wait(10)
                assert shell.complete(claim, StoredResponse(201, b"first"))
        finally:
            connections.close_all()

    thread = threading.Thread(target=first_attempt, daemon=True)
    thread.start()
    assert holding.wait(10)
    contended = threading.Event()

    def let_go_after_the_first_timeout(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
        try:
            return execute(sql, params, many, context)
        except Exception:
            contended.set()
            release.set()
            raise

    with connection.execute_wrapper(let_go_after_the_first_timeout):
        outcome = shell.claim_or_replay(
            SCOPE, FINGERPRINT, options(in_flight="wait", wait_seconds=10)
        )
    thread.join(10)

    assert contended.is_set()
    assert outcome == StoredResponse(201, b"first", [])


def test_a_claim_retried_with_its_own_token_after_its_lease_lapsed_renews_it() -> None:
    """A reconnect slower than the lease must not hand out a claim under a lapsed lease,
    which a duplicate could take over at once (both would run)."""
    first = shell.claim_or_replay(SCOPE, FINGERPRINT, options(), token="t" * 32)
    assert isinstance(first, claims.Claim)
    records.update(lease_expires_at=timezone.now() - timedelta(seconds=1))

    again = shell.claim_or_replay(SCOPE, FINGERPRINT, options(), token="t" * 32)

    assert isinstance(again, claims.Claim)
    assert records.get().lease_expires_at > timezone.now()
    with pytest.raises(InFlight):
        shell.claim_or_replay(SCOPE, FINGERPRINT, options())
