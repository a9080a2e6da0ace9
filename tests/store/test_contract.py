"""The store contract: what every store must answer, through the ``Store`` interface alone.

The shell (``shell.py``) and the decision table (``decisions.py``) rely on these answers
and on nothing else of a store, so a store that passes this suite keeps the promises of
docs/guarantees.md. Each test runs on every store the machine can reach: the database store
(on the suite's database), the Redis store (``IDEMPOTENCY_TEST_REDIS_URL``) and the Redis
store on the local Redis Cluster (marker ``redis_cluster``: ``python -m tools.redis_cluster
start``). A new store adds one entry to ``STORES`` below.

Time passes on the store's own clock, which a test cannot move: a lease or a TTL that must
lapse is given a few milliseconds, and the test waits (polling, with a deadline) until the
store says it lapsed.
"""

from __future__ import annotations

import inspect
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import hypothesis
import pytest
from django.db import connection, connections, transaction
from django.utils import timezone
from hypothesis.stateful import run_state_machine_as_test

from idempotency_django.core.decisions import is_expired, is_in_use, is_lapsed
from idempotency_django.models import IdempotencyRecord
from idempotency_django.store import base
from idempotency_django.store.base import (
    CLAIMED,
    DEFAULT_STORE,
    ClaimOrRead,
    Completion,
    Snapshot,
    Store,
    Write,
    get_store,
)
from tests import test_stateful as stateful
from tests.conftest import REDIS_URL, wait_until
from tests.docs_snippets import store_interface
from tests.test_stateful import fake_clock  # noqa: F401 - the model test's fixture
from tools import redis_cluster
from tools import server as tools_server

if TYPE_CHECKING:
    from pytest_django import Settings as SettingsWrapper

State = IdempotencyRecord.State
REDIS_STORE = "idempotency_django.store.redis.RedisStore"
ALIAS = "default"
DOWN_ALIAS = "store"
FINGERPRINT = "3:00000000:" + "a" * 56


def _redis_up(url: str) -> bool:
    try:
        return bool(redis_cluster.connect(url).ping())
    except Exception:
        return False


def _use_redis(settings: SettingsWrapper, url: str, down: bool = False) -> None:
    redis_cluster.flush(url)
    if down:
        host = "redis+cluster://" if url.startswith("redis+cluster://") else "redis://"
        url = f"{host}127.0.0.1:{tools_server.free_port()}/0"
    settings.IDEMPOTENCY = {
        "STORE": REDIS_STORE,
        "STORE_OPTIONS": {"URL": url, "KEY_PREFIX": "contract", "CONNECT_TIMEOUT": 2},
    }


# Each store's fixture: the store, on a service of its own; with ``down``, the same store
# pointed at a server that does not answer (a port nobody listens on), or a skip where
# that cannot be arranged.


def _database(settings: SettingsWrapper, down: bool = False) -> Store:
    settings.IDEMPOTENCY = {"STORE": DEFAULT_STORE}
    store = get_store(DEFAULT_STORE)
    if not down:
        return store
    if connection.vendor not in ("postgresql", "mysql"):
        pytest.skip(f"{connection.vendor}'s test database cannot be made unreachable")
    # The suite's second alias (a store in a database of its own), on a closed port until
    # the test ends (``down``).
    moved = connections[DOWN_ALIAS]
    moved.close()
    moved.settings_dict["HOST"] = "127.0.0.1"
    moved.settings_dict["PORT"] = str(tools_server.free_port())
    return store.bind(DOWN_ALIAS)


def _redis(settings: SettingsWrapper, down: bool = False) -> Store:
    if not _redis_up(REDIS_URL):
        pytest.skip(f"no Redis at {REDIS_URL}")
    _use_redis(settings, REDIS_URL, down)
    return get_store(REDIS_STORE)


def _cluster(settings: SettingsWrapper, down: bool = False) -> Store:
    if not redis_cluster.healthy():
        pytest.skip("no Redis Cluster (python -m tools.redis_cluster start)")
    _use_redis(settings, redis_cluster.cluster_url().replace("redis://", "redis+cluster://"), down)
    return get_store(REDIS_STORE)


#: Every store the contract is checked on: (id, fixture, marks). A new store adds one line.
STORES: list[Any] = [
    pytest.param(_database, id="database"),
    pytest.param(_redis, id="redis", marks=pytest.mark.redis),
    pytest.param(_cluster, id="redis-cluster", marks=pytest.mark.redis_cluster),
]


@pytest.fixture(params=STORES)
def store(
    request: pytest.FixtureRequest, settings: SettingsWrapper, transactional_db: None
) -> Store:
    make: Callable[[SettingsWrapper], Store] = request.param
    return make(settings)


@pytest.fixture(params=STORES)
def down(
    request: pytest.FixtureRequest, settings: SettingsWrapper, transactional_db: None
) -> Iterator[Store]:
    """Each store, pointed at a server that does not answer."""
    make: Callable[..., Store] = request.param
    moved = connections[DOWN_ALIAS]
    saved = {name: moved.settings_dict.get(name) for name in ("HOST", "PORT")}
    try:
        yield make(settings, down=True)
    finally:
        moved.close()
        moved.settings_dict.update(saved)


@dataclass(frozen=True)
class Scope(base.Scope):
    """One key's scope, unique to the test, and what a claim of it writes."""

    def claim(self, token: str, *, lease: float = 30, ttl: float = 3600) -> Write:
        """What ``shell._claim_or_read`` (and a take-over) writes: the scope, the request and the
        claim's times."""
        return Write(
            self,
            token,
            FINGERPRINT,
            timezone.now(),
            timedelta(seconds=lease),
            timedelta(seconds=ttl),
        )

    def take_over(self, token: str, *, lease: float = 30) -> Write:
        """What ``shell._take_over`` writes over a lapsed or expired record."""
        return self.claim(token, lease=lease)


def scope_of(key: str, account: str = "contract", endpoint: str = "POST /charges/") -> Scope:
    return Scope(account, endpoint, key)


def completion(
    status: int = 201, body: bytes | None = b'{"id": "ch_1"}', ttl: float = 3600
) -> Completion:
    return Completion(
        status, [("Location", "/charges/ch_1")], body, timezone.now(), timedelta(seconds=ttl)
    )


@pytest.fixture
def scope() -> Scope:
    return scope_of(f"contract-{uuid.uuid4()}")


def token() -> str:
    return uuid.uuid4().hex


def read(store: Store, scope: Scope) -> ClaimOrRead:
    """The record of ``scope``, read as a losing claim reads it (a claim with a token of its
    own): ``CLAIMED`` when there was none, which the caller must expect."""
    return store.claim_or_read(scope.claim(token()))


def snapshot(store: Store, scope: Scope) -> Snapshot:
    found = read(store, scope)
    assert isinstance(found, Snapshot), f"expected a record, the claim answered {found!r}"
    return found


def until_lapsed(store: Store, scope: Scope) -> Snapshot:
    """Wait until the store's clock has passed the record's lease; the record as read then."""
    seen: list[Snapshot] = []

    def lapsed() -> bool:
        seen[:] = [snapshot(store, scope)]
        return is_lapsed(seen[0], timezone.now())

    assert wait_until(lapsed, timeout=10), "the lease never lapsed on the store's clock"
    return seen[0]


# -- the claim -----------------------------------------------------------------------------


def test_the_first_claim_wins_and_a_second_reads_the_winners_record(
    store: Store, scope: Scope
) -> None:
    first = token()
    assert store.claim_or_read(scope.claim(first)) == CLAIMED
    record = snapshot(store, scope)
    assert (record.state, record.token, record.fingerprint) == (
        State.IN_PROGRESS,
        first,
        FINGERPRINT,
    )
    assert is_in_use(record, timezone.now())
    assert record.response_status is None


def test_a_resent_claim_finds_its_own_record(store: Store, scope: Scope) -> None:
    """A claim whose reply was lost is sent again with the same token: it must come back as
    this claim's (claimed, or the record with its own token), never as another's."""
    mine = token()
    values = scope.claim(mine)
    assert store.claim_or_read(values) == CLAIMED
    again = store.claim_or_read(values)
    assert again == CLAIMED or (isinstance(again, Snapshot) and again.token == mine)


def test_a_key_is_scoped_to_its_account_and_endpoint(store: Store, scope: Scope) -> None:
    """The same key under another account or endpoint is another record: each claim wins,
    and each read answers its own scope's record, never a neighbour's."""
    neighbours = [
        scope,
        scope_of(scope.key, account="someone-else"),
        scope_of(scope.key, endpoint="POST /refunds/"),
    ]
    tokens = [token() for _ in neighbours]
    for each, mine in zip(neighbours, tokens, strict=True):
        assert store.claim_or_read(each.claim(mine)) == CLAIMED
    for each, mine in zip(neighbours, tokens, strict=True):
        assert snapshot(store, each).token == mine


def test_claim_alone_inserts_only_when_the_key_is_absent(store: Store, scope: Scope) -> None:
    assert store.claim(scope.claim(token())) is True
    assert store.claim(scope.claim(token())) is False


def test_of_many_concurrent_claims_exactly_one_wins(store: Store, scope: Scope) -> None:
    if connection.vendor == "sqlite" and store.transactional:
        pytest.skip("SQLite serialises writers in one process: no concurrency to test")
    contenders = 8
    barrier = threading.Barrier(contenders)
    answers: list[ClaimOrRead] = []
    lock = threading.Lock()

    def contend() -> None:
        values = scope.claim(token())
        barrier.wait()
        try:
            answer = store.claim_or_read(values)
        finally:
            connection.close()
        with lock:
            answers.append(answer)

    threads = [threading.Thread(target=contend) for _ in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(answers) == contenders
    assert answers.count(CLAIMED) == 1
    winners = {answer.token for answer in answers if isinstance(answer, Snapshot)}
    assert len(winners) <= 1  # every loser read the one winner's record (or a race: None)


# -- completion, fenced ----------------------------------------------------------------------


def test_only_the_claims_token_completes_it_and_the_outcome_reads_back(
    store: Store, scope: Scope
) -> None:
    mine = token()
    assert store.claim_or_read(scope.claim(mine)) == CLAIMED
    assert store.complete(scope, token(), completion()) is False
    assert store.is_completed(scope, mine) is False
    assert store.complete(scope, mine, completion()) is True
    assert store.is_completed(scope, mine) is True
    record = snapshot(store, scope)
    assert (record.state, record.response_status) == (State.COMPLETED, 201)
    stored = record.stored or store.read_stored(record.pk)
    assert stored is not None
    assert (stored.status, stored.body) == (201, b'{"id": "ch_1"}')
    assert ("Location", "/charges/ch_1") in stored.headers


def test_a_resent_completion_is_not_a_lost_one(store: Store, scope: Scope) -> None:
    """A completion sent again after its reply was lost: either it succeeds again, or
    ``is_completed`` says the first one did; the lifecycle takes both as stored."""
    mine = token()
    assert store.claim_or_read(scope.claim(mine)) == CLAIMED
    assert store.complete(scope, mine, completion()) is True
    again = store.complete(scope, mine, completion())
    assert again or store.is_completed(scope, mine)


def test_a_completion_without_a_body_reads_back_as_not_stored(store: Store, scope: Scope) -> None:
    mine = token()
    assert store.claim_or_read(scope.claim(mine)) == CLAIMED
    assert store.complete(scope, mine, completion(body=None)) is True
    record = snapshot(store, scope)
    stored = record.stored or store.read_stored(record.pk)
    assert stored is not None
    assert (stored.status, stored.body) == (201, None)


# -- release, fenced -------------------------------------------------------------------------


def test_only_the_claims_token_releases_it_and_the_key_is_free_again(
    store: Store, scope: Scope
) -> None:
    mine = token()
    assert store.claim_or_read(scope.claim(mine)) == CLAIMED
    assert store.release(scope, token()) == 0
    assert snapshot(store, scope).token == mine
    assert store.release(scope, mine) == 1
    assert store.claim_or_read(scope.claim(token())) == CLAIMED


def test_a_completed_record_is_not_released(store: Store, scope: Scope) -> None:
    mine = token()
    assert store.claim_or_read(scope.claim(mine)) == CLAIMED
    assert store.complete(scope, mine, completion()) is True
    assert store.release(scope, mine) == 0
    assert snapshot(store, scope).state == State.COMPLETED


# -- leases: renewal, lapse, take-over -------------------------------------------------------


def test_renewal_extends_only_the_claims_own_lease(store: Store, scope: Scope) -> None:
    mine = token()
    assert store.claim_or_read(scope.claim(mine, lease=5)) == CLAIMED
    before = snapshot(store, scope).lease_expires_at
    assert store.renew([(scope, token())], 60, 5) == 0
    unchanged = snapshot(store, scope).lease_expires_at
    assert before is not None
    assert unchanged is not None
    # read back onto this process's clock: equal but for the clocks' offset, read each time
    assert abs(unchanged - before) < timedelta(seconds=1)
    assert store.renew([(scope, mine)], 60, 5) == 1
    after = snapshot(store, scope).lease_expires_at
    assert after is not None
    assert after - before > timedelta(seconds=30)


def test_a_completed_record_is_not_renewed(store: Store, scope: Scope) -> None:
    mine = token()
    assert store.claim_or_read(scope.claim(mine)) == CLAIMED
    assert store.complete(scope, mine, completion()) is True
    assert store.renew([(scope, mine)], 60, 5) == 0


def test_a_live_lease_is_never_taken_over(store: Store, scope: Scope) -> None:
    mine = token()
    assert store.claim_or_read(scope.claim(mine)) == CLAIMED
    record = snapshot(store, scope)
    assert store.take_over(record, scope.take_over(token())) is False
    assert snapshot(store, scope).token == mine


def test_a_lapsed_lease_is_taken_over_once_and_fences_its_first_owner(
    store: Store, scope: Scope
) -> None:
    first = token()
    assert store.claim_or_read(scope.claim(first, lease=0.05)) == CLAIMED
    lapsed = until_lapsed(store, scope)
    second, third = token(), token()
    assert store.take_over(lapsed, scope.take_over(second)) is True
    # another contender that read the same lapsed record loses
    assert store.take_over(lapsed, scope.take_over(third)) is False
    record = snapshot(store, scope)
    assert record.token == second
    assert is_in_use(record, timezone.now())
    # the first owner, back from its pause, can neither complete, release nor renew
    assert store.complete(scope, first, completion()) is False
    assert store.is_completed(scope, first) is False
    assert store.release(scope, first) == 0
    assert store.renew([(scope, first)], 60, 5) == 0
    assert store.complete(scope, second, completion()) is True


def test_a_take_over_fails_when_the_record_changed_since_it_was_read(
    store: Store, scope: Scope
) -> None:
    """A take-over names the record it read: if that claim was released and another request
    claimed the key since (its lease lapsed too), the take-over must not take that other
    request's record, which may owe this one a 422."""
    first = token()
    assert store.claim_or_read(scope.claim(first, lease=0.05)) == CLAIMED
    read_then = until_lapsed(store, scope)
    assert store.release(scope, first) == 1
    other = token()
    assert store.claim_or_read(scope.claim(other, lease=0.05)) == CLAIMED
    assert until_lapsed(store, scope).token == other
    assert store.take_over(read_then, scope.take_over(token())) is False
    assert snapshot(store, scope).token == other


def test_a_renewed_lease_does_not_lapse(store: Store, scope: Scope) -> None:
    """Renewed before it lapses, a short lease holds: the record read after the first
    lease's end is still in use (the heartbeat's whole purpose)."""
    mine = token()
    assert store.claim_or_read(scope.claim(mine, lease=1)) == CLAIMED
    assert store.renew([(scope, mine)], 60, 5) == 1
    first_end = timezone.now() + timedelta(seconds=1)
    assert wait_until(lambda: timezone.now() > first_end, timeout=5)
    record = snapshot(store, scope)
    assert record.token == mine
    assert is_in_use(record, timezone.now())
    assert store.take_over(record, scope.take_over(token())) is False


# -- expiry ----------------------------------------------------------------------------------


def test_an_expired_record_counts_as_absent(store: Store, scope: Scope) -> None:
    """Past its TTL, a completed record is either gone (Redis expires it) or read as expired
    and taken over (the database store; the purge deletes it later)."""
    mine = token()
    assert store.claim_or_read(scope.claim(mine)) == CLAIMED
    assert store.complete(scope, mine, completion(ttl=0.05)) is True
    answers: list[ClaimOrRead] = []

    def gone_or_expired() -> bool:
        answers[:] = [read(store, scope)]
        found = answers[0]
        return found == CLAIMED or (
            isinstance(found, Snapshot) and is_expired(found, timezone.now())
        )

    assert wait_until(gone_or_expired, timeout=10), "the record never expired"
    found = answers[0]
    if isinstance(found, Snapshot):
        # read as expired: taken over, or gone by the time of the take-over (Redis deletes
        # an expired key itself), when a claim wins it outright
        taken = store.take_over(found, scope.take_over(token()))
        assert taken or read(store, scope) == CLAIMED


def test_an_expired_ttl_never_frees_a_record_under_a_live_lease(store: Store, scope: Scope) -> None:
    """The TTL counts for nothing while a claim is in use: its view may be running."""
    mine = token()
    assert store.claim_or_read(scope.claim(mine, ttl=0.05)) == CLAIMED
    ttl_end = timezone.now() + timedelta(seconds=0.05)
    assert wait_until(lambda: timezone.now() > ttl_end + timedelta(seconds=0.2), timeout=5)
    record = snapshot(store, scope)
    assert record.token == mine
    assert not is_expired(record, timezone.now())
    assert store.take_over(record, scope.take_over(token())) is False


# -- concurrency: of many take-overs, one wins -----------------------------------------------


def test_of_many_concurrent_take_overs_of_one_lapsed_record_exactly_one_wins(
    store: Store, scope: Scope
) -> None:
    if connection.vendor == "sqlite" and store.transactional:
        pytest.skip("SQLite serialises writers in one process: no concurrency to test")
    assert store.claim_or_read(scope.claim(token(), lease=0.05)) == CLAIMED
    lapsed = until_lapsed(store, scope)
    contenders = 8
    barrier = threading.Barrier(contenders)
    won: list[str] = []
    lock = threading.Lock()

    def contend() -> None:
        mine = token()
        barrier.wait()
        try:
            taken = store.take_over(lapsed, scope.take_over(mine))
        finally:
            connection.close()
        if taken:
            with lock:
                won.append(mine)

    threads = [threading.Thread(target=contend) for _ in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(won) == 1
    assert snapshot(store, scope).token == won[0]


# -- the failure kinds -----------------------------------------------------------------------


@pytest.mark.django_db(transaction=True, databases=[ALIAS, DOWN_ALIAS])
def test_every_call_on_a_store_that_does_not_answer_is_an_unreachable_failure(
    down: Store, scope: Scope
) -> None:
    """A store that cannot be reached raises one of its ``errors`` on every call, each
    classified ``unreachable`` (the one kind that may fail open), and is not ``usable``."""
    calls: dict[str, Callable[[], Any]] = {
        "claim_or_read": lambda: down.claim_or_read(scope.claim(token())),
        "claim": lambda: down.claim(scope.claim(token())),
        "complete": lambda: down.complete(scope, token(), completion()),
        "is_completed": lambda: down.is_completed(scope, token()),
        "release": lambda: down.release(scope, token()),
        "renew": lambda: down.renew([(scope, token())], 60, 5),
    }
    kinds: dict[str, str] = {}
    for name, call in calls.items():
        try:
            call()
        except down.errors as error:
            kinds[name] = down.failure_kind(error)
        down.reset()
    assert kinds == dict.fromkeys(calls, "unreachable")
    assert down.usable() is False


def test_a_claim_that_waits_on_a_concurrent_transactions_claim_is_contention(
    store: Store, scope: Scope
) -> None:
    """A store whose claims live in the work's transaction (``transactional``): a duplicate
    claim blocked by another transaction's uncommitted claim of the key, past its bounded
    wait, fails as ``contention`` (a request in flight: 409), never ``unreachable``."""
    if not store.transactional:
        pytest.skip(f"{type(store).__name__}: no claim waits on a transaction")
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no row locks to wait on")
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                assert store.claim_or_read(scope.claim(token())) == CLAIMED
                held.set()
                release.wait(20)
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(20)
        with (
            pytest.raises(store.errors) as raised,
            transaction.atomic(),
            base.lock_wait(store, 0.2),
        ):
            store.claim_or_read(scope.claim(token()))
        assert store.failure_kind(raised.value) == "contention"
    finally:
        release.set()
        holder.join()


# -- the model: the engine over this store follows the decision table ------------------------


@pytest.mark.usefixtures("fake_clock")
def test_the_engine_follows_the_decision_table_on_this_store(store: Store) -> None:
    """The stateful model test (tests/test_stateful.py) run on each store, with fewer
    examples than there (where it runs on the suite's store at length)."""
    run_state_machine_as_test(
        stateful.EngineMachine,
        settings=hypothesis.settings(stateful.STATEFUL_SETTINGS, max_examples=25),
    )


# -- the interface the docs show -------------------------------------------------------------


def _members(protocol: type) -> dict[str, str]:
    """A protocol's members: each method's signature, each attribute's annotation."""
    found = {
        name: str(inspect.signature(value)) if callable(value) else "property"
        for name, value in vars(protocol).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }
    for name, annotation in vars(protocol).get("__annotations__", {}).items():
        found.setdefault(name, str(annotation))
    return found


def test_the_docs_show_the_whole_store_interface() -> None:
    """docs/stores.md ("Writing another store") shows ``store_interface.Store``: the same
    members as ``base.Store``, each method with the same signature."""
    shown, real = _members(store_interface.Store), _members(base.Store)
    assert shown.keys() == real.keys()
    for name, signature in real.items():
        if signature != "property":
            assert shown[name] == signature, name
