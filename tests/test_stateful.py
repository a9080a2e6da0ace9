"""A stateful test (Hypothesis ``RuleBasedStateMachine``) of the engine against a model of
the HTTP contract's decision table (docs/guarantees.md and docs/http-contract.md), on the
database in ``DATABASE_URL`` (PostgreSQL, MariaDB) or SQLite, or on the Redis store
(``IDEMPOTENCY_TEST_STORE=redis``, a single Redis or a ``redis+cluster://`` one).

Workers claim keys with a fingerprint, complete or release their claims, stall (their
heartbeat stops) or run past ``max_run``; duplicates arrive while a claim is held; the
heartbeat beats, leases lapse, TTLs pass and the purge runs. Time is a fake clock
(``django.utils.timezone.now``, which the engine, the heartbeat and the purge read, and
the heartbeat's ``time.monotonic``): nothing sleeps. After every step the store must hold
exactly what the model holds, and:

- at most one worker owns a live claim of a key, and it is the record's owner;
- a completed key replays the stored bytes until it expires;
- a lost claim never overwrites the new owner (``complete`` returns False), and a take-over
  held up after its read takes nothing that changed since (a renewal, another take-over);
- the purge deletes nothing in use (in progress under a live lease).

The Redis store runs its leases and expiry on Redis's clock (``TIME`` in its scripts, ``PX``),
and the database store on PostgreSQL or MariaDB on the database's, which the fake clock does
not move: there, when the clock moves, every record is aged by as much instead
(``records.age``: its lease and expiry that much earlier; on Redis its PTTL that much shorter,
the key deleted when its PTTL runs out, as Redis would have), with no change to the store's
own statements. The model knows when Redis expires a key (``Record.gone_at``: a claim three
leases after its claim or last renewal, a completed key at its TTL), and that it never
expires one in use; nothing is purged there. The store's times are compared with the model's
by the store's clock, less the real time a step took, which is then given back
(``records.retime``). On SQLite the store runs on the fake clock itself.

Runs deterministically by default (derandomized, a few seconds per database). For a
longer, randomized search::

    HYPOTHESIS_PROFILE=long python -m pytest tests/test_stateful.py

Hypothesis prints a failing run as a sequence of calls on ``EngineMachine``: keep it as
a plain test at the end of this module.
"""

from __future__ import annotations

import io
import os
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from types import SimpleNamespace
from typing import Any

import pytest
from django.core.management import call_command
from django.utils import timezone
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from idempotency_django.core import claims, shell
from idempotency_django.core import heartbeat as heartbeat_module
from idempotency_django.core.heartbeat import Heartbeat
from idempotency_django.exceptions import InFlight, KeyMismatch, ResponseNotStored
from idempotency_django.operations import purge
from idempotency_django.responses import StoredResponse
from idempotency_django.store import Snapshot, never
from idempotency_django.store import database as database_store
from idempotency_django.store.base import get_store
from tests import records
from tests.conftest import ON_REDIS

pytestmark = pytest.mark.django_db(transaction=True)

LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
STATEFUL_SETTINGS = settings(
    max_examples=1000 if LONG else 100,
    stateful_step_count=50 if LONG else 30,
    derandomize=not LONG,
    database=None,
    deadline=None,
)

LEASE = 10
# The Redis store keeps a record in progress three leases from its claim, take-over or
# renewal (two past its lease), whatever its TTL; Redis then expires it (store/redis.py).
KEPT = timedelta(seconds=3 * LEASE)
# On the store's own clock: how far its times may be behind the model's after one step,
# which takes real time on that clock (the model's times are whole seconds apart).
STEP_MS = 1000
# A TTL shorter than the lease (a claim can be past its TTL under a live lease), a longer
# one, and none.
TTLS = (5, 30, None)
MAX_RUNS = (15, 300)
# (account, key): two keys of one account, and one account's key under another account.
Key = tuple[str, str]
KEYS: tuple[Key, ...] = (("alice", "k1"), ("alice", "k2"), ("bob", "k1"))
FINGERPRINTS = ("2:" + "a" * 64, "2:" + "b" * 64)
ENDPOINT = "POST /charges/"
START = datetime(2030, 1, 1, tzinfo=dt_timezone.utc)
HEADERS: tuple[list[tuple[str, str]], ...] = (
    [],
    [("Content-Type", "application/json")],
    [("Location", "/charges/7")],
)


class Clock:
    """The time every module under test reads."""

    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> datetime:
        return self.now

    def monotonic(self) -> float:
        return (self.now - START).total_seconds()


CLOCK = Clock()


class ManualHeartbeat(Heartbeat):
    """The real heartbeat's bookkeeping and renewal statement, beating only when a rule
    says so: no thread."""

    def _ensure_worker(self) -> Any:
        if self._worker is None:
            new = threading.Event
            self._worker = heartbeat_module._Worker(threading.current_thread(), new(), new())
        return self._worker


# -- the model --------------------------------------------------------------------------------


@dataclass
class Record:
    """What the contract says the store holds for one key."""

    token: str
    fingerprint: str
    completed: bool
    lease_expires_at: datetime | None
    expires_at: datetime
    # On the Redis store: when Redis expires the key (``never()``: it has no PTTL).
    gone_at: datetime = field(default_factory=never)
    response: StoredResponse | None = None
    body_stored: bool = True

    def in_use(self, now: datetime) -> bool:
        """In progress under a live lease: its view may be running right now."""
        assert self.completed or self.lease_expires_at is not None
        return (
            not self.completed and self.lease_expires_at is not None and now < self.lease_expires_at
        )

    def absent(self, now: datetime) -> bool:
        """Past its TTL, and not in use (whatever its TTL says)."""
        return self.expires_at <= now and not self.in_use(now)


@dataclass(eq=False)
class Worker:
    """One request that claimed a key, and what it believes of its claim."""

    claim: claims.Claim
    key: Key
    fingerprint: str
    ttl: int | None
    lease_until: datetime
    status: str = "running"  # running, completed, lost (to a new owner), released
    stop_renewing_at: float | None = None  # registered with the heartbeat until then

    def __repr__(self) -> str:
        return f"Worker({self.key}, {self.fingerprint[2:4]}…, token={self.claim.token[:6]})"


# How often each outcome happened: the scenarios below check that they reach the row of the
# decision table they are about, and ``pytest -s`` prints what the random run reached.
OUTCOMES: Counter[str] = Counter()


def report(what: str) -> None:
    OUTCOMES[what] += 1


def scope(key: Key) -> claims.Scope:
    account, name = key
    return claims.Scope(account, ENDPOINT, name)


def options(ttl: int | None) -> claims.ClaimPolicy:
    return claims.ClaimPolicy(
        alias="default", lease=LEASE, ttl=ttl, in_flight="conflict", wait_seconds=0, retry_after=1
    )


def expiry(now: datetime, ttl: int | None) -> datetime:
    return never() if ttl is None else now + timedelta(seconds=ttl)


@dataclass(eq=False)
class Read:
    """What a request read of a record it may take over, before it tries to."""

    key: Key
    fingerprint: str
    snapshot: Snapshot


class EngineMachine(RuleBasedStateMachine):
    workers = Bundle("workers")  # running: neither completed nor released
    finished = Bundle("finished")
    reads = Bundle("reads")  # read, their take-over not tried yet

    def __init__(self) -> None:
        super().__init__()
        CLOCK.now = START
        # What the store the machine runs on does by itself (any store: the contract suite
        # runs the machine on each, tests/store/test_contract.py): whether it expires its
        # records (Redis) rather than leave them to the purge, and whether its leases and
        # expiry run on its own clock.
        self.expires_itself = not get_store().needs_purge
        self.on_store_clock = records.keeps_own_clock()
        records.delete()
        self.heartbeat = ManualHeartbeat()
        self.records: dict[Key, Record] = {}
        self.all_workers: list[Worker] = []

    def teardown(self) -> None:
        self.heartbeat.stop()

    @property
    def now(self) -> datetime:
        return CLOCK.now

    # -- the decision table -------------------------------------------------------------------

    def expected_begin(self, key: Key, fingerprint: str) -> str:
        record = self.records.get(key)
        if record is None or record.absent(self.now):
            return "claim"
        if record.fingerprint != fingerprint:
            return "mismatch"
        if not record.completed:
            return "in flight" if record.in_use(self.now) else "claim"  # lapsed: take over
        return "replay" if record.body_stored else "not stored"

    def begin_request(
        self, key: Key, fingerprint: str, ttl: int | None, max_run: int | None
    ) -> Any:
        expected = self.expected_begin(key, fingerprint)
        previous = self.records.get(key)
        try:
            outcome = shell.claim_or_replay(scope(key), fingerprint, options(ttl))
        except InFlight:
            actual = "in flight"
        except KeyMismatch:
            actual = "mismatch"
        except ResponseNotStored:
            actual = "not stored"
        else:
            actual = "claim" if isinstance(outcome, claims.Claim) else "replay"
        assert actual == expected, f"{key}: {expected} expected from {previous}, got {actual}"
        report(f"begin: {actual}" + (" (taken over)" if actual == "claim" and previous else ""))
        if actual == "replay":
            assert previous is not None
            assert outcome == previous.response  # the stored bytes, status and headers
        if actual != "claim":
            return multiple()
        assert isinstance(outcome, claims.Claim)
        return self.owns(outcome, key, fingerprint, ttl, max_run)

    def owns(
        self, claim: claims.Claim, key: Key, fingerprint: str, ttl: int | None, max_run: int | None
    ) -> Worker:
        """``claim`` of ``key`` is the record now, and a worker runs the view under it."""
        self.records[key] = Record(
            token=claim.token,
            fingerprint=fingerprint,
            completed=False,
            lease_expires_at=self.now + timedelta(seconds=LEASE),
            expires_at=expiry(self.now, ttl),
            gone_at=self.now + max(KEPT, timedelta(seconds=ttl or 0)),
        )
        worker = Worker(claim, key, fingerprint, ttl, self.now + timedelta(seconds=LEASE))
        if max_run is not None:
            self.heartbeat.register(claim, LEASE, max_run)
            worker.stop_renewing_at = CLOCK.monotonic() + max_run
        self.all_workers.append(worker)
        return worker

    # -- rules ----------------------------------------------------------------------------------

    @rule(
        target=workers,
        key=st.sampled_from(KEYS),
        fingerprint=st.sampled_from(FINGERPRINTS),
        ttl=st.sampled_from(TTLS),
        max_run=st.sampled_from((*MAX_RUNS, None)),
    )
    def begin(self, key: Key, fingerprint: str, ttl: int | None, max_run: int | None) -> Any:
        """A request claims ``key`` (``max_run=None``: its heartbeat never beats)."""
        return self.begin_request(key, fingerprint, ttl, max_run)

    @rule(target=workers, holder=workers, same=st.booleans(), ttl=st.sampled_from(TTLS))
    def duplicate_arrives(self, holder: Worker, same: bool, ttl: int | None) -> Any:
        """A second request for a key while a worker holds a claim of it (which may have
        lapsed, or been taken over, without the worker knowing)."""
        fingerprint = holder.fingerprint if same else other_fingerprint(holder.fingerprint)
        return self.begin_request(holder.key, fingerprint, ttl, MAX_RUNS[1])

    @rule(target=workers, worker=finished, ttl=st.sampled_from(TTLS))
    def client_retries(self, worker: Worker, ttl: int | None) -> Any:
        """The client sends a request again after its first attempt ended (completed,
        released, or lost to a new owner)."""
        return self.begin_request(worker.key, worker.fingerprint, ttl, MAX_RUNS[1])

    @rule(target=reads, holder=workers, same=st.booleans())
    def duplicate_reads(self, holder: Worker, same: bool) -> Any:
        """Once ``holder``'s lease lapsed, a request reads the record it would take over
        (lapsed, or past its TTL and not in use), and is held up before its take-over: a
        renewal, a completion, a release or another take-over may come first
        (``late_take_over``)."""
        self.lease_lapses(holder)
        key = holder.key
        record = self.records.get(key)
        if record is None:
            return multiple()
        fingerprint = record.fingerprint if same else other_fingerprint(record.fingerprint)
        if self.expected_begin(key, fingerprint) != "claim":
            return multiple()
        snapshot = options(None).store.read(scope(key), fingerprint)  # type: ignore[attr-defined]
        assert snapshot is not None
        assert snapshot.token == record.token
        return Read(key, fingerprint, snapshot)

    @rule(target=workers, read=consumes(reads), ttl=st.sampled_from(TTLS))
    def late_take_over(self, read: Read, ttl: int | None) -> Any:
        """The held-up request's take-over: the store re-checks, under the token it read,
        that the record is still not in use and still lapsed or past its TTL."""
        record = self.records.get(read.key)
        expected = (
            record is not None
            and record.token == read.snapshot.token
            and not record.in_use(self.now)
            and (not record.completed or record.expires_at <= self.now)
        )
        token = claims.new_token()

        taken = shell._take_over(
            read.snapshot, scope(read.key), read.fingerprint, token, self.now, options(ttl)
        )

        assert taken == expected, f"{read.key}: take-over {taken}, the model's {expected}"
        report(f"late take-over: {'taken' if taken else 'refused'}")
        if not taken:
            return multiple()
        claim = claims.Claim(scope(read.key), token, "default", ttl, options(ttl).store)
        return self.owns(claim, read.key, read.fingerprint, ttl, MAX_RUNS[1])

    @rule(
        target=finished,
        worker=consumes(workers),
        status=st.sampled_from((200, 201, 302, 404, 422)),
        body=st.binary(max_size=12),
        headers=st.sampled_from(HEADERS),
        body_stored=st.booleans(),
    )
    def complete(
        self,
        worker: Worker,
        status: int,
        body: bytes,
        headers: list[tuple[str, str]],
        body_stored: bool,
    ) -> Worker:
        """The view returned: store its outcome (``body_stored=False``: streamed or too
        large to store)."""
        self.store_outcome(worker, StoredResponse(status, body, list(headers)), body_stored)
        self.heartbeat.unregister(worker.claim)
        worker.stop_renewing_at = None
        return worker

    @rule(worker=finished)
    def completion_retried(self, worker: Worker) -> None:
        """A completion sent again (its acknowledgement was lost): it changes nothing."""
        if worker.status == "completed":
            self.store_outcome(worker, StoredResponse(500, b"again", []), True)

    def store_outcome(self, worker: Worker, response: StoredResponse, body_stored: bool) -> None:
        record = self.records.get(worker.key)
        owner = record is not None and record.token == worker.claim.token

        stored = shell.complete(worker.claim, response, body_stored=body_stored)

        assert stored == owner, "a completion is fenced by its claim's token"
        report(f"complete: {'stored' if stored else 'lost'}")
        if not stored:
            worker.status = "lost"  # the new owner's record is untouched (the invariant)
            return
        assert record is not None
        if not record.completed:
            record.completed = True
            record.lease_expires_at = None
            record.response = response
            record.body_stored = body_stored
            record.expires_at = expiry(self.now, worker.ttl)  # the TTL counts from here
            record.gone_at = record.expires_at  # Redis: PX the TTL, or no PTTL
        worker.status = "completed"

    @rule(target=finished, worker=consumes(workers))
    def release(self, worker: Worker) -> Worker:
        """The view failed (a 5xx, an exception): the key is released."""
        shell.release(worker.claim)
        self.heartbeat.unregister(worker.claim)
        worker.stop_renewing_at = None
        worker.status = "released"
        record = self.records.get(worker.key)
        if record is not None and record.token == worker.claim.token:
            del self.records[worker.key]
        return worker

    @rule(worker=workers)
    def heartbeat_stops(self, worker: Worker) -> None:
        """The worker stalls or loses the store: its claim is no longer renewed."""
        self.heartbeat.unregister(worker.claim)
        worker.stop_renewing_at = None

    @precondition(lambda self: any(w.stop_renewing_at is not None for w in self.all_workers))
    @rule()
    def heartbeat_beats(self) -> None:
        expected = 0
        for worker in self.all_workers:
            if worker.stop_renewing_at is None:
                continue
            if worker.stop_renewing_at <= CLOCK.monotonic():
                worker.stop_renewing_at = None  # ran past max_run: dropped
                continue
            record = self.records.get(worker.key)
            if record is not None and record.token == worker.claim.token and not record.completed:
                record.lease_expires_at = self.now + timedelta(seconds=LEASE)
                record.gone_at = max(record.gone_at, self.now + KEPT)
                worker.lease_until = record.lease_expires_at
                expected += 1

        assert self.heartbeat.renew_once() == expected
        report(f"heartbeat: {expected} renewed")

    def advance(self, to: datetime) -> None:
        """The clock moves to ``to``. Where leases and expiry run on the store's own clock,
        every record is aged by as much instead (``records.age``); on Redis, the keys Redis
        would have expired by then are gone: never one in use, never a completed one before
        its expiry."""
        delta = to - CLOCK.now
        CLOCK.now = to
        if not self.on_store_clock:
            return
        records.age(delta)
        if not self.expires_itself:
            return
        for key, record in list(self.records.items()):
            if record.gone_at <= self.now:
                assert not record.in_use(self.now), f"Redis expired {key} in use: {record}"
                assert record.expires_at <= self.now or not record.completed, (
                    f"Redis expired {key} before its TTL: {record}"
                )
                report("redis: expired natively")
                del self.records[key]

    @rule(seconds=st.integers(1, 40))
    def time_passes(self, seconds: int) -> None:
        self.advance(self.now + timedelta(seconds=seconds))

    @rule(worker=workers)
    def lease_lapses(self, worker: Worker) -> None:
        """The clock reaches the end of the worker's lease, to the microsecond."""
        if self.now < worker.lease_until:
            self.advance(worker.lease_until)

    @rule(key=st.sampled_from(KEYS))
    def ttl_passes(self, key: Key) -> None:
        """The clock reaches the record's expiry, to the microsecond."""
        record = self.records.get(key)
        if record is not None and self.now < record.expires_at != never():
            self.advance(record.expires_at)

    @precondition(lambda self: self.records)
    @rule(older_than=st.sampled_from((0, 10)), stale_after=st.sampled_from((0, 20)))
    def purge(self, older_than: int, stale_after: int) -> None:
        if self.expires_itself:
            self.purge_on_redis(older_than, stale_after)
            return
        # On the store's own clock the real time of the steps has passed too: a lease that
        # lapses right now by the model has lapsed (by less than a step) when the purge reads
        # it, and counts as stale with a stale_after of 0.
        now = self.now + (timedelta(microseconds=1) if self.on_store_clock else timedelta(0))
        cutoff = now - timedelta(seconds=older_than)
        expired = {
            key
            for key, record in self.records.items()
            if record.expires_at <= cutoff and not record.in_use(now)
        }
        stale = {
            key
            for key, record in self.records.items()
            if not record.completed
            and record.lease_expires_at is not None
            and record.lease_expires_at < now - timedelta(seconds=stale_after)
            and record.expires_at > cutoff
        }
        in_use = {record.token for record in self.records.values() if record.in_use(now)}

        result = purge.purge_records(
            older_than=timedelta(seconds=older_than), stale_after=timedelta(seconds=stale_after)
        )

        left = {token for (token,) in records.values("token")}
        assert in_use <= left, "the purge deleted a record in use"
        assert (result.expired, result.stale) == (len(expired), len(stale))
        report("purge: none" if not result.total else "purge: some")
        report("purge: expired" if result.expired else "purge: no expired")
        report("purge: stale" if result.stale else "purge: no stale")
        for key in expired | stale:
            del self.records[key]

    def purge_on_redis(self, older_than: int, stale_after: int) -> None:
        """The Redis store has nothing to purge (Redis expires its keys): the command says
        so, exits 0 and deletes nothing, in use or not."""
        before = set(records.values("pk", "token"))
        out = io.StringIO()

        call_command(
            "purge_idempotency_keys",
            f"--older-than={older_than}s",
            f"--stale-after={stale_after}s",
            stdout=out,
        )

        assert "nothing to purge" in out.getvalue()
        assert set(records.values("pk", "token")) == before, "the purge deleted a record"
        report("purge: nothing to purge (Redis)")

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def the_store_holds_what_the_model_holds(self) -> None:
        rows = {(row.account, row.key): row for row in records.all()}
        assert rows.keys() == self.records.keys()
        for key, record in self.records.items():
            row = rows[key]
            assert row.endpoint == ENDPOINT
            assert row.token == record.token
            assert row.fingerprint == record.fingerprint
            assert row.state == ("completed" if record.completed else "in_progress")
            if self.on_store_clock:
                self.check_store_times(row.pk, record)
            else:
                assert row.lease_expires_at == record.lease_expires_at
                assert row.expires_at == record.expires_at
            if record.completed:
                assert record.response is not None
                assert row.response_status == record.response.status
                assert [tuple(pair) for pair in row.response_headers] == record.response.headers
                body = None if row.response_body is None else bytes(row.response_body)
                assert body == (record.response.body if record.body_stored else None)

    def check_store_times(self, pk: Any, record: Record) -> None:
        """The record's lease, expiry and (Redis) PTTL are the model's, by the store's clock:
        the same, or less by the real time this step took (at most ``STEP_MS``). They are
        then set to the model's exactly, so that the real time the steps take never adds
        up."""

        def ms(when: datetime | None) -> int | None:
            if when is None or when >= never():
                return None
            return round((when - self.now).total_seconds() * 1000)

        model = records.Times(
            lease=None if record.completed else ms(record.lease_expires_at),
            expires=ms(record.expires_at),
            pttl=ms(record.gone_at) if self.expires_itself else None,
        )
        stored = records.retime(pk, model)
        assert stored is not None, f"{pk} vanished"
        for name in ("lease", "expires", "pttl"):
            want, got = getattr(model, name), getattr(stored, name)
            assert (want is None) == (got is None), f"{name}: {got} ms, the model's {want} ms"
            if want is not None and got is not None:
                assert 0 <= want - got <= STEP_MS, f"{name}: {got} ms, the model's {want} ms"

    @invariant()
    def at_most_one_worker_owns_a_live_claim(self) -> None:
        for key in KEYS:
            live = [
                worker
                for worker in self.all_workers
                if worker.key == key
                and worker.status == "running"
                and self.now < worker.lease_until
            ]
            assert len(live) <= 1, f"{key} has two live owners: {live}"
            if live:
                assert self.records[key].token == live[0].claim.token


def other_fingerprint(fingerprint: str) -> str:
    return next(other for other in FINGERPRINTS if other != fingerprint)


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    # The engine and the store (SQLite's times, the others' snapshots) call
    # django.utils.timezone.now().
    for module in (shell, database_store):
        assert module.timezone is timezone
    monkeypatch.setattr(timezone, "now", CLOCK)
    monkeypatch.setattr(heartbeat_module, "time", SimpleNamespace(monotonic=CLOCK.monotonic))
    return CLOCK


def test_the_engine_follows_the_decision_table(fake_clock: Clock) -> None:
    OUTCOMES.clear()

    run_state_machine_as_test(EngineMachine, settings=STATEFUL_SETTINGS)

    print(dict(sorted(OUTCOMES.items())))  # python -m pytest -s shows what the run reached


# -- each row of the decision table, once -------------------------------------------------------
#
# The random run reaches these too (pytest -s prints how often); here each is reached
# whatever Hypothesis generates. The machine's rules assert the model's answer.

A, B = FINGERPRINTS


def claimed(state: EngineMachine, ttl: int | None = 30, max_run: int | None = None) -> Worker:
    worker = state.begin(key=KEYS[0], fingerprint=A, ttl=ttl, max_run=max_run)
    assert isinstance(worker, Worker)
    return worker


def completed(state: EngineMachine, body_stored: bool = True) -> Worker:
    """Claimed at 0 s with a 30 s TTL, completed at 9 s: expires at 39 s."""
    worker = claimed(state)
    state.time_passes(seconds=LEASE - 1)
    done = state.complete(
        worker=worker, status=201, body=b"{}", headers=HEADERS[1], body_stored=body_stored
    )
    assert isinstance(done, Worker)
    return done


def last_begin(state: EngineMachine, fingerprint: str) -> str:
    OUTCOMES.clear()
    state.begin(key=KEYS[0], fingerprint=fingerprint, ttl=30, max_run=None)
    check(state)
    (outcome,) = OUTCOMES
    return outcome


@pytest.mark.parametrize(
    ("fingerprint", "outcome"), [(A, "in flight"), (B, "mismatch")], ids=["same", "other"]
)
def test_in_progress_under_a_live_lease(
    machine: EngineMachine, fingerprint: str, outcome: str
) -> None:
    claimed(machine)
    machine.time_passes(seconds=LEASE - 1)

    assert last_begin(machine, fingerprint) == f"begin: {outcome}"


@pytest.mark.parametrize(
    ("fingerprint", "outcome"),
    [(A, "claim (taken over)"), (B, "mismatch")],
    ids=["same", "other"],
)
def test_in_progress_under_a_lapsed_lease(
    machine: EngineMachine, fingerprint: str, outcome: str
) -> None:
    machine.lease_lapses(worker=claimed(machine))

    assert last_begin(machine, fingerprint) == f"begin: {outcome}"


def test_in_progress_under_a_lapsed_lease_and_past_its_ttl_is_absent(
    machine: EngineMachine,
) -> None:
    machine.lease_lapses(worker=claimed(machine, ttl=5))  # 10 s: lapsed, past its TTL

    assert last_begin(machine, B) == "begin: claim (taken over)"


@pytest.mark.parametrize(
    ("fingerprint", "outcome"), [(A, "replay"), (B, "mismatch")], ids=["same", "other"]
)
def test_completed(machine: EngineMachine, fingerprint: str, outcome: str) -> None:
    completed(machine)
    machine.time_passes(seconds=29)  # 38 s: the TTL counts from the completion

    assert last_begin(machine, fingerprint) == f"begin: {outcome}"


def test_completed_without_a_stored_body(machine: EngineMachine) -> None:
    completed(machine, body_stored=False)

    assert last_begin(machine, A) == "begin: not stored"


@pytest.mark.parametrize("fingerprint", [A, B], ids=["same", "other"])
def test_completed_and_past_its_ttl_is_absent(machine: EngineMachine, fingerprint: str) -> None:
    completed(machine)
    machine.ttl_passes(key=KEYS[0])

    # The database store takes the expired row over; Redis expired the key at its TTL.
    taken_over = "" if ON_REDIS else " (taken over)"
    assert last_begin(machine, fingerprint) == f"begin: claim{taken_over}"


def test_released_is_absent(machine: EngineMachine) -> None:
    machine.release(worker=claimed(machine))

    assert last_begin(machine, B) == "begin: claim"


def test_a_lost_claim_does_not_overwrite_the_new_owner(machine: EngineMachine) -> None:
    first = claimed(machine)
    machine.lease_lapses(worker=first)
    second = machine.duplicate_arrives(holder=first, same=True, ttl=30)
    machine.complete(worker=second, status=201, body=b"second", headers=[], body_stored=True)
    OUTCOMES.clear()

    machine.complete(worker=first, status=201, body=b"first", headers=[], body_stored=True)

    check(machine)
    assert OUTCOMES == {"complete: lost": 1}
    body = records.get().response_body
    assert body is not None
    assert bytes(body) == b"second"


def test_a_lost_claim_does_not_overwrite_the_new_owners_claim_in_progress(
    machine: EngineMachine,
) -> None:
    first = claimed(machine)
    machine.lease_lapses(worker=first)
    second = machine.duplicate_arrives(holder=first, same=True, ttl=30)
    OUTCOMES.clear()

    machine.complete(worker=first, status=201, body=b"first", headers=[], body_stored=True)

    check(machine)
    assert OUTCOMES == {"complete: lost": 1}
    assert records.get().token == second.claim.token
    assert records.get().state == "in_progress"


def test_a_lost_claims_release_leaves_the_new_owners_record(machine: EngineMachine) -> None:
    first = claimed(machine)
    machine.lease_lapses(worker=first)
    second = machine.duplicate_arrives(holder=first, same=True, ttl=30)

    machine.release(worker=first)  # its view failed: it releases what it no longer owns

    check(machine)
    assert records.get().token == second.claim.token


def raced_by_a_renewal(machine: EngineMachine, holder: Worker, read: Read) -> None:
    machine.heartbeat_beats()  # the holder's view still runs: leased 10 s more


def raced_by_another_take_over(machine: EngineMachine, holder: Worker, read: Read) -> None:
    other = machine.duplicate_reads(holder=holder, same=True)
    assert isinstance(other, Read)
    machine.late_take_over(read=other, ttl=30)


def raced_by_another_request(machine: EngineMachine, holder: Worker, read: Read) -> None:
    other = machine.duplicate_reads(holder=holder, same=False)  # past the 5 s TTL: anyone's
    assert isinstance(other, Read)
    new_owner = machine.late_take_over(read=other, ttl=30)
    assert isinstance(new_owner, Worker)
    machine.lease_lapses(worker=new_owner)  # 20 s: lapsed too, but another request's (422)


def raced_by_the_completion(machine: EngineMachine, holder: Worker, read: Read) -> None:
    machine.complete(worker=holder, status=201, body=b"{}", headers=[], body_stored=True)


def raced_by_the_release(machine: EngineMachine, holder: Worker, read: Read) -> None:
    machine.release(worker=holder)


def raced_by_nothing(machine: EngineMachine, holder: Worker, read: Read) -> None:
    pass


@pytest.mark.parametrize(
    ("race", "outcome"),
    [
        (raced_by_a_renewal, "refused"),
        (raced_by_another_take_over, "refused"),
        (raced_by_another_request, "refused"),
        (raced_by_the_completion, "refused"),
        (raced_by_the_release, "refused"),
        (raced_by_nothing, "taken"),
    ],
    ids=lambda value: value.__name__.removeprefix("raced_by_") if callable(value) else value,
)
def test_a_take_over_rechecks_the_record_it_read(
    machine: EngineMachine, race: Any, outcome: str
) -> None:
    """Between a request's read of a lapsed record and its take-over, something changed it
    (or nothing did): the store's take-over re-checks, fenced by the token it read."""
    holder = claimed(machine, ttl=5, max_run=300)
    read = machine.duplicate_reads(holder=holder, same=True)  # 10 s: the lease lapsed
    assert isinstance(read, Read)
    race(machine, holder, read)
    check(machine)
    OUTCOMES.clear()

    machine.late_take_over(read=read, ttl=30)

    check(machine)
    assert list(OUTCOMES.items()) == [(f"late take-over: {outcome}", 1)]


def test_the_heartbeat_stops_renewing_after_max_run(machine: EngineMachine) -> None:
    worker = claimed(machine, max_run=15)
    for _ in range(3):
        machine.time_passes(seconds=6)  # 18 s: renewed at 6 and 12, not at 18
        machine.heartbeat_beats()
    machine.lease_lapses(worker=worker)

    assert last_begin(machine, A) == "begin: claim (taken over)"


@pytest.mark.database_store("Redis expires its keys: test_redis_expires_what_is_not_in_use")
@pytest.mark.parametrize(
    ("ttl", "stale_after", "outcome"),
    [(5, 0, "purge: expired"), (None, 0, "purge: stale"), (None, 20, "purge: none")],
)
def test_the_purge_deletes_what_is_not_in_use(
    machine: EngineMachine, ttl: int | None, stale_after: int, outcome: str
) -> None:
    machine.lease_lapses(worker=claimed(machine, ttl=ttl))
    machine.time_passes(seconds=1)
    OUTCOMES.clear()

    machine.purge(older_than=0, stale_after=stale_after)

    check(machine)
    assert OUTCOMES[outcome] == 1


# -- shrunk counterexamples -------------------------------------------------------------------
#
# Found with the "TTL-over-lease takeover" fix reverted (``store.is_expired`` and
# ``store.expired_q`` without their "not in use" condition), as Hypothesis shrank them: a
# claim past its 5 s TTL but inside its 10 s lease (its view still running) was taken over
# by another request, or by its own retry once the heartbeat had renewed the lease, and
# deleted by the purge.


@pytest.fixture
def machine(fake_clock: Clock) -> Iterator[EngineMachine]:
    state = EngineMachine()
    yield state
    state.teardown()


def check(state: EngineMachine) -> None:
    state.the_store_holds_what_the_model_holds()
    state.at_most_one_worker_owns_a_live_claim()


def test_another_request_does_not_take_over_a_live_claim_past_its_ttl(
    machine: EngineMachine,
) -> None:
    worker = machine.begin(key=KEYS[0], fingerprint=A, ttl=5, max_run=15)
    assert isinstance(worker, Worker)
    machine.ttl_passes(key=KEYS[0])  # 5 s: past the TTL, inside the 10 s lease

    machine.duplicate_arrives(holder=worker, same=False, ttl=5)  # 422, not a claim

    check(machine)
    assert records.get().token == worker.claim.token


def test_the_purge_keeps_a_live_claim_past_its_ttl(machine: EngineMachine) -> None:
    worker = machine.begin(key=KEYS[0], fingerprint=A, ttl=5, max_run=15)
    assert isinstance(worker, Worker)
    machine.ttl_passes(key=KEYS[0])

    machine.purge(older_than=0, stale_after=0)

    check(machine)
    assert records.get().token == worker.claim.token


def test_a_retry_does_not_take_over_a_renewed_claim_past_its_ttl(machine: EngineMachine) -> None:
    worker = machine.begin(key=KEYS[0], fingerprint=A, ttl=5, max_run=15)
    assert isinstance(worker, Worker)
    machine.lease_lapses(worker=worker)  # 10 s: the lease ends, the TTL ended at 5 s
    machine.heartbeat_beats()  # the view still runs: leased until 20 s
    check(machine)

    machine.duplicate_arrives(holder=worker, same=True, ttl=5)  # 409 in flight, not a claim

    check(machine)
    assert records.get().token == worker.claim.token


# -- the Redis store: Redis expires the keys ------------------------------------------------
#
# Nothing is purged there: a completed key is gone at its TTL, a claim three leases after its
# claim or last renewal (whatever its TTL), never while it is in use.

on_redis = pytest.mark.skipif(not ON_REDIS, reason="the Redis store's expiry (Redis's PX)")


@on_redis
@pytest.mark.parametrize("ttl", [5, None], ids=["ttl", "forever"])
def test_redis_expires_what_is_not_in_use(machine: EngineMachine, ttl: int | None) -> None:
    machine.lease_lapses(worker=claimed(machine, ttl=ttl))
    machine.time_passes(seconds=2 * LEASE - 1)  # 29 s: lapsed, kept
    check(machine)
    assert records.count() == 1
    OUTCOMES.clear()

    machine.time_passes(seconds=1)  # 30 s: three leases after the claim

    check(machine)
    assert OUTCOMES == {"redis: expired natively": 1}
    assert records.count() == 0
    assert last_begin(machine, B) == "begin: claim"  # another request's: no 422 any more


@on_redis
def test_redis_keeps_a_renewed_claim_past_three_leases(machine: EngineMachine) -> None:
    worker = claimed(machine, ttl=5, max_run=300)
    for _ in range(5):  # 40 s, renewed every 8 s: past its TTL and three leases of its claim
        machine.time_passes(seconds=LEASE - 2)
        machine.heartbeat_beats()

    check(machine)
    assert records.get().token == worker.claim.token
    assert last_begin(machine, B) == "begin: mismatch"


@on_redis
def test_redis_replays_a_completed_key_until_its_ttl(machine: EngineMachine) -> None:
    completed(machine)  # expires at 39 s
    machine.time_passes(seconds=29)
    assert last_begin(machine, A) == "begin: replay"
    OUTCOMES.clear()

    machine.time_passes(seconds=1)

    assert OUTCOMES == {"redis: expired natively": 1}
    assert last_begin(machine, A) == "begin: claim"
