"""The decision table (docs/guarantees.md) as pure functions: every row, without a database.

``decisions.decide`` answers what a request that lost its claim does about the record it
read; ``decisions.keep_waiting`` whether it waits for a duplicate in flight. Table-driven
cases name each row; Hypothesis checks the rules that hold over every record: only the
request's own live claim is resumed, a live lease is never taken over, and another
request's record is never replayed or taken over unless it expired. The rules around the
table are here too: what a store failure means, a duplicate's ``Retry-After``, the size
rule, the unknown outcome, which failed completion is sent again, and the race bound.
"""

from __future__ import annotations

import sqlite3
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone

import pytest
from django.db import (
    DatabaseError,
    DataError,
    IntegrityError,
    InterfaceError,
    NotSupportedError,
    OperationalError,
    ProgrammingError,
)
from hypothesis import given
from hypothesis import strategies as st

from idempotency_django.core.decisions import (
    IN_FLIGHT,
    MAX_RACES,
    MISMATCH,
    RACE,
    REPLAY,
    Decision,
    Resume,
    TakeOver,
    contended,
    decide,
    fits,
    in_flight_retry_after,
    keep_waiting,
    may_pass_on_retry,
    outcome_unknown,
    races_left,
    store_failure,
)
from idempotency_django.models import IdempotencyRecord
from idempotency_django.store.base import Snapshot

State = IdempotencyRecord.State
NOW = datetime(2026, 12, 5, 12, 0, tzinfo=dt_timezone.utc)
MINE, THEIRS = "token-mine", "token-theirs"
SAME, OTHER = "fingerprint-same", "fingerprint-other"


def record(
    *,
    state: str = State.IN_PROGRESS,
    token: str = THEIRS,
    fingerprint: str = SAME,
    lease: float | None = 30,
    ttl: float = 3600,
) -> Snapshot:
    """A record read at ``NOW``: ``lease``/``ttl`` seconds from now (negative: in the past)."""
    return Snapshot(
        pk=1,
        state=state,
        token=token,
        fingerprint=fingerprint,
        lease_expires_at=None if lease is None else NOW + timedelta(seconds=lease),
        expires_at=NOW + timedelta(seconds=ttl),
        response_status=201 if state == State.COMPLETED else None,
    )


def decision(found: Snapshot | None, fingerprint: str = SAME) -> Decision:
    return decide(found, token=MINE, now=NOW, same=lambda stored: stored == fingerprint)


@pytest.mark.parametrize(
    ("found", "fingerprint", "expected"),
    [
        pytest.param(None, SAME, RACE, id="gone-again: claim again"),
        pytest.param(record(token=MINE, lease=12), SAME, Resume(12.0), id="own-claim-resumed"),
        pytest.param(record(), SAME, IN_FLIGHT, id="live-lease-same: 409 or wait"),
        pytest.param(record(), OTHER, MISMATCH, id="live-lease-other: 422"),
        pytest.param(record(lease=-1), SAME, TakeOver(expired=False), id="lapsed-same: take over"),
        pytest.param(record(lease=None), SAME, TakeOver(expired=False), id="no-lease-same"),
        pytest.param(record(lease=-1), OTHER, MISMATCH, id="lapsed-other: 422"),
        pytest.param(
            record(token=MINE, lease=-1), SAME, TakeOver(expired=False), id="own-lapsed: renewed"
        ),
        pytest.param(record(state=State.COMPLETED), SAME, REPLAY, id="completed-same: replay"),
        pytest.param(record(state=State.COMPLETED), OTHER, MISMATCH, id="completed-other: 422"),
        pytest.param(
            record(state=State.COMPLETED, ttl=-1), OTHER, TakeOver(expired=True), id="expired"
        ),
        pytest.param(
            record(lease=-1, ttl=-1), OTHER, TakeOver(expired=True), id="lapsed-and-expired"
        ),
        pytest.param(record(ttl=-1), SAME, IN_FLIGHT, id="past-ttl-under-live-lease: in use"),
        pytest.param(record(ttl=-1), OTHER, MISMATCH, id="past-ttl-live-lease-other: 422"),
    ],
)
def test_each_row_of_the_table(found: Snapshot | None, fingerprint: str, expected: object) -> None:
    assert decision(found, fingerprint) == expected


def test_the_fingerprint_is_compared_only_where_the_table_needs_it() -> None:
    """Comparing can log (a key no longer held); a request's own live claim, and a record
    gone again, never ask."""
    asked: list[str] = []

    def same(stored: str) -> bool:
        asked.append(stored)
        return True

    decide(None, token=MINE, now=NOW, same=same)
    decide(record(token=MINE), token=MINE, now=NOW, same=same)
    assert asked == []
    decide(record(), token=MINE, now=NOW, same=same)
    assert asked == [SAME]


@pytest.mark.parametrize(
    ("seconds_left", "place", "in_transaction", "expected"),
    [
        (1.0, True, False, True),
        (0.0, True, False, False),  # the wait is over: 409
        (-0.5, True, False, False),
        (1.0, False, False, False),  # every waiter's place taken: 409 at once
        (1.0, True, True, False),  # inside a transaction the claim cannot be retried
    ],
)
def test_keep_waiting(
    seconds_left: float, place: bool, in_transaction: bool, expected: bool
) -> None:
    assert (
        keep_waiting(seconds_left=seconds_left, place=lambda: place, in_transaction=in_transaction)
        is expected
    )


def test_keep_waiting_takes_a_place_only_when_it_would_wait() -> None:
    taken: list[bool] = []

    def place() -> bool:
        taken.append(True)
        return True

    assert keep_waiting(seconds_left=0, place=place) is False
    assert keep_waiting(seconds_left=1, place=place, in_transaction=True) is False
    assert taken == []
    assert keep_waiting(seconds_left=1, place=place) is True
    assert taken == [True]


records = st.builds(
    record,
    state=st.sampled_from([State.IN_PROGRESS, State.COMPLETED]),
    token=st.sampled_from([MINE, THEIRS]),
    fingerprint=st.sampled_from([SAME, OTHER]),
    lease=st.one_of(st.none(), st.floats(-3600, 3600, allow_nan=False)),
    ttl=st.floats(-3600, 3600, allow_nan=False),
)


@given(found=records)
def test_a_live_lease_is_never_taken_over_and_only_its_own_claim_resumes(found: Snapshot) -> None:
    live = (
        found.state == State.IN_PROGRESS
        and found.lease_expires_at is not None
        and found.lease_expires_at > NOW
    )
    answer = decision(found)
    if live:
        assert not isinstance(answer, TakeOver)
        assert isinstance(answer, Resume) == (found.token == MINE)
    else:
        assert not isinstance(answer, Resume)


@given(found=records)
def test_another_requests_record_is_refused_unless_it_expired(found: Snapshot) -> None:
    """A different fingerprint is never replayed, waited on or taken over while the record
    counts: only an expired record (absent) is claimed over it."""
    answer = decision(found, fingerprint=OTHER if found.fingerprint == SAME else SAME)
    if found.token == MINE and isinstance(answer, Resume):
        return  # its own claim: the fingerprint is its own by construction in real use
    live = (
        found.state == State.IN_PROGRESS
        and found.lease_expires_at is not None
        and found.lease_expires_at > NOW
    )
    expired = found.expires_at <= NOW and not live
    assert answer == (TakeOver(expired=True) if expired else MISMATCH)


@given(found=records)
def test_a_completed_record_of_the_same_request_is_replayed_until_it_expires(
    found: Snapshot,
) -> None:
    if found.state != State.COMPLETED or found.fingerprint != SAME:
        return
    expected = TakeOver(expired=True) if found.expires_at <= NOW else REPLAY
    assert decision(found) == expected


# -- the rules around the table -------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "on_store_error", "expected"),
    [
        ("unreachable", "closed", "closed"),
        ("unreachable", "open", "open"),  # only a store that cannot be reached fails open
        ("other", "open", "closed"),
        ("other", "closed", "closed"),
        ("contention", "open", "closed"),
    ],
)
def test_only_an_unreachable_store_fails_open(
    kind: str, on_store_error: str, expected: str
) -> None:
    assert store_failure(kind, on_store_error) == expected


@pytest.mark.parametrize(
    ("kind", "expected"), [("contention", True), ("unreachable", False), ("other", False)]
)
def test_contention_is_a_request_in_flight(kind: str, expected: bool) -> None:
    assert contended(kind) is expected


def locked() -> OperationalError:
    """SQLite's lock timeout as Django raises it: the database rolled the statement back."""
    error = OperationalError("database is locked")
    error.__cause__ = sqlite3.OperationalError("database is locked")
    return error


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        pytest.param(InterfaceError("connection already closed"), True, id="interface-error"),
        pytest.param(OperationalError("server closed the connection"), True, id="lost"),
        pytest.param(locked(), False, id="lock-timeout: rolled back"),
        pytest.param(IntegrityError("duplicate"), False, id="integrity"),
        pytest.param(DatabaseError("other"), False, id="database-error"),
        pytest.param(ValueError("the view's own"), False, id="not-the-database"),
    ],
)
def test_an_outcome_is_unknown_only_when_the_work_may_have_committed(
    error: BaseException, expected: bool
) -> None:
    assert outcome_unknown(error) is expected


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (OperationalError("lost"), True),
        (InterfaceError("closed"), True),
        (locked(), True),
        (ConnectionError("redis"), True),
        (DataError("too long"), False),  # the database refuses the statement itself
        (IntegrityError("constraint"), False),
        (ProgrammingError("syntax"), False),
        (NotSupportedError("feature"), False),
    ],
)
def test_a_completion_is_sent_again_unless_the_database_refused_the_statement(
    error: BaseException, expected: bool
) -> None:
    assert may_pass_on_retry(error) is expected


@pytest.mark.parametrize(
    ("body", "limit", "expected"),
    [(b"x" * 10, 10, True), (b"x" * 11, 10, False), (b"", 0, True), (None, 10, False)],
)
def test_the_size_rule(body: bytes | None, limit: int, expected: bool) -> None:
    assert fits(body, limit) is expected


@given(body=st.one_of(st.none(), st.binary(max_size=64)), limit=st.integers(0, 64))
def test_a_body_is_stored_only_whole_and_within_the_limit(body: bytes | None, limit: int) -> None:
    assert fits(body, limit) == (body is not None and len(body) <= limit)


@pytest.mark.parametrize(
    ("lease_left", "expected"),
    [
        pytest.param(29, 1, id="renewed on schedule: RETRY_AFTER_SECONDS"),
        pytest.param(15.5, 1, id="more than half: still live"),
        pytest.param(15, 15, id="half or less: missed its renewals"),
        pytest.param(7.2, 8, id="rounded up"),
        pytest.param(0.5, 1, id="never below the setting"),
        pytest.param(-3, 1, id="lapsed"),
    ],
)
def test_in_flight_retry_after(lease_left: float, expected: int) -> None:
    found = record(lease=lease_left)
    assert in_flight_retry_after(found, NOW, lease=30, retry_after=1) == expected


@given(
    left=st.floats(-60, 60, allow_nan=False),
    lease=st.floats(1, 60, allow_nan=False),
    retry_after=st.integers(1, 30),
)
def test_retry_after_is_never_below_the_setting_nor_past_the_lease(
    left: float, lease: float, retry_after: int
) -> None:
    answer = in_flight_retry_after(record(lease=left), NOW, lease=lease, retry_after=retry_after)
    assert answer >= retry_after
    assert answer <= max(retry_after, lease)
    if left > lease / 2:
        assert answer == retry_after


def test_races_are_bounded() -> None:
    assert [races_left(races) for races in range(MAX_RACES + 2)] == [True] * MAX_RACES + [
        False,
        False,
    ]


@pytest.mark.parametrize(
    ("module", "names"),
    [
        ("idempotency_django.store", ("is_expired", "is_in_use", "is_lapsed")),
        ("idempotency_django.store.base", ("is_expired", "is_in_use", "is_lapsed", "lease_left")),
    ],
)
def test_the_record_predicates_stay_importable_where_they_were(
    module: str, names: tuple[str, ...]
) -> None:
    """The predicates moved into the decision table; an import by their old path still
    gets them (the same functions, not copies that could drift apart)."""
    import importlib

    from idempotency_django.core import decisions

    old = importlib.import_module(module)
    for name in names:
        assert getattr(old, name) is getattr(decisions, name)
    with pytest.raises(AttributeError):
        old.no_such_predicate  # noqa: B018
