"""Mutation check: break each guarantee on purpose, and require a test to notice.

Coverage says a line ran, not that a test would fail if the line were wrong. Each mutant
below is one small edit that breaks a promise of docs/guarantees.md (the invariant above
all: one execution per key, never a 2xx for work that did not commit); the tests named with
it must fail when it is applied. A mutant that survives is a gap in the suite.

The edits are applied one at a time to a temporary copy of the working tree (the files
``git ls-files -co --exclude-standard`` lists), never to the checkout itself, and the
tests run there on PostgreSQL::

    python .ci/mutants.py --database-url postgres://root@127.0.0.1:5432/mutants

``--full`` is the weekly run: each mutant faces the whole suite instead of its named tests,
so its verdict no longer depends on the list naming the right tests, and the score is the
suite's. The end-to-end tests (marker ``e2e``: gunicorn, uvicorn, a browser) are left out:
they reach the package through real servers, are slow and the likeliest to flake under
load, and a promise only they would guard wants an in-process test anyway. With ``-x`` and
the mutant's named tests first (same verdict, a different order), a killed mutant is over
in the time of one collection (about 40 s); only a survivor runs everything. On two cores
shared with other work, 52 mutants took 47 minutes, 15 of them the unmutated run::

    nohup python .ci/mutants.py --full --database-url postgres://root@127.0.0.1:5432/mutants \\
        > mutants-full.log 2>&1 &

``--jobs 2`` checks two mutants side by side, each job in a copy of its own with databases of
its own (the URL's name plus ``_1``, ...): on two cores that is CI's setting. The mutants
whose tests use Redis (one server, throwaway servers on fixed ports, the local cluster that
tests kill and reshard), and those whose tests run on the Redis store (``store="redis"``:
IDEMPOTENCY_TEST_STORE=redis, on db 6 of the local Redis or MUTANTS_REDIS_URL) all go to the
first job, so no two such tests ever overlap.

Exit status: 0 every mutant killed, 1 a mutant survived (or its run errored), 2 the check
could not run (a snippet not found exactly once, the tests failing unmutated, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest


@dataclass(frozen=True)
class Mutant:
    id: str
    breaks: str  # the guarantee it breaks, in one line
    file: str  # under idempotency_django/
    original: str  # must occur exactly once in the file
    replacement: str
    tests: tuple[str, ...]  # pytest node ids or files, under tests/
    # "redis": its tests run on the Redis store (IDEMPOTENCY_TEST_STORE=redis, REDIS_STORE)
    store: str = "database"


# The Redis store mutants' tests run with the Redis store as the default store, on a Redis
# database of their own (flushed per test): db 6 of the local Redis unless MUTANTS_REDIS_URL
# says otherwise.
REDIS_STORE = {
    "IDEMPOTENCY_TEST_STORE": "redis",
    "IDEMPOTENCY_TEST_REDIS_URL": os.environ.get("MUTANTS_REDIS_URL", "redis://127.0.0.1:6379/6"),
}
STORE_ENV: dict[str, dict[str, str]] = {"database": {}, "redis": REDIS_STORE}


DEC = "test_decorators.py::"
ATOM = "test_lifecycle.py::"
HOT = "test_store_hot_path.py::"
PREP = "test_store_prepared.py::"
REDIS = "test_redis_store.py::"
FP = "test_fingerprints.py::"
CUSTOM_FP = FP + "TestCustomFingerprintSetting::"
KEYED = FP + "TestKeyedFingerprints::"
SCOPES = "test_scopes.py::"
CELERY = "test_celery.py::"
UNKNOWN = "test_unknown_outcomes.py::"
RCLUSTER = "test_store_redis_cluster.py::"
RFAIL = "test_redis_failures.py::"
ROUTAGE = "test_redis_cluster_outage.py::"
RLOGIC = "test_redis_store_logic.py::"
STATEFUL = "test_stateful.py::"
EXH = "test_exhaustion.py::"
EVICT = "test_redis_eviction.py::"
REPLAYED = "test_replay_headers.py::"
EXPOSED = "test_admin_exposure.py::"
REDIRECTS = "test_client_redirects.py::"
DURATIONS = "test_durations.py::"
ENCRYPTION = "test_codecs_encryption.py::"
CLOCK = "test_clock_skew.py::"
REPLICAS = "test_redis_replicas.py::"
FAILURES = "test_store_failures.py::"
SENTINEL = "test_redis_sentinel.py::"

MUTANTS = [
    Mutant(
        "release-deletes-completed",
        "a late release (its first reply lost) deletes the completed record: the key reruns",
        "store/database.py",
        "            f\"AND {column['state']} = '{State.IN_PROGRESS.value}'\"\n        ),",
        "            f\"AND {column['state']} IS NOT NULL\"\n        ),",
        (
            "test_lifecycle.py::test_a_late_release_never_deletes_a_completed_record",
            HOT + "test_completion_and_release_are_fenced_by_the_token",
        ),
    ),
    Mutant(
        "too-many-connections-fails-open",
        "a store database with no connection to spare (53300) fails open: views run unprotected",
        "store/database.py",
        '    if any(word in message for word in _EXHAUSTED_WORDS):\n        return "other"',
        '    if False:\n        return "other"',
        (
            "test_store_failures.py::test_a_store_database_with_no_connection_to_spare_never_fails_open",
        ),
    ),
    Mutant(
        "fail-open-setting-unwarned",
        "ON_STORE_ERROR 'open' in the setting passes without W031",
        "checks.py",
        '    if isinstance(user, dict) and user.get("ON_STORE_ERROR") == "open":',
        "    if False:",
        ("test_checks.py::test_w030_fail_open_in_the_setting",),
    ),
    Mutant(
        "fail-open-view-unwarned",
        "a view's own on_store_error='open' passes without W031",
        "checks.py",
        '        if policy == "open":\n            name =',
        "        if False:\n            name =",
        ("test_checks.py::test_w030_fail_open_on_a_view_of_its_own",),
    ),
    Mutant(
        "reseal-says-0-were-never-stored",
        "the reseal summary counts records without a stored response when there are none",
        "management/commands/reseal_idempotency_responses.py",
        "    if result.skipped:",
        "    if True:",
        ("test_codecs_encryption.py::test_reseal_with_everything_readable_writes_no_warning",),
    ),
    Mutant(
        "ninja-warned-with-the-views-advice",
        "ninja under ATOMIC_REQUESTS is told to use non_atomic_requests, which cannot reach it",
        "core/transactions.py",
        '    if "ninja" in label or label.startswith("IdempotentRouter"):',
        "    if False:",
        (
            "test_ninja.py::"
            "test_under_atomic_requests_the_operation_runs_once_in_the_request_transaction",
        ),
    ),
    Mutant(
        "purge-cursor-first-row",
        "the purge's next page starts after its first row, not its last: rows counted twice",
        "store/database.py",
        "    last_pk, last_order = raw_rows[-1]",
        "    last_pk, last_order = raw_rows[0]",
        ("test_purge.py::test_pages_continue_after_their_last_row_through_ties_in_the_expiry",),
    ),
    Mutant(
        "prepared-ignores-the-connection",
        "statements prepared although OPTIONS leave prepare_threshold unset: poolers break",
        "store/database.py",
        '"prepare_threshold", None) is None:\n        return connection.cursor()',
        '"prepare_threshold", None) is None:\n        raw.prepare_threshold = 0',
        (PREP + "test_without_a_threshold_nothing_is_prepared",),
    ),
    Mutant(
        "prepared-never",
        "the hot path never prepared, even where the connection allows it",
        "store/database.py",
        '"prepare_threshold", None) is None:\n        return connection.cursor()',
        '"prepare_threshold", None) is None or True:\n        return connection.cursor()',
        (PREP + "test_with_a_threshold_the_claim_and_the_completion_are_prepared",),
    ),
    Mutant(
        "prepared-cursor-unwrapped",
        "the prepared cursor bypasses Django: psycopg errors reach the engine untranslated",
        "store/database.py",
        "    return connection.make_cursor(cursor)",
        "    return cursor",
        (PREP + "test_errors_are_django_errors_and_statements_are_seen_by_execute_wrappers",),
    ),
    Mutant(
        "takeover-ignores-lease",
        "take_over no longer re-checks the lease: a claim renewed since the read is stolen",
        "store/database.py",
        ".filter(expired_q(now) | lapsed_q(now), pk=record.pk, token=record.token)",
        ".filter(pk=record.pk, token=record.token)",
        (HOT + "test_a_lease_renewed_between_the_read_and_the_take_over_is_not_taken_over",),
    ),
    Mutant(
        "engine-live-lease-lapsed",
        "the engine treats a live lease as lapsed and tries to take it over",
        "core/decisions.py",
        "lapsed = is_lapsed(record, now)",
        "lapsed = record.state == State.IN_PROGRESS",
        (
            "test_decisions.py",
            "test_query_budget.py::test_an_in_flight_conflict_costs_what_a_replay_costs",
        ),
    ),
    Mutant(
        "completion-unfenced",
        "completion no longer fenced by the claim's token: a lost claim overwrites the new owner",
        "store/database.py",
        "AND {column['token']} = %s AND {column['state']} = %s\"",
        "AND %s IS NOT NULL AND {column['state']} = %s\"",
        (DEC + "test_claim_lost_completion_does_not_overwrite_the_new_owner",),
    ),
    Mutant(
        "lost-claim-read-ignores-endpoint",
        "PostgreSQL's claim-or-read reads ignoring the endpoint: another endpoint's record answers",
        "store/database.py",
        'f"WHERE {where_key} AND NOT EXISTS (SELECT 1 FROM ins)"',
        '"WHERE " + where_key.replace(\n'
        "            column['endpoint'] + ' = %s', '(' + column['endpoint'] + ' = %s OR TRUE)'\n"
        '            ) + " AND NOT EXISTS (SELECT 1 FROM ins)"',
        (
            DEC + "test_a_retry_is_answered_with_its_own_endpoints_record",
            HOT + "test_a_claim_that_waited_reads_its_own_endpoints_row_not_another_endpoints",
        ),
    ),
    Mutant(
        "lost-claim-read-ignores-account",
        "PostgreSQL's claim-or-read reads ignoring the account: one user's retry gets another's",
        "store/database.py",
        'f"WHERE {where_key} AND NOT EXISTS (SELECT 1 FROM ins)"',
        '"WHERE " + where_key.replace(\n'
        "            column['account'] + ' = %s', '(' + column['account'] + ' = %s OR TRUE)'\n"
        '            ) + " AND NOT EXISTS (SELECT 1 FROM ins)"',
        (DEC + "test_two_accounts_with_one_key_are_independent",),
    ),
    Mutant(
        "read-ignores-endpoint",
        "the read after a lost claim (MariaDB's, PostgreSQL's after a wait) ignores the endpoint",
        "store/database.py",
        "read = f\"SELECT {', '.join(selected)} FROM {table} WHERE {where_key}\"",
        "read = f\"SELECT {', '.join(selected)} FROM {table} WHERE \" + where_key.replace(\n"
        "        column['endpoint'] + ' = %s', '(' + column['endpoint'] + ' = %s OR TRUE)'\n"
        "    )",
        (HOT + "test_a_claim_that_waited_reads_its_own_endpoints_row_not_another_endpoints",),
    ),
    Mutant(
        "claim-always-succeeds",
        "the claim reports success on a conflict: every duplicate runs the view",
        "store/database.py",
        "        if row[0]:\n            return CLAIMED",
        "        if row is not None:\n            return CLAIMED",
        (DEC + "test_retry_replays_status_body_and_allowed_headers",),
    ),
    Mutant(
        "account-constant",
        "the account is dropped from the scope: one user's key replays another's response",
        "core/protect.py",
        "account=keys.fit(account, ACCOUNT_MAX_LENGTH)",
        'account=keys.fit("everyone", ACCOUNT_MAX_LENGTH)',
        (DEC + "test_two_accounts_with_one_key_are_independent",),
    ),
    Mutant(
        "anonymous-accepted",
        "anonymous requests get an account (all of them the same one)",
        "core/keys.py",
        "if user is None or not user.is_authenticated:",
        "if user is None:",
        (
            DEC + "test_anonymous_requests_are_refused_and_cannot_read_stored_responses",
            "test_keys.py::test_default_account_is_none_for_a_principal_that_is_not_authenticated",
        ),
    ),
    Mutant(
        "atomic-requests-dropped",
        "ATOMIC_REQUESTS transactions are not given back: the view's work loses its transaction",
        "core/transactions.py",
        "def to_reopen(self) -> list[str]:\n        return _atomic_requests(",
        "def to_reopen(self) -> list[str]:\n        return [] if True else _atomic_requests(",
        ("test_transactions.py",),
    ),
    Mutant(
        "store-transaction-never",
        "under ATOMIC_REQUESTS the completion is written after the commit, not inside it",
        "core/shell.py",
        "self._store_transaction = self.store.transactional and self.alias in self.reopen",
        "self._store_transaction = False",
        (ATOM + "test_atomic_requests_completion_lost_is_a_503_and_the_retry_runs_once",),
    ),
    Mutant(
        "expired-in-use",
        "an in-progress record past its TTL counts as absent (taken over, purged) while it runs",
        "store/base.py",
        "return Q(expires_at__lte=now if expired_by is None else expired_by) & ~in_use_q(now)",
        "return Q(expires_at__lte=now if expired_by is None else expired_by)",
        (ATOM + "test_the_purge_agrees_with_the_engine_on_a_live_lease",),
    ),
    Mutant(
        "engine-expired-in-use",
        "the engine counts a running record past its TTL as absent",
        "core/decisions.py",
        "return record.expires_at <= now and not is_in_use(record, now)",
        "return record.expires_at <= now",
        (ATOM + "test_a_live_lease_is_never_taken_over_whatever_the_ttl",),
    ),
    Mutant(
        "contention-fails-open",
        "a lock timeout (a concurrent duplicate) counts as an unreachable store: fails open",
        "store/database.py",
        'if sqlstate in _PG_CONTENTION:\n            return "contention"',
        'if sqlstate in _PG_CONTENTION:\n            return "unreachable"',
        (ATOM + "test_a_lock_timeout_on_a_duplicate_is_a_409_even_when_failing_open",),
    ),
    Mutant(
        "any-error-fails-open",
        "any store error fails open when ON_STORE_ERROR is 'open', not only an unreachable store",
        "core/decisions.py",
        'policy = on_store_error if kind == "unreachable" else "closed"',
        "policy = on_store_error",
        (DEC + "test_a_store_that_answers_with_an_error_fails_closed_even_when_open",),
    ),
    Mutant(
        "release-on-lost-connection",
        "a view that lost its database connection releases its key (its work may have committed)",
        "core/shell.py",
        "if outcome_unknown(error):\n            # Releasing would",
        "if False:\n            # Releasing would",
        ("test_store_failures.py::test_a_view_whose_connection_died_keeps_its_key",),
    ),
    Mutant(
        "release-on-interface-error",
        "a view failing with InterfaceError releases its key (its work may have committed)",
        "core/decisions.py",
        "    if isinstance(error, InterfaceError):\n        return True\n",
        "",
        (
            UNKNOWN + "test_a_view_that_lost_its_connection_keeps_its_key_until_its_lease_lapses"
            "[decorator-InterfaceError]",
            UNKNOWN + "test_a_task_that_lost_its_connection_keeps_its_key_until_its_lease_lapses"
            "[InterfaceError]",
        ),
    ),
    Mutant(
        "framework-answer-releases",
        "a lost connection answered by DRF's or ninja's exception handler releases the key",
        "core/protect.py",
        "if unknown is not None:\n            return shell.Outcome(None, unknown=unknown)",
        "if False:\n            return shell.Outcome(None, unknown=unknown)",
        (
            UNKNOWN + "test_a_view_that_lost_its_connection_keeps_its_key_until_its_lease_lapses"
            "[drf-mixin-handler-answers-InterfaceError]",
            UNKNOWN + "test_a_view_that_lost_its_connection_keeps_its_key_until_its_lease_lapses"
            "[ninja-handler-answers-OperationalError]",
        ),
    ),
    Mutant(
        "store-commits-first",
        "the store's transaction commits before the work's: a stored 201 for work rolled back",
        "core/shell.py",
        "self._transactions.open(sorted(self.reopen, key=lambda alias: alias != self.alias))",
        "self._transactions.open(sorted(self.reopen, key=lambda alias: alias == self.alias))",
        (
            "test_separate_store.py::test_under_both_request_transactions_the_work_commits_before_the_store",
        ),
    ),
    Mutant(
        "store-commit-failure-releases",
        "the store's COMMIT failing after the work's committed releases the key: a retry reruns it",
        "core/shell.py",
        "committed = isinstance(failure, CommitFailed) and bool(failure.committed)",
        "committed = False",
        (
            "test_separate_store.py::"
            "test_a_store_commit_that_fails_after_the_work_committed_keeps_the_key_on_every_backend",
        ),
    ),
    Mutant(
        "work-not-committed-as-unavailable",
        "a commit refused for the work's own reason is a 503 that clients retry forever",
        "core/shell.py",
        "        if isinstance(failure, CommitFailed):\n            return Refused(\n",
        "        if False:\n            return Refused(\n",
        ("test_separate_store.py::test_work_that_fails_to_commit_is_never_replayed_as_a_success",),
    ),
    Mutant(
        "client-retries-work-not-committed",
        "the client retries a work-not-committed problem where its policy retries the status",
        "client/http.py",
        "        if is_final_problem(response):\n            return False\n",
        "",
        ("test_client.py::test_work_not_committed_is_final_even_where_its_status_is_retried",),
    ),
    Mutant(
        "statement-timeout-in-flight",
        "a claim that hits statement_timeout is told 409 in flight for a key nobody holds",
        "store/database.py",
        '_PG_CONTENTION = frozenset({"40001", "40P01", "55P03"})',
        '_PG_CONTENTION = frozenset({"40001", "40P01", "55P03", "57014"})',
        (
            "test_store_failures.py::test_a_claim_that_times_out_on_a_locked_table_is_a_503_and_signalled",
        ),
    ),
    Mutant(
        "prepared-refusal-not-retried",
        "a prepared statement the server refuses is not sent again unprepared: completions lost",
        "store/database.py",
        "        if not _prepared_statement_refused(connection, error):\n            raise\n",
        "        raise\n",
        (
            PREP + "test_a_completion_whose_prepared_statement_the_server_forgot_is_stored",
            PREP + "test_a_column_type_changed_under_prepared_statements_costs_no_request",
        ),
    ),
    Mutant(
        "task-release-on-lost-connection",
        "a task that lost its database connection releases its key (its work may have committed)",
        "adapters/tasks.py",
        "if exc is not None:\n            protected.fail(exc)",
        "if exc is not None:\n            protected.fail(Exception(exc))",
        ("test_store_failures.py::test_a_task_whose_connection_died_keeps_its_key",),
    ),
    Mutant(
        "purge-in-use",
        "the purge deletes expired records whose view is still running",
        "operations/purge.py",
        "expired = expired_q(now, expired_by=cutoff)",
        "expired = Q(expires_at__lte=cutoff)",
        ("test_purge.py::test_a_record_whose_view_still_runs_is_kept_even_past_its_ttl",),
    ),
    Mutant(
        "oldest-expired-counts-in-use",
        "the purge lag counts a record whose view still runs past its TTL: a lag the purge "
        "cannot clear, so the health check fails for good",
        "store/database.py",
        '            .filter(expired_q(DatabaseNow()))\n            .order_by("expires_at")',
        '            .filter(expires_at__lte=DatabaseNow())\n            .order_by("expires_at")',
        (
            "test_purge.py::"
            "test_oldest_expired_is_the_expiry_of_the_oldest_record_the_purge_would_delete",
        ),
    ),
    Mutant(
        "health-ok-when-store-down",
        "the health check answers 200 while the store refuses connections",
        "operations/health.py",
        '        return False, _failure(store, error, timeout, detail, "the store"), None',
        '        return True, _failure(store, error, timeout, detail, "the store"), None',
        (
            "test_health.py::"
            "test_a_store_that_refuses_connections_answers_503_without_its_error_text",
            "test_health.py::test_the_command_exits_1_with_the_json_when_the_store_is_down",
        ),
    ),
    Mutant(
        "health-store-unbounded",
        "the health check's round trip has no time bound: a stalled store hangs the probe",
        "store/database.py",
        '        return _statement_timeout(self.alias, timeout, verb="SELECT")',
        "        return suppress()",
        ("test_health.py::test_a_store_that_stalls_fails_within_the_timeout",),
    ),
    Mutant(
        "health-purge-lag-ignored",
        "the health check passes however long ago the oldest expired record expired",
        "operations/health.py",
        "    if lag > max_lag:",
        "    if lag > max_lag * 1000:",
        ("test_health.py::test_a_purge_lag_over_the_threshold_answers_503_until_the_purge_runs",),
    ),
    Mutant(
        "health-late-heartbeat-alive",
        "a heartbeat whose renewals fail counts as alive while its thread runs",
        "core/heartbeat.py",
        "        return self.renewing == 0 or (self.thread_alive and self.late == 0)",
        "        return self.renewing == 0 or self.thread_alive",
        ("test_health.py::test_a_heartbeat_whose_renewals_fail_is_late_and_fails",),
    ),
    Mutant(
        "overview-without-permission",
        "the admin overview is shown to staff without the records' view permission",
        "operations/admin.py",
        "        if not self.has_view_permission(request):\n            raise PermissionDenied",
        "        if False:\n            raise PermissionDenied",
        ("test_admin_overview.py::test_the_overview_needs_the_view_permission",),
    ),
    Mutant(
        "overview-counts-the-table",
        "the overview's counts read the whole range (a COUNT(*) of millions of rows per panel)",
        "operations/overview.py",
        "    found = queryset.order_by()[: COUNT_LIMIT + 1].count()",
        "    found = queryset.order_by().count()",
        ("test_admin_overview.py::test_counts_stop_at_their_limit_and_say_more_than",),
    ),
    Mutant(
        "overview-lapsed-in-flight",
        "the overview counts lapsed claims as in flight",
        "operations/overview.py",
        "    live = records.filter(in_use_q(DatabaseNow()))",
        "    live = records.filter(state=State.IN_PROGRESS)",
        ("test_admin_overview.py::test_the_overview_shows_every_panel",),
    ),
    Mutant(
        "purge-stops-after-one-batch",
        "the purge stops after its first full batch: the rest of the expired records stay",
        "operations/purge.py",
        "            if len(pks) < room:\n                break",
        "            if len(pks) <= room:\n                break",
        ("test_purge.py::test_deletes_in_batches_by_primary_key_each_re_checking_the_expiry",),
    ),
    Mutant(
        "purge-stale-live",
        "the purge counts live leases as stale in-progress records",
        "operations/purge.py",
        "lease_expires_at__lt=DatabaseNow(-stale_after),",
        "lease_expires_at__lt=DatabaseNow(stale_after),",
        ("test_purge.py::test_stale_in_progress_records_are_purged_and_counted_apart",),
    ),
    Mutant(
        "admin-release-live",
        "the admin's release deletes keys whose lease is live",
        "operations/admin.py",
        "released = _delete_returning(queryset.filter(lapsed_q(DatabaseNow())))",
        "released = _delete_returning(queryset.filter(_in_progress()))",
        ("test_admin.py::test_release_skips_a_key_whose_lease_is_live",),
    ),
    Mutant(
        "database-on-the-app-clock",
        "the database store writes and compares leases with each app server's clock: one "
        "that runs ahead takes a live lease over",
        "store/database.py",
        '_OWN_CLOCK = ("postgresql", "mysql")',
        "_OWN_CLOCK: tuple[str, ...] = ()",
        (CLOCK + "test_a_server_whose_clock_runs_ahead_never_takes_over_a_live_lease",),
    ),
    Mutant(
        "read-not-moved-to-the-app-clock",
        "a record read on the database's clock is compared with the app's as it is: a server "
        "ahead reads a live lease as lapsed",
        "store/database.py",
        "        if self.own_clock:\n            shift = timezone.now() - values[-1]",
        "        if False:\n            shift = timezone.now() - values[-1]",
        (CLOCK + "test_a_record_read_by_a_skewed_server_is_moved_onto_its_clock",),
    ),
    Mutant(
        "takeover-on-the-app-clock",
        "the take-over re-checks and writes the lease on the app's clock: a server ahead takes "
        "a live lease, one behind writes a lease already lapsed",
        "store/database.py",
        "        if has_own_clock(connections[alias]):\n            now = DatabaseNow()",
        "        if False:\n            now = DatabaseNow()",
        (
            CLOCK + "test_the_store_refuses_a_take_over_of_a_live_lease_from_a_server_ahead",
            CLOCK + "test_a_take_over_by_a_server_whose_clock_runs_behind_is_live_for_the_others",
        ),
    ),
    Mutant(
        "purge-on-the-app-clock",
        "the purge tells in use and expired by its own server's clock: one ahead deletes a "
        "live claim past its TTL",
        "operations/purge.py",
        "    now = DatabaseNow()\n    cutoff = DatabaseNow(-older_than)",
        "    from django.utils import timezone\n\n    now = timezone.now()\n"
        "    cutoff = now - older_than",
        (
            CLOCK
            + "test_the_purge_on_a_server_whose_clock_runs_ahead_keeps_a_live_claim_past_its_ttl",
        ),
    ),
    Mutant(
        "admin-release-on-the-app-clock",
        "the admin's release tells a lapsed lease by the admin server's clock: one ahead "
        "releases a live key",
        "operations/admin.py",
        "released = _delete_returning(queryset.filter(lapsed_q(DatabaseNow())))",
        "released = _delete_returning(queryset.filter(lapsed_q(database_store.timezone.now())))",
        ("test_admin.py::test_release_by_a_server_whose_clock_runs_ahead_skips_a_live_lease",),
    ),
    Mutant(
        "retry-after-ignores-the-lease",
        "a 409 in flight says RETRY_AFTER_SECONDS for the whole of a dead worker's lease",
        "core/shell.py",
        "retry_after=in_flight_retry_after(\n"
        "                    record, now, lease=options.lease, retry_after=options.retry_after\n"
        "                ),",
        "retry_after=options.retry_after,",
        (DEC + "test_an_in_flight_409_says_how_long_is_left_of_a_lease_that_missed_its_renewals",),
    ),
    Mutant(
        "retry-after-for-a-live-lease",
        "a 409 for a lease renewed on schedule says the whole lease, not RETRY_AFTER_SECONDS",
        "core/decisions.py",
        "    if left > lease / 2:",
        "    if left > lease:",
        (DEC + "test_an_in_flight_409_says_how_long_is_left_of_a_lease_that_missed_its_renewals",),
    ),
    Mutant(
        "retry-after-below-the-setting",
        "a 409 for a lease about to lapse says less than RETRY_AFTER_SECONDS",
        "core/decisions.py",
        "    return max(retry_after, math.ceil(left))",
        "    return math.ceil(left)",
        (DEC + "test_an_in_flight_409_says_how_long_is_left_of_a_lease_that_missed_its_renewals",),
    ),
    Mutant(
        "admin-counts-the-table",
        "the admin's list counts every record (seconds at 10M rows)",
        "operations/admin.py",
        "    paginator = BoundedPaginator\n",
        "",
        ("test_admin.py::test_the_changelist_never_counts_or_distincts_the_table",),
    ),
    Mutant(
        "admin-distinct-filter",
        "the admin's endpoint filter offers a DISTINCT over the whole table",
        "operations/admin.py",
        '("endpoint", RecentValuesListFilter),',
        '"endpoint",',
        ("test_admin.py::test_the_changelist_never_counts_or_distincts_the_table",),
    ),
    Mutant(
        "heartbeat-register-noop",
        "the heartbeat never renews: register() forgets the claim",
        "core/heartbeat.py",
        "self._entries[claim.token] = _Entry(claim, lease, stop, claim.since)",
        "_Entry(claim, lease, stop, claim.since)",
        ("test_heartbeat.py::test_a_beat_renews_every_registered_claim_in_one_statement",),
    ),
    Mutant(
        "heartbeat-unfenced",
        "the heartbeat renews a record by scope, not by token: it keeps a new owner's lease alive",
        "store/database.py",
        "renew_owned=f\"({where_key} AND {column['token']} = %s)\"",
        'renew_owned=f"({where_key} AND %s IS NOT NULL)"',
        ("test_heartbeat.py::test_a_beat_never_renews_a_claim_that_was_taken_over",),
    ),
    Mutant(
        "release-unfenced",
        "a release no longer fenced by the claim's token: a lost claim deletes the new owner's",
        "store/database.py",
        "f\"DELETE FROM {table} WHERE {where_key} AND {column['token']} = %s \"",
        'f"DELETE FROM {table} WHERE {where_key} AND %s IS NOT NULL "',
        (
            DEC + "test_claim_lost_completion_does_not_overwrite_the_new_owner",
            # the new owner still in progress: the state fence alone would not save it
            HOT + "test_completion_and_release_are_fenced_by_the_token",
        ),
    ),
    Mutant(
        "unknown-commit-released",
        "a COMMIT whose answer was lost releases the key: the retry redoes committed work",
        "core/shell.py",
        "unknown = committed or (isinstance(failure, CommitFailed) and outcome_unknown(error))",
        "unknown = committed",
        (
            ATOM + "test_a_commit_whose_outcome_is_unknown_is_a_503_and_keeps_the_key",
            ATOM + "test_a_commit_whose_answer_is_lost_is_a_503_and_the_retry_gets_the_replay",
        ),
    ),
    Mutant(
        "completion-failure-swallowed",
        "a completion that fails inside the work's transaction is answered as a success",
        "core/shell.py",
        "        except (_StoreError, CommitFailed) as failure:\n",
        "        except _StoreError:\n"
        "            return None\n"
        "        except CommitFailed as failure:\n",
        (ATOM + "test_atomic_mode_completion_lost_with_the_connection_is_a_503_not_a_201",),
    ),
    Mutant(
        "commit-failure-swallowed",
        "a COMMIT that fails is answered as a success",
        "core/transactions.py",
        "except DatabaseError as error:\n"
        "            raise CommitFailed(error, self._committed) from error",
        "except DatabaseError:\n            return",
        ("test_separate_store.py::test_work_that_fails_to_commit_is_never_replayed_as_a_success",),
    ),
    Mutant(
        "mismatch-undetected",
        "fingerprints always match: a key reused with another body replays the first response",
        "core/fingerprint.py",
        "    if stored == current:\n        return True\n",
        "    return True\n",
        (DEC + "test_key_reused_with_another_body_is_422_and_runs_nothing",),
    ),
    Mutant(
        "lapsed-mismatch-taken-over",
        "a lapsed lease is taken over by a different request instead of answering 422",
        "core/decisions.py",
        "if expired or (lapsed and matches):",
        "if expired or lapsed:",
        (
            "test_decisions.py",
            DEC + "test_lapsed_lease_with_another_body_is_still_422",
        ),
    ),
    Mutant(
        "fingerprint-ignores-body",
        "the fingerprint ignores the body",
        "core/fingerprint.py",
        "body_part = canonical_body(request, fields)",
        'body_part = b""',
        (DEC + "test_key_reused_with_another_body_is_422_and_runs_nothing",),
    ),
    Mutant(
        "fingerprint-ignores-query",
        "the fingerprint ignores the query string",
        "core/fingerprint.py",
        '_canonical_query(request.META.get("QUERY_STRING", "")),',
        'b"",',
        (DEC + "test_key_reused_with_another_query_string_is_422",),
    ),
    Mutant(
        "completed-runs-again",
        "a completed key runs the view again instead of replaying",
        "core/shell.py",
        "        if decision == REPLAY:\n",
        "        if decision == REPLAY:\n"
        "            return Claim(scope, token, options.alias, options.ttl)\n",
        (DEC + "test_retry_replays_status_body_and_allowed_headers",),
    ),
    Mutant(
        "in-flight-runs",
        "a duplicate of a request still running runs the view too (in-flight policy ignored)",
        "core/shell.py",
        "assert decision == IN_FLIGHT",
        "return Claim(scope, token, options.alias, options.ttl)",
        (DEC + "test_in_flight_duplicate_gets_409_with_retry_after",),
    ),
    Mutant(
        "any-in-progress-is-ours",
        "any in-progress record is taken for this request's own unacknowledged claim",
        "core/decisions.py",
        "if record.token == token and is_in_use(record, now):",
        "if is_in_use(record, now):",
        (
            "test_decisions.py",
            DEC + "test_in_flight_duplicate_gets_409_with_retry_after",
        ),
    ),
    Mutant(
        "own-lapsed-claim-kept-lapsed",
        "a claim retried with its own token keeps a lapsed lease (a duplicate can take it)",
        "core/decisions.py",
        "if record.token == token and is_in_use(record, now):",
        "if record.token == token and record.state == State.IN_PROGRESS:",
        (
            "test_decisions.py",
            ATOM + "test_a_claim_retried_with_its_own_token_after_its_lease_lapsed_renews_it",
        ),
    ),
    Mutant(
        "5xx-stored",
        "a 5xx is stored instead of releasing the key",
        "core/responses.py",
        "return 400 <= status < 500 and status not in TRANSIENT_CLIENT_ERRORS",
        "return 400 <= status < 600 and status not in TRANSIENT_CLIENT_ERRORS",
        (DEC + "test_5xx_response_releases_the_key",),
    ),
    Mutant(
        "set-cookie-stored",
        "Set-Cookie is stored and replayed to whoever holds the key",
        "core/responses.py",
        '        "set-cookie",\n        "set-cookie2",\n',
        '        "set-cookie2",\n',
        (
            "test_responses.py::test_capture_never_keeps_per_connection_or_auth_headers",
            "test_responses.py::test_replay_drops_them_from_a_record_stored_before_they_were_forbidden",
        ),
    ),
    Mutant(
        "malformed-key-accepted",
        "a bare key with non-visible-ASCII characters is accepted",
        "core/keys.py",
        "if error is None and not quoted and not _VISIBLE_ASCII.fullmatch(key):",
        "if False:",
        (DEC + "test_malformed_key_is_400_and_runs_nothing",),
    ),
    Mutant(
        "ttl-from-claim",
        "the TTL counts from the claim, not from the completion",
        "core/shell.py",
        "        duration(claim.ttl),\n    )",
        # counted from the claim: the view's run comes off it
        "        duration(claim.ttl and claim.ttl - (time.monotonic() - claim.since)),\n    )",
        (ATOM + "test_the_ttl_counts_from_completion",),
    ),
    Mutant(
        "atomic-failure-committed",
        "atomic mode: a 5xx or exception commits its work instead of rolling it back",
        "core/shell.py",
        "# that a retry starts clean.\n"
        "                            self._transactions.roll_back([self.alias])\n",
        "# that a retry starts clean.\n",
        ("test_transactions.py::test_atomic_mode_5xx_rolls_back_the_work_and_the_claim",),
    ),
    Mutant(
        "drf-rollback-ignored",
        "a rollback DRF's exception handler asked for is ignored",
        "core/shell.py",
        "elif not self._transactions.failed(self.alias):",
        "elif True:",
        (ATOM + "test_drf_under_atomic_requests_stores_a_validation_error_without_warnings",),
    ),
    Mutant(
        "disconnect-releases",
        "a client that disconnects cancels the view mid-flight (ON_DISCONNECT 'finish' ignored)",
        "core/shell.py",
        'if policy.on_disconnect == "finish":',
        "if False:",
        ("test_async.py::test_a_disconnected_request_finishes_and_its_retry_gets_the_replay",),
    ),
    Mutant(
        "async-capture-unshielded",
        "a cancel after the work returned, while its outcome is captured, releases the key",
        "core/shell.py",
        "outcome, late = await _outliving_cancellation(_in_thread(record, value))",
        "outcome, late = await _in_thread(record, value)(), None",
        (
            "test_async.py::test_a_disconnect_while_the_response_renders_stores_it_and_the"
            "_retry_replays_it",
            "test_async.py::test_a_disconnect_as_the_view_returns_stores_its_outcome[release]",
            "test_ninja.py::test_an_async_operation_cancelled_as_it_returns_stores_its_response"
            "[release]",
            "test_middleware.py::test_under_asgi_an_async_view_cancelled_as_it_returns_stores"
            "_its_response[release]",
        ),
    ),
    Mutant(
        "async-finished-work-taken-for-cancelled",
        "work that returned as the cancel came is taken for cancelled work: the key released",
        "core/shell.py",
        "            if task.cancelled():",
        "            if task.done():",
        (
            "test_async.py::test_a_disconnect_as_the_view_returns_stores_its_outcome[finish]",
            "test_ninja.py::test_an_async_operation_cancelled_as_it_returns_stores_its_response"
            "[finish]",
            "test_middleware.py::test_under_asgi_an_async_view_cancelled_as_it_returns_stores"
            "_its_response[finish]",
        ),
    ),
    Mutant(
        "async-cancelled-claim-kept",
        "a claim whose request was cancelled before the work began is kept: 409 for minutes",
        "core/shell.py",
        "if started is None and protected.claimed:",
        "if started is None and protected.claimed and False:",
        ("test_async.py::test_a_disconnect_while_the_key_is_claimed_releases_the_claim",),
    ),
    Mutant(
        "view-options-unchecked",
        "per-view arguments are no longer validated when the view is decorated",
        "core/options.py",
        "    def __post_init__(self) -> None:\n",
        "    def __post_init__(self) -> None:\n        return\n",
        (ATOM + "test_idempotent_validates_every_argument_naming_the_view",),
    ),
    Mutant(
        "mixin-placement-unchecked",
        "IdempotentMixin after the DRF view class (protecting nothing) is accepted",
        "adapters/drf.py",
        "if views.APIView in mro and mro.index(views.APIView) < mro.index(IdempotentMixin):",
        "if False:",
        (ATOM + "test_the_mixin_after_the_drf_view_is_refused_at_class_creation",),
    ),
    Mutant(
        "middleware-claims-drf-before-auth",
        "the middleware claims DRF views itself, before DRF authenticates the caller",
        "adapters/middleware.py",
        "return _Plan(_DRF, options=options, exempt_methods=exempt)",
        "return _Plan(_PLAIN, options=options, exempt_methods=exempt)",
        ("test_middleware.py::test_drf_views_are_scoped_to_the_token_user",),
    ),
    Mutant(
        "middleware-skips-urlconf-decorators",
        "the middleware runs a DRF view without the decorator a URLconf wrapped around it",
        "adapters/middleware.py",
        "            _mark_for_drf(request, view, plan.options)\n"
        "            if iscoroutinefunction(view):\n"
        "                return async_to_sync(call_view)()",
        "            _mark_for_drf(request, view, plan.options)\n"
        "            view = __import__('inspect').unwrap(view)\n"
        "            call_view = functools.partial(view, request, *args, **kwargs)\n"
        "            if iscoroutinefunction(view):\n"
        "                return async_to_sync(call_view)()",
        (
            "test_middleware.py::test_a_decorator_wrapped_around_a_drf_view_in_the_urlconf_refuses_keyed_requests",
            "test_middleware.py::test_a_decorator_wrapped_around_a_drf_view_runs_on_every_request",
        ),
    ),
    Mutant(
        "middleware-skips-urlconf-decorators-asgi",
        "under ASGI, the middleware runs a DRF view without the decorator a URLconf wrapped",
        "adapters/middleware.py",
        "            if iscoroutinefunction(view):\n                return await call_view()",
        "            view = __import__('inspect').unwrap(view)\n"
        "            call_view = functools.partial(view, request, *args, **kwargs)\n"
        "            if iscoroutinefunction(view):\n"
        "                return await call_view()",
        (
            "test_middleware.py::test_under_asgi_a_decorator_wrapped_around_a_drf_view_refuses",
            "test_middleware.py::test_under_asgi_a_decorator_wrapped_around_a_drf_view_runs_on_every_request",
        ),
    ),
    Mutant(
        "middleware-drf-mark-ignored",
        "a DRF view the middleware marked runs without a claim",
        "adapters/drf.py",
        "        if mark is None or isinstance(self, IdempotentMixin) or _handler(self, request) "
        "is None:",
        "        if True:",
        (
            "test_middleware.py::test_drf_views_are_scoped_to_the_token_user",
            "test_middleware.py::test_under_asgi_a_drf_view_is_scoped_after_drf_auth",
        ),
    ),
    Mutant(
        "hidden-drf-view-unchecked",
        "a decorator that hides a DRF view from the middleware passes the system checks",
        "checks.py",
        "            if isinstance(cls, type) and issubclass(cls, APIView):",
        "            if False:",
        (
            "test_middleware_checks.py::test_a_decorator_that_hides_a_drf_view_from_the_middleware_is_an_error",
        ),
    ),
    Mutant(
        "middleware-protects-twice",
        "a view protected by its own decorator is claimed by the middleware: its options lost",
        "adapters/middleware.py",
        'if _marked(view, "idempotent_view") or _has_protected_method(cls):',
        "if False:",
        (
            "test_middleware.py::test_a_decorated_view_is_protected_once",
            "test_middleware.py::test_a_decorated_view_keeps_its_own_options_under_the_middleware",
        ),
    ),
    Mutant(
        "middleware-ignores-atomic-requests",
        "the middleware runs the view outside the ATOMIC_REQUESTS transaction",
        "adapters/middleware.py",
        "request_transactions=request_transactions(view)",
        "request_transactions=()",
        (
            "test_middleware.py::test_under_atomic_requests_a_view_that_raises_after_writing_commits_nothing",
        ),
    ),
    Mutant(
        "unreadable-replayed-as-garbage",
        "a stored response the codec cannot open is replayed as it is stored",
        "core/codecs.py",
        "        raise unreadable from error",
        "        return stored",
        (
            "test_codecs.py::test_a_sealed_record_the_codec_cannot_open_is_a_409_never_garbage_never_a_rerun",
        ),
    ),
    Mutant(
        "admin-shows-plaintext-to-all",
        "the admin shows decrypted bodies to staff without the permission",
        "operations/admin.py",
        "conf.RESPONSE_CODEC is None or request.user.has_perm(DECRYPT_PERMISSION)",
        "True",
        ("test_admin.py::test_staff_without_the_permission_read_encrypted",),
    ),
    Mutant(
        "middleware-claims-ninja-before-auth",
        "the middleware claims django-ninja views before ninja authenticates the caller",
        "adapters/middleware.py",
        'if getattr(view, "__module__", None) == _NINJA_VIEWS:',
        "if False:",
        ("test_ninja.py::test_the_middleware_leaves_ninja_operations_to_the_adapter",),
    ),
    Mutant(
        "custom-fingerprint-not-namespaced",
        "a project's FINGERPRINT value is stored bare: readable, and 100:EUR reads as a version",
        "core/protect.py",
        "                else keys.custom_fingerprint(fingerprint)",
        "                else str(fingerprint)",
        (
            CUSTOM_FP + "test_another_amount_with_the_key_is_422_not_a_replay",
            KEYED + "test_a_custom_value_is_never_stored_as_it_is",
        ),
    ),
    Mutant(
        "custom-fingerprint-reads-as-a-version",
        "any N: prefix counts as a library version: a stored 100:EUR matches any fingerprint",
        "core/fingerprint.py",
        '_VERSIONED = re.compile(r"([1-9][0-9]{0,8}):[0-9a-f]{64}")',
        '_VERSIONED = re.compile(r"([0-9]{1,9}):.*")',
        ("test_fingerprints.py::test_custom_fingerprints_match_only_the_same_value",),
    ),
    Mutant(
        "custom-fingerprint-namespace-unchecked",
        "a namespaced stored value is unwrapped again: the custom value x matches custom:x",
        "core/fingerprint.py",
        "    if named is not None:\n        return named == value_digest\n",
        "",
        (
            "test_fingerprints.py::test_a_custom_value_matches_the_forms_earlier_releases_stored_it_in",
        ),
    ),
    Mutant(
        "custom-fingerprint-previous-release-lost",
        "a custom fingerprint an earlier release stored as it was no longer matches: a 422",
        "core/fingerprint.py",
        '    return stored == "sha256:" + value_digest or _sha256(stored) == value_digest',
        "    return False",
        (CUSTOM_FP + "test_a_record_an_earlier_release_stored_still_matches",),
    ),
    Mutant(
        "endpoint-slash-twins-apart",
        "one route's path with and without its trailing slash are two endpoints: two runs",
        "core/keys.py",
        '    return path + "/" if same_route else path',
        "    return path",
        (
            DEC + "test_a_retry_that_differs_only_in_the_trailing_slash_is_replayed",
            "test_drf.py::test_a_retry_that_differs_only_in_the_trailing_slash_is_replayed",
        ),
    ),
    Mutant(
        "endpoint-slash-any-twin",
        "a path's slash twin shares its endpoint even when it routes to another view",
        "core/keys.py",
        "    same_route = twin.func == match.func and",
        "    same_route = True or twin.func == match.func and",
        (
            DEC + "test_routes_a_slash_apart_keep_their_own_keys",
            DEC + "test_other_arguments_of_one_route_keep_their_own_keys",
        ),
    ),
    Mutant(
        "endpoint-slash-less-form",
        "the shared endpoint is written without the slash: records stored before are lost",
        "core/keys.py",
        '    if match is None or path.endswith("/"):\n        return path\n',
        '    if match is None:\n        return path\n    if path.endswith("/"):\n'
        '        return path[:-1] if resolve(request.path_info[:-1] or "/").func == match.func'
        " else path\n",
        (DEC + "test_a_record_stored_under_the_previous_endpoint_format_is_replayed",),
    ),
    Mutant(
        "key-comma-accepted",
        "a key may hold a comma: two header lines joined by a server are one key",
        "core/wire.py",
        '    if "," in key:',
        "    if False:",
        (
            DEC + "test_two_key_header_lines_are_400_and_run_nothing",
            "test_async.py::test_two_key_header_lines_are_400_and_run_nothing",
            "test_keys.py::test_parse_key_rejects_malformed",
        ),
    ),
    Mutant(
        "key-pattern-disagrees",
        "the published key pattern allows a comma the parser refuses",
        "core/wire.py",
        'KEY_CHARACTER = r"[\\x21-\\x2b\\x2d-\\x7e]"',
        'KEY_CHARACTER = r"[\\x21-\\x7e]"',
        ("test_keys.py::test_parse_key_accepts_exactly_the_published_pattern",),
    ),
    Mutant(
        "celery-store-unavailable-not-retried",
        "a Celery task refused by an unreachable store fails and is acked: the work is dropped",
        "adapters/celery.py",
        "        except (TaskInFlight, TaskStoreUnavailable) as exc:",
        "        except TaskInFlight as exc:",
        (
            RFAIL + "test_a_celery_task_is_retried_through_a_cluster_outage_and_runs_once_after_it",
            CELERY + "test_worker_retries_through_a_store_outage_and_runs_once_after_it",
        ),
    ),
    Mutant(
        "celery-eager-retry-recurses",
        "apply() or task_always_eager under a store outage retries at once until RecursionError",
        "adapters/celery.py",
        "            if self.request.is_eager:",
        "            if False:",
        (CELERY + "test_apply_under_a_store_outage_gives_the_refusal_instead_of_recursing",),
    ),
    Mutant(
        "celery-in-flight-not-retried",
        "a Celery duplicate that finds its key in flight fails instead of replaying the result",
        "adapters/celery.py",
        "        except (TaskInFlight, TaskStoreUnavailable) as exc:",
        "        except TaskStoreUnavailable as exc:",
        (CELERY + "test_worker_runs_eight_duplicate_messages_once",),
    ),
    Mutant(
        "celery-acks-early",
        "a Celery message is acked before its task ran: a worker killed mid-task loses it",
        "adapters/celery.py",
        "    acks_late = True",
        "    acks_late = False",
        (CELERY + "test_worker_killed_mid_task_reruns_once_and_only_after_the_lease",),
    ),
    Mutant(
        "multipart-body-never-read-first",
        "a multipart body is parsed from its stream: a view reading request.body fails (500)",
        "core/fingerprint.py",
        "    if 0 <= length <= limit:",
        "    if length < 0:",
        (
            "test_fingerprints.py::TestViewsThatReadTheBody::"
            "test_a_multipart_view_reading_the_raw_body_runs_once_and_is_replayed",
        ),
    ),
    Mutant(
        "multipart-body-always-read-first",
        "an upload over DATA_UPLOAD_MAX_MEMORY_SIZE is read whole first: refused, not streamed",
        "core/fingerprint.py",
        "    if 0 <= length <= limit:",
        "    if 0 <= length:",
        (
            "test_fingerprints.py::TestViewsThatReadTheBody::"
            "test_an_upload_above_the_body_limit_is_streamed_and_reaches_request_files",
        ),
    ),
    Mutant(
        "sealed-binding-unchecked",
        "a sealed response copied into another account's record is replayed to that account",
        "core/codecs.py",
        "    if not hmac.compare_digest(binding, record.binding()):",
        "    if False:",
        (
            "test_codecs_encryption.py::"
            "test_a_sealed_response_copied_into_another_record_is_refused_never_replayed",
        ),
    ),
    Mutant(
        "reseal-leaves-unbound",
        "the reseal command writes unbound frames: a swap of a resealed record replays",
        "core/codecs.py",
        "    sealed = _sealed(codec, opened, record)",
        "    sealed = SEALED_UNBOUND + codec.encode(_frame(opened))",
        (
            "test_codecs_encryption.py::"
            "test_reseal_binds_responses_sealed_before_binding_so_a_swap_is_refused",
        ),
    ),
    Mutant(
        "ninja-validates-before-the-claim",
        "ninja's 422 for invalid input is not stored, unlike DRF's 400: a correction reruns",
        "adapters/ninja.py",
        "        operation._get_values = _deferred(operation._get_values)",
        "",
        (
            "test_ninja.py::"
            "test_a_validation_failure_is_stored_and_the_corrected_body_needs_a_new_key",
        ),
    ),
    Mutant(
        "enabled-truthy",
        'ENABLED read as truthy: 0, None or "" (an unset variable) switches protection off',
        "conf.py",
        'return self.get("ENABLED") is not False',
        'return bool(self.get("ENABLED"))',
        ("test_conf.py::test_a_falsy_non_bool_enabled_keeps_the_view_protected",),
    ),
    Mutant(
        "stored-headers-after-the-work",
        "a bad STORED_HEADERS is met only by the capture, after the view: the key is released "
        "and the retry runs the view again",
        "core/options.py",
        'conf.checked("STORED_HEADERS")  # read after the work',
        'conf.get("STORED_HEADERS")  # read after the work',
        ("test_conf.py::test_a_setting_its_check_refuses_fails_the_request_before_the_view_runs",),
    ),
    Mutant(
        "on-disconnect-unchecked",
        'an unknown ON_DISCONNECT reaches the lifecycle, which treats it as "release"',
        "core/options.py",
        'on_disconnect=str(checked("on_disconnect")),',
        'on_disconnect=str(conf.get("ON_DISCONNECT")),',
        ("test_conf.py::test_a_setting_its_check_refuses_fails_the_request_before_the_view_runs",),
    ),
    Mutant(
        "view-ttl-below-lease",
        "a view's ttl_seconds below its lease is accepted, as the setting is not",
        "conf.py",
        "and ttl not in (None, _INVALID) and ttl < lease:",
        "and ttl not in (None, _INVALID) and ttl < 0:",
        (
            "test_conf.py::test_a_views_ttl_or_max_run_below_its_lease_is_refused_naming_the_view",
            "test_conf.py::test_a_drf_views_ttl_below_the_lease_is_refused_at_class_creation",
        ),
    ),
    Mutant(
        "methods-typo-accepted",
        'METHODS = ["GETT"] is accepted: every POST runs unprotected',
        "conf.py",
        "unknown = [method for method in value if method.upper() not in HTTP_METHODS]",
        "unknown = [method for method in value if not method]",
        ("test_conf.py::test_the_middleware_refuses_a_methods_setting_that_protects_nothing",),
    ),
    Mutant(
        "checks-need-root-urlconf",
        "a worker's settings without ROOT_URLCONF crash the checks, so no command starts",
        "checks.py",
        '    if not getattr(settings, "ROOT_URLCONF", None):\n        return\n',
        "",
        ("test_checks.py::test_check_passes_without_root_urlconf",),
    ),
    Mutant(
        "nested-claims-again",
        "an inner @idempotent of the request's own scope claims again: 409 forever",
        "core/protect.py",
        "        with _inner(held, guard.scope):\n            return call_view()\n",
        "        pass\n",
        (
            "test_middleware.py::test_an_inner_idempotent_layer_runs_once_under_the_middlewares_claim",
        ),
    ),
    Mutant(
        "nested-claims-again-async",
        "an inner async @idempotent of the request's own scope claims again: 409 forever",
        "core/protect.py",
        "        with _inner(held, guard.scope):\n            return await call_view()\n",
        "        pass\n",
        (
            "test_middleware.py::test_under_asgi_an_inner_idempotent_layer_runs_once_under_the_middlewares_claim",
        ),
    ),
    Mutant(
        "nested-runs-twice",
        "a view calling an @idempotent function twice under one claim does the work twice",
        "core/protect.py",
        "        held[scope] = True\n",
        "        pass\n",
        ("test_middleware.py::test_a_second_inner_call_under_one_claim_is_refused",),
    ),
    Mutant(
        "middleware-starts-before-process-view",
        "the middleware starts before CsrfViewMiddleware: a keyed POST without a token is served",
        "adapters/middleware.py",
        "        _refuse_unsafe_position(type(self))\n",
        "",
        (
            "test_middleware_checks.py::test_the_server_refuses_to_start_before_a_middleware_with_process_view",
            "test_middleware_checks.py::test_a_keyed_post_without_a_csrf_token_is_never_served",
        ),
    ),
    Mutant(
        "middleware-leaves-plain-ninja",
        "a plain django-ninja operation under the middleware runs unprotected",
        "adapters/middleware.py",
        "    request.__dict__[UNDER_MIDDLEWARE] = True",
        "    request.__dict__[UNDER_MIDDLEWARE] = False",
        ("test_ninja.py::test_the_middleware_protects_a_plain_operation_after_ninjas_auth",),
    ),
    Mutant(
        "ninja-protected-without-middleware",
        "once the middleware has seen a ninja operation, it is protected without the middleware",
        "adapters/ninja.py",
        "        if request.__dict__.get(UNDER_MIDDLEWARE):\n"
        "            return protected(request, **values)",
        "        if True:\n            return protected(request, **values)",
        ("test_ninja.py::test_without_the_middleware_the_operation_is_as_ninja_made_it",),
    ),
    Mutant(
        "drf-misspelling-accepted",
        "a misspelled idempotency_* attribute on a DRF view is ignored without a word",
        "adapters/drf.py",
        "        if unknown:\n            raise ImproperlyConfigured(",
        "        if False:\n            raise ImproperlyConfigured(",
        ("test_drf.py::test_a_misspelled_idempotency_attribute_is_refused_at_class_creation",),
    ),
    Mutant(
        "contract-problem-type-closed",
        "the published problem type is an enum of the app's types: a view's own problem fails",
        "core/contract.py",
        '                "format": "uri-reference",\n',
        '                "format": "uri-reference",\n                "enum": types,\n',
        ("test_openapi.py::test_a_views_own_problem_types_validate",),
    ),
    Mutant(
        "contract-view-problem-schema-replaced",
        "the view's own problem+json schema for a status is replaced by the app's",
        "core/contract.py",
        '        theirs["schema"] = {"anyOf": [theirs["schema"], mine["schema"]]}',
        '        theirs["schema"] = mine["schema"]',
        ("test_openapi.py::test_a_views_own_problem_schema_is_kept_beside_the_apps",),
    ),
    Mutant(
        "contract-replay-header-not-on-problem-statuses",
        "a view's stored 400 or 422 is replayed with a header its schema does not document",
        "core/contract.py",
        "        if code.isdigit() and stored(int(code)):",
        "        if code.isdigit() and stored(int(code)) and int(code) not in PROBLEMS:",
        ("test_openapi.py::test_every_stored_status_documents_the_replay_header",),
    ),
    Mutant(
        "contract-replay-header-ignores-store-statuses",
        "the replay header is documented on statuses STORE_STATUSES never stores",
        "core/contract.py",
        "        if code.isdigit() and stored(int(code)):",
        '        if code.isdigit() and code[0] in "234" and code != "409":',
        ("test_openapi.py::test_the_replay_header_follows_store_statuses",),
    ),
    Mutant(
        "key-pattern-quoted-unbounded",
        "the published pattern lets a quoted key longer than the parser's limit through",
        "core/wire.py",
        '{_QUOTED_CHARACTER}{{1,{KEY_MAX_LENGTH}}}")$',
        '{_QUOTED_CHARACTER}+")$',
        (
            "test_keys.py::test_parse_key_accepts_exactly_the_published_schema",
            "test_openapi.py::test_the_published_key_schema_accepts_what_the_server_accepts",
        ),
    ),
    Mutant(
        "key-pattern-bare-quote-first",
        "the published pattern lets a bare value start with a quote, which the parser refuses",
        "core/wire.py",
        r'rf"^(?:[\x21\x23-\x2b\x2d-\x7e]{KEY_CHARACTER}',
        r'rf"^(?:{KEY_CHARACTER}{KEY_CHARACTER}',
        (
            "test_keys.py::test_parse_key_accepts_exactly_the_published_schema",
            "test_openapi.py::test_the_published_key_schema_accepts_what_the_server_accepts",
        ),
    ),
    Mutant(
        "openapi-mixin-docstring-described",
        "IdempotentMixin's docstring becomes the description of every undocumented DRF operation",
        "adapters/openapi.py",
        "                return _view_doc(self.view.__class__)",
        "                return description",
        ("test_openapi.py::test_the_mixins_docstring_describes_no_operation",),
    ),
    Mutant(
        "drf-options-never-rebuilt",
        "the DRF mixin keeps its first options after a class attribute changed",
        "adapters/drf.py",
        "if cached is not None and cached[0] == custom and cached[1] == values:",
        "if cached is not None:",
        ("test_drf.py::test_one_options_per_class_until_a_class_attribute_changes",),
    ),
    Mutant(
        "drf-ignores-non-atomic-requests",
        "the DRF mixin reopens a request transaction its author opted out of",
        "adapters/drf.py",
        "reopen = request_transactions(None) if transactions is None else transactions.to_reopen()",
        "reopen = request_transactions(None)",
        (
            "test_protect.py::"
            "test_a_protected_view_runs_in_the_request_transactions_its_author_kept",
        ),
    ),
    Mutant(
        "middleware-drf-drops-non-atomic-requests",
        "the middleware's DRF view forgets its author's non_atomic_requests opt-out",
        "adapters/middleware.py",
        "mark_for_middleware(request, MiddlewareMark(options, request_transactions(view)))",
        "mark_for_middleware(request, MiddlewareMark(options, request_transactions(None)))",
        ("test_protect.py::test_under_the_middleware_too",),
    ),
    Mutant(
        "task-ttl-none-uses-the-setting",
        "a task's (or a DRF view's) ttl_seconds=None takes the TTL_SECONDS setting instead "
        "of keeping keys forever",
        "core/options.py",
        "if value is not _UNSET and (value is not None or accepted[name].nullable)",
        "if value is not _UNSET and value is not None",
        ("test_adapters_agree.py::test_ttl_seconds_none_keeps_the_key_forever_in_every_adapter",),
    ),
    Mutant(
        "async-atomic-accepted",
        "an async view in atomic mode is declared, and silently runs in commit mode",
        "core/options.py",
        'if self.mode == "atomic":',
        "if False:",
        ("test_adapters_agree.py::test_an_async_view_in_atomic_mode_is_refused_when_declared",),
    ),
    Mutant(
        "too-big-stored",
        "a response or task result over max_response_bytes is stored with its body all the same",
        "core/decisions.py",
        "return body is not None and len(body) <= max_response_bytes",
        "return body is not None",
        (
            "test_tasks.py::test_a_result_over_max_response_bytes_completes_without_it",
            "test_adapters_agree.py::"
            "test_a_views_max_response_bytes_overrides_the_setting_in_every_adapter",
        ),
    ),
    Mutant(
        "own-max-response-bytes-ignored",
        "a view's or task's own max_response_bytes is ignored for the MAX_RESPONSE_BYTES setting",
        "core/options.py",
        'max_response_bytes=int(checked("max_response_bytes")),',
        'max_response_bytes=int(conf.checked("MAX_RESPONSE_BYTES")),',
        (
            "test_adapters_agree.py::"
            "test_a_views_max_response_bytes_overrides_the_setting_in_every_adapter",
            "test_adapters_agree.py::test_a_tasks_max_response_bytes_overrides_the_setting",
        ),
    ),
    Mutant(
        "protect-claims-every-method",
        "protect() claims a key for a method (or with ENABLED off) that its options leave alone",
        "core/protect.py",
        "    if not options.protects(request.method):\n        return unprotected(",
        "    if False:\n        return unprotected(",
        (
            DEC + "test_safe_methods_are_not_protected",
            DEC + "test_disabled_switch_turns_protection_off",
        ),
    ),
    Mutant(
        "aprotect-claims-every-method",
        "aprotect() claims a key for a method (or with ENABLED off) that its options leave alone",
        "core/protect.py",
        "    if not options.protects(request.method):\n        return await call_view()",
        "    if False:\n        return await call_view()",
        (
            "test_ninja.py::"
            "test_an_async_operations_http_error_is_stored_and_the_switch_turns_it_off",
        ),
    ),
    # An outcome, once the work has committed, is stored unless the process dies: a
    # completion the store failed is sent again until the claim's lease may lapse, under a
    # lease the heartbeat keeps renewing, and under WAIT_REPLICAS only what a replica
    # acknowledged is trusted. The Redis tests start servers of their own (a throwaway one,
    # a master and its replica: IDEMPOTENCY_TEST_SCRATCH_PORT, IDEMPOTENCY_TEST_REPLICA_PORT).
    Mutant(
        "completion-not-sent-again",
        "a completion the store failed is given up at once: a stall shorter than the lease "
        "loses the outcome, and a late duplicate runs the work again",
        "core/shell.py",
        "                if pause >= remaining:\n                    raise",
        "                if True:\n                    raise",
        (
            REDIS + "test_a_stall_longer_than_the_socket_timeout_still_stores_the_outcome",
            FAILURES + "test_a_completion_whose_connection_is_killed_again_and_again_is_stored",
        ),
    ),
    Mutant(
        "completion-unregistered-first",
        "the heartbeat forgets the claim before its outcome is stored: its completion is no "
        "longer sent again past the lease its claim was made with",
        "core/shell.py",
        "        try:\n            return self._finish(claim, outcome)",
        "        heartbeat.unregister(claim)\n"
        "        try:\n            return self._finish(claim, outcome)",
        (REDIS + "test_a_view_past_max_run_still_stores_its_outcome_through_a_stall",),
    ),
    Mutant(
        "max-run-forgets-the-claim",
        "past MAX_RUN_SECONDS the heartbeat drops the claim: its completion is cut short of "
        "the lease it was last renewed for",
        "core/heartbeat.py",
        "                self._entries[entry.claim.token] = replace(entry, renewing=False)",
        "                del self._entries[entry.claim.token]",
        (
            REDIS + "test_a_view_past_max_run_still_stores_its_outcome_through_a_stall",
            "test_tasks.py::"
            "test_past_max_run_seconds_the_lease_is_no_longer_renewed_and_a_redelivery_runs",
        ),
    ),
    Mutant(
        "deadline-ignores-the-lease",
        "the completion's deadline is the last renewal itself, not a lease after it: never "
        "sent again",
        "core/heartbeat.py",
        "return None if entry is None else entry.renewed_at + entry.lease",
        "return None if entry is None else entry.renewed_at",
        (REDIS + "test_a_stall_longer_than_the_socket_timeout_still_stores_the_outcome",),
    ),
    Mutant(
        "deadline-ignores-renewals",
        "the completion's deadline counts from the claim, not its last renewal: a view that "
        "ran longer than its lease loses its outcome to a stall",
        "core/heartbeat.py",
        "                if entry is not None and entry.renewed_at < sent:",
        "                if False:",
        (REDIS + "test_a_view_past_max_run_still_stores_its_outcome_through_a_stall",),
    ),
    Mutant(
        "completion-sent-again-past-a-lease",
        "a completion the store keeps failing while it takes the renewals is sent again until "
        "MAX_RUN_SECONDS, not a lease: the answer is held for minutes",
        "core/shell.py",
        "        return min(lapses, started + lease) - lease * LEASE_MARGIN",
        "        return lapses - lease * LEASE_MARGIN",
        (REPLICAS + "test_a_completion_no_replica_acknowledged_within_its_lease_is_signalled",),
    ),
    Mutant(
        "refused-completion-sent-again",
        "a completion the database refuses for its data is sent again until the lease lapses: "
        "the answer held for nothing",
        "core/decisions.py",
        "    return not isinstance(error, (DataError, IntegrityError, ProgrammingError, "
        "NotSupportedError))",
        "    return True",
        (
            UNKNOWN + "test_an_outcome_the_store_refuses_after_the_work_committed_is_signalled"
            "_and_keeps_the_key",
        ),
    ),
    Mutant(
        "lost-reply-ours-without-wait",
        "WAIT_REPLICAS: a claim or take-over whose reply was lost finds its own record and runs "
        "the view, with no replica acknowledging it",
        "store/redis.py",
        "local state, token = header(old)\nif state == 'i' and token == ARGV[1] then\n"
        "  redis.call('SET', KEYS[1], value, 'PX', px)\n  return {1, now}\nend\n",
        "",
        (
            REPLICAS + "test_a_claim_whose_reply_was_lost_is_confirmed_by_a_wait_or_refused",
            REPLICAS + "test_a_take_over_whose_reply_was_lost_is_confirmed_by_a_wait_or_refused",
        ),
    ),
    Mutant(
        "completion-trusted-without-replicas",
        "WAIT_REPLICAS: a completion no replica acknowledged is taken as stored (a failover "
        "loses it, and a late duplicate runs the work again), and nobody is told",
        "store/redis.py",
        "        if acked is not None and acked < wanted:",
        "        if False:",
        (REPLICAS + "test_a_completion_no_replica_acknowledged_within_its_lease_is_signalled",),
    ),
    Mutant(
        "take-over-trusted-without-replicas",
        "WAIT_REPLICAS: a take-over no replica acknowledged runs the view",
        "store/redis.py",
        "        if reply == 1:\n            self._replicated(acked, record.pk",
        "        if False:\n            self._replicated(acked, record.pk",
        (REPLICAS + "test_a_take_over_no_replica_acknowledged_is_refused_and_released",),
    ),
    # The Redis store on a cluster: its tests need the local cluster
    # (python -m tools.redis_cluster start; .ci/run starts it before this check).
    Mutant(
        "cluster-write-without-asking",
        "a claim in a migrating slot is sent to the importing node without ASKING: refused",
        "store/redis_cluster.py",
        '        pipe.execute_command("ASKING")',
        "        pass",
        (RCLUSTER + "test_write_and_wait_follows_ask_during_a_migration",),
    ),
    Mutant(
        "cluster-renewal-drops-redirections",
        "a renewal its node redirects (a slot migrating) is not repeated: the lease lapses",
        "store/redis_cluster.py",
        "        if isinstance(reply, (redis.exceptions.ResponseError, "
        "redis.exceptions.ConnectionError)):",
        "        if False:",
        (RCLUSTER + "test_eval_per_node_follows_a_migration",),
    ),
    Mutant(
        "cluster-renewal-per-claim",
        "the heartbeat renews claim by claim on a cluster: one round trip per claim, not node",
        "store/redis_cluster.py",
        "    for group in by_node(client, range(len(calls)), lambda index: calls[index][0]):",
        "    for group in ([index] for index in range(len(calls))):",
        (RCLUSTER + "test_eval_per_node_is_one_round_trip_per_node",),
    ),
    Mutant(
        "cluster-wait-count-trusted",
        "WAIT's count is ignored: a claim no replica has is taken as replicated",
        "store/redis_cluster.py",
        "    return reply, int(acknowledged)",
        "    return reply, replicas",
        (RCLUSTER + "test_write_and_wait_reports_no_replica_when_it_is_cut_off",),
    ),
    Mutant(
        "wait-replicas-unacknowledged-claim-trusted",
        "WAIT_REPLICAS: a claim no replica acknowledged runs the view (a failover reruns it)",
        "store/redis.py",
        "        if acked is None or acked >= wanted:",
        "        if True:",
        (
            REPLICAS + "test_a_claim_no_replica_acknowledged_is_refused_and_its_view_never_runs",
            "test_redis_cluster.py::test_wait_replicas_refuses_a_claim_that_was_not_replicated",
        ),
    ),
    Mutant(
        "redis-complete-unfenced",
        "the Redis completion is not fenced by the token: a lost claim overwrites the new owner",
        "store/redis.py",
        "local state, token, _, _, _, d = header(old)\nif token ~= ARGV[1] then return 0 end",
        "local state, token, _, _, _, d = header(old)",
        (REDIS + "test_completion_release_and_renewal_are_fenced_by_the_token",),
    ),
    Mutant(
        "redis-release-unfenced",
        "the Redis release deletes whatever record holds the key, not only its own claim's",
        "store/redis.py",
        "if state ~= 'i' or token ~= ARGV[1] then return 0 end\nreturn redis.call('DEL', KEYS[1])",
        "if state ~= 'i' then return 0 end\nreturn redis.call('DEL', KEYS[1])",
        (REDIS + "test_completion_release_and_renewal_are_fenced_by_the_token",),
    ),
    Mutant(
        "redis-release-deletes-completed",
        "a late Redis release (its first reply lost) deletes the completed record: a rerun",
        "store/redis.py",
        "if state ~= 'i' or token ~= ARGV[1] then return 0 end\nreturn redis.call('DEL', KEYS[1])",
        "if token ~= ARGV[1] then return 0 end\nreturn redis.call('DEL', KEYS[1])",
        (
            "test_lifecycle.py::test_a_late_release_never_deletes_a_completed_record",
            REDIS + "test_completion_release_and_renewal_are_fenced_by_the_token",
        ),
        store="redis",
    ),
    Mutant(
        "redis-renew-unfenced",
        "the Redis renewal keeps any in-progress record alive, a new owner's included",
        "store/redis.py",
        "if state == 'i' and token == ARGV[i + 1] then",
        "if state == 'i' then",
        (REDIS + "test_completion_release_and_renewal_are_fenced_by_the_token",),
    ),
    Mutant(
        "redis-takeover-ignores-lease",
        "the Redis take-over no longer checks the lease: a claim renewed since the read is stolen",
        "store/redis.py",
        "if in_use or not (state == 'i' or expired) then return 0 end",
        "if not (state == 'i' or expired) then return 0 end",
        (
            STATEFUL + "test_a_take_over_rechecks_the_record_it_read",
            STATEFUL + "test_the_engine_follows_the_decision_table",
            REDIS + "test_a_lease_renewed_between_the_read_and_the_take_over_is_not_taken_over",
        ),
        store="redis",
    ),
    # The stateful model test on the Redis store (records aged on Redis's clock).
    Mutant(
        "redis-renewal-keeps-the-pttl",
        "a renewed claim keeps its claim's PTTL: Redis expires it in use, and a retry reruns it",
        "store/redis.py",
        "        'KEEPTTL')\n      keep(key, lease)\n",
        "        'KEEPTTL')\n",
        (
            STATEFUL + "test_redis_keeps_a_renewed_claim_past_three_leases",
            STATEFUL + "test_the_engine_follows_the_decision_table",
        ),
        store="redis",
    ),
    Mutant(
        "redis-takeover-ignores-the-token",
        "the Redis take-over does not check the token it read: a held-up request takes over "
        "another request's record (which owed it a 422)",
        "store/redis.py",
        "local state, token, lease, expires = header(old)\nif token ~= ARGV[1] then return 0 end",
        "local state, token, lease, expires = header(old)",
        (
            STATEFUL + "test_a_take_over_rechecks_the_record_it_read",
            STATEFUL + "test_the_engine_follows_the_decision_table",
        ),
        store="redis",
    ),
    # Every failure of a Redis client is a failure kind; only "cannot be reached" fails open.
    Mutant(
        "sentinel-talks-to-a-replica",
        "the Sentinel store's client is a replica's (slave_for): claims are refused, or a read "
        "answers from a copy that lags the master",
        "store/redis_sentinel.py",
        "    client: redis.Redis = sentinel.master_for(",
        "    client: redis.Redis = sentinel.slave_for(",
        (SENTINEL + "test_the_store_talks_to_the_master_the_sentinels_name",),
    ),
    Mutant(
        "sentinel-asked-without-timeouts",
        "the Sentinels are asked without the store's timeouts: a frozen Sentinel holds every "
        "request that needs a new connection, for ever",
        "store/redis_sentinel.py",
        '            "socket_timeout": socket_timeout,\n'
        '            "socket_connect_timeout": socket_connect_timeout,\n',
        "",
        (SENTINEL + "test_a_frozen_sentinel_costs_a_timeout_not_a_hung_request",),
    ),
    Mutant(
        "sentinel-options-ignored",
        "SENTINELS and SERVICE_NAME are ignored: the store connects to the URL's host, "
        "whichever node that is now",
        "store/redis_sentinel.py",
        '    if not options["SENTINELS"]:\n        return None\n',
        "    return None\n",
        (SENTINEL + "test_the_options_name_the_sentinels_and_the_url_the_masters_database",),
    ),
    Mutant(
        "sentinel-outage-never-fails-open",
        "Sentinels that name no master are a store failure of kind 'other': ON_STORE_ERROR "
        "'open' never runs the view, though nothing of the request reached a Redis",
        "store/redis.py",
        '        if isinstance(error, redis.ConnectionError):\n            return "unreachable"\n',
        '        if isinstance(error, redis.ConnectionError):\n            return "other"\n',
        (SENTINEL + "test_sentinels_that_cannot_be_reached_are_a_store_outage",),
    ),
    Mutant(
        "redis-bad-url-is-a-500",
        "a Redis URL the store cannot use (checks silenced) raises ValueError from the view: 500",
        "store/redis.py",
        "        except ValueError as error:\n"
        '            raise StoreError(f"Redis: STORE_OPTIONS: {error}", "other") from error\n',
        "",
        (SENTINEL + "test_a_url_the_store_cannot_use_is_a_503_where_the_checks_were_silenced",),
    ),
    Mutant(
        "redis-eviction-check-crashes",
        "manage.py check crashes on a Redis URL the store cannot use, or a cluster that is down, "
        "instead of reporting E026/E029",
        "store/redis.py",
        "        except (redis.RedisError, StoreError):",
        "        except redis.RedisError:",
        (SENTINEL + "test_a_url_the_store_cannot_use_is_reported_by_every_check_without_crashing",),
    ),
    Mutant(
        "redis-cluster-errors-untranslated",
        "a cluster that cannot be reached (RedisClusterException, no RedisError) is a 500",
        "store/redis.py",
        "    redis.exceptions.RedisClusterException,"
        "  # not a RedisError: SlotNotCoveredError, ...\n",
        "",
        (RFAIL + "test_a_cluster_that_cannot_be_reached_is_a_503_not_a_500",),
    ),
    Mutant(
        "redis-unreachable-cluster-never-fails-open",
        "ON_STORE_ERROR 'open' never fails open for a cluster that cannot be reached",
        "store/redis.py",
        '            return "unreachable"'
        '  # not "no startup node is a cluster": a misconfiguration',
        '            return "other"',
        (RFAIL + "test_a_cluster_that_cannot_be_reached_fails_open_when_asked",),
    ),
    Mutant(
        "redis-misconfigured-cluster-fails-open",
        "a cluster URL on a Redis without cluster mode counts as unreachable: runs unprotected",
        "store/redis.py",
        "            and any(isinstance(link, _NO_ANSWER) for link in chain[1:])\n",
        "",
        (RFAIL + "test_a_cluster_url_on_a_redis_without_cluster_mode_never_fails_open",),
    ),
    Mutant(
        "redis-exhaustion-fails-open",
        "a full pool, a Redis at maxclients or refused credentials fail open: views run twice",
        "store/redis.py",
        "        if any(_there(link) for link in chain):",
        "        if False:",
        (
            RFAIL + "test_a_full_pool_never_fails_open",
            RFAIL + "test_a_redis_that_refuses_a_connection_never_fails_open",
        ),
    ),
    Mutant(
        "redis-blocking-pool-fails-open",
        "BlockingConnectionPool's 'No connection available' counts as unreachable",
        "store/redis.py",
        '_EXHAUSTED_WORDS = ("too many connections", "no connection available", '
        '"max number of clients")',
        "_EXHAUSTED_WORDS: tuple[str, ...] = ()",
        (RFAIL + "test_a_blocking_pool_with_no_connection_to_spare_is_other",),
    ),
    Mutant(
        "redis-cluster-down-never-fails-open",
        "a cluster that answers CLUSTERDOWN is not 'unreachable': 'open' never fails open",
        "store/redis.py",
        "        if any(isinstance(link, _CLUSTER_DOWN) for link in chain):",
        "        if False:",
        (RFAIL + "test_a_cluster_that_says_it_is_down_fails_closed_or_open_as_asked",),
    ),
    Mutant(
        "redis-reset-drops-connections-in-use",
        "reset() closes the connections other threads are using: their commands fail",
        "store/redis.py",
        "            redis_cluster.disconnect(current[1], in_use=False)",
        "            redis_cluster.disconnect(current[1])",
        (RFAIL + "test_a_reset_leaves_the_connections_other_threads_are_using",),
    ),
    Mutant(
        "redis-renewal-ignores-its-timeout",
        "a Redis renewal waits out SOCKET_TIMEOUT, past the heartbeat's beat",
        "store/redis.py",
        "        client = self._renewal(timeout)",
        "        client = self.client()",
        (RFAIL + "test_a_renewal_is_bounded_by_its_timeout_not_by_socket_timeout",),
    ),
    # The same promises on the local cluster (python -m tools.redis_cluster start).
    Mutant(
        "redis-timeout-behind-cluster-error-fails-open",
        "a command that timed out, reported as RedisClusterUnreachableError, fails open",
        "store/redis.py",
        "        if not building and any(isinstance(link, redis.TimeoutError) for link in chain):",
        "        if not building and isinstance(error, redis.TimeoutError):",
        (ROUTAGE + "test_a_frozen_cluster_is_an_unknown_outcome_never_a_fail_open",),
    ),
    Mutant(
        "redis-cluster-build-timeout-never-fails-open",
        "a cluster frozen while its client is built (nothing sent) is not 'unreachable'",
        "store/redis.py",
        "        if not building and any(isinstance(link, redis.TimeoutError) for link in chain):",
        "        if any(isinstance(link, redis.TimeoutError) for link in chain):",
        (ROUTAGE + "test_a_cluster_frozen_before_the_client_is_built_fails_open_when_asked",),
    ),
    # The pure logic of the cluster options, the read's clock and MOVED: in the main suite.
    Mutant(
        "rediss-cluster-url-refused",
        "a rediss+cluster:// URL is refused by E026",
        "store/redis_cluster.py",
        'CLUSTER_URLS = ("redis+cluster://", "rediss+cluster://")',
        'CLUSTER_URLS = ("redis+cluster://",)',
        (RLOGIC + "test_e026_accepts_a_cluster_url_and_the_wait_options",),
    ),
    Mutant(
        "wait-timeout-zero-accepted",
        "WAIT_TIMEOUT_MS = 0 passes E026 (WAIT 0 blocks until the replicas answer)",
        "store/redis_cluster.py",
        '("WAIT_TIMEOUT_MS", 1)',
        '("WAIT_TIMEOUT_MS", 0)',
        (RLOGIC + "test_e026_names_a_bad_cluster_or_wait_option",),
    ),
    Mutant(
        "redis-read-clock-in-seconds",
        "the Redis read takes the server's seconds for milliseconds: every lease looks live",
        "store/redis_cluster.py",
        "(seconds, micros), value = pipe.execute()\n    return int(seconds) * 1000",
        "(seconds, micros), value = pipe.execute()\n    return int(seconds)",
        (RLOGIC + "test_a_read_gives_what_is_left_of_the_lease_by_the_servers_clock",),
    ),
    Mutant(
        "cluster-moved-not-followed",
        "write_and_wait gives up on a MOVED instead of sending the write to the new owner",
        "store/redis_cluster.py",
        "            client.nodes_manager.move_slot(error)\n"
        "            node, asking = _node(client, error.host, error.port), False",
        "            raise",
        (RLOGIC + "test_write_and_wait_follows_a_moved_and_learns_the_new_owner",),
    ),
    Mutant(
        "cluster-moved-not-learned",
        "write_and_wait follows a MOVED without updating the map: every write pays it again",
        "store/redis_cluster.py",
        "            client.nodes_manager.move_slot(error)\n",
        "",
        (RLOGIC + "test_write_and_wait_follows_a_moved_and_learns_the_new_owner",),
    ),
    Mutant(
        "redis-no-hash-tag",
        "a record's key has no hash tag: its keys may land in different cluster slots",
        "store/redis.py",
        'return f"{prefix}:{{{digest}}}"',
        'return f"{prefix}:{digest}"',
        (REDIS + "test_every_key_of_a_record_is_in_one_slot_through_a_hash_tag",),
    ),
    # -- the keyed fingerprint, scopes and hostile bodies (docs/security.md) ---------------
    Mutant(
        "fingerprint-unkeyed",
        "the stored fingerprint is a plain digest: a short body (a PIN) is guessed back from it",
        "core/fingerprint.py",
        '    mac = hmac.digest(derived, material, "sha256").hex()',
        "    mac = material.hex()",
        (KEYED + "test_a_short_body_cannot_be_guessed_back_from_the_stored_value",),
    ),
    Mutant(
        "fingerprint-unkeyed-in-redis",
        "the fingerprint in a Redis value is a plain digest: a short body is guessed back",
        "core/fingerprint.py",
        '    mac = hmac.digest(derived, material, "sha256").hex()',
        "    mac = material.hex()",
        (KEYED + "test_a_short_body_cannot_be_guessed_back_from_the_stored_value",),
        store="redis",
    ),
    Mutant(
        "fingerprint-fallback-keys-ignored",
        "a record keyed with a key in SECRET_KEY_FALLBACKS is not compared: another body replays",
        "core/fingerprint.py",
        '    for secret in (settings.SECRET_KEY, *getattr(settings, "SECRET_KEY_FALLBACKS", ())):',
        "    for secret in (settings.SECRET_KEY,):",
        (KEYED + "test_a_record_keyed_with_a_fallback_key_still_tells_retries_from_others",),
    ),
    Mutant(
        "fingerprint-unknown-key-refused",
        "after a rotation without fallbacks every retry is a 422 (a client may resend: twice)",
        "core/fingerprint.py",
        "                _report_unknown_key(stored[2:10])\n                return True\n",
        "                return False\n",
        (KEYED + "test_a_record_keyed_with_a_key_no_longer_held_is_replayed_never_run_again",),
    ),
    Mutant(
        "admin-shows-the-fingerprint",
        "the admin shows the stored fingerprint: an earlier release's plain digest is readable",
        "operations/admin.py",
        '        "fingerprint_shown",\n',
        '        "fingerprint",\n',
        (
            "test_admin.py::test_detail_shows_no_plain_fingerprint_and_a_short_prefix_of_a_keyed_one",
        ),
    ),
    Mutant(
        "fingerprint-ignores-djangos-field-limit",
        "a 2.5 MiB JSON or form body is canonicalised whole before the view: seconds, 100+ MB",
        "core/fingerprint.py",
        "    return None if limit is None else int(limit)",
        "    return None",
        (
            FP + "test_a_large_json_body_stops_being_parsed_at_the_limit",
            FP + "test_a_form_of_more_fields_than_django_allows_is_compared_as_bytes",
        ),
    ),
    Mutant(
        "fingerprint-limit-off-by-one",
        "a JSON body of one value more than DATA_UPLOAD_MAX_NUMBER_FIELDS is still canonical",
        "core/fingerprint.py",
        "    left = -1 if max_values is None else max_values - 1  # the value itself",
        "    left = -1 if max_values is None else max_values",
        (FP + "test_json_of_exactly_the_allowed_number_of_values_is_canonical",),
    ),
    Mutant(
        "principals-not-namespaced",
        "NAMESPACE_PRINCIPALS does nothing: merchant 7 is replayed user 7's refund",
        "core/keys.py",
        "    if conf.NAMESPACE_PRINCIPALS:\n",
        "    if False:\n",
        (SCOPES + "test_a_merchant_and_the_user_with_its_pk_never_share_keys",),
    ),
    Mutant(
        "principal-without-pk-is-none",
        "a principal without a primary key is the account 'None', shared by all of them",
        "core/keys.py",
        "    if pk is None:\n        return None\n",
        "",
        (SCOPES + "test_a_principal_without_a_primary_key_is_anonymous_not_account_none",),
    ),
    Mutant(
        "deleted-user-keeps-its-records",
        "a new user given a deleted user's pk inherits its keys: a replay or 422 of another's",
        "core/accounts.py",
        "    transaction.on_commit(lambda: _forget_after_commit(account), using=using)",
        "    return",
        (SCOPES + "test_a_new_user_with_a_deleted_users_pk_inherits_none_of_its_keys",),
    ),
    Mutant(
        "deleted-user-forgotten-before-commit",
        "a user deletion that rolls back has deleted the records: the user's retries run again",
        "core/accounts.py",
        "    transaction.on_commit(lambda: _forget_after_commit(account), using=using)",
        "    _forget_after_commit(account)",
        (
            SCOPES + "test_with_the_store_in_its_own_database_a_rolled_back_deletion_keeps_the_"
            "records",
        ),
    ),
    Mutant(
        "deleted-user-takes-others-records",
        "deleting user 7 deletes records a merchant or a custom ACCOUNT named '7': they rerun",
        "core/accounts.py",
        '    if not (conf.NAMESPACE_PRINCIPALS and conf.get("ACCOUNT") == DEFAULTS["ACCOUNT"]):',
        "    if False:",
        (SCOPES + "test_where_a_bare_pk_may_not_be_a_user_deleting_one_keeps_every_record",),
    ),
    Mutant(
        "deleted-user-takes-task-records",
        "forgetting an account deletes a task's records whose scope is that string: it reruns",
        "store/database.py",
        "filter(account=account).exclude(keep_endpoints)",
        "filter(account=account)",
        (SCOPES + "test_forget_account_deletes_an_accounts_records_but_tasks",),
    ),
    Mutant(
        "tenant-ignored",
        "TENANT is not put into the endpoint: a user is replayed tenant A's answer in tenant B",
        "core/protect.py",
        "            endpoint = keys.tenant_endpoint(endpoint, resolved.tenant(request))",
        "            pass",
        (
            SCOPES + "test_a_user_in_two_tenants_by_host_gets_one_run_in_each",
            SCOPES + "test_a_user_in_two_tenants_by_header_gets_one_run_in_each",
        ),
    ),
    Mutant(
        "tenant-endpoint-ambiguous",
        "a tenant is written unencoded: a tenant holding a space passes for another's endpoint",
        "core/keys.py",
        "    return f\"tenant:{quote(str(tenant), safe='')} {endpoint}\"",
        '    return f"tenant:{tenant} {endpoint}"',
        (SCOPES + "test_tenant_endpoints_never_meet",),
    ),
    Mutant(
        "multi-tenant-unwarned",
        "a project that looks multi-tenant gets no W030",
        "checks.py",
        "    signs = _tenancy_signs() if scoped_by_default else []",
        "    signs: list[str] = []",
        (SCOPES + "test_w030_a_project_that_looks_multi_tenant",),
    ),
    Mutant(
        "guests-share-a-downstream-key",
        "downstream_key_for gives every guest sending one key the same downstream key",
        "core/downstream.py",
        "        if account is None:\n            raise AnonymousNotAllowed(",
        "        if False:\n            raise AnonymousNotAllowed(",
        (SCOPES + "test_a_guests_downstream_key_needs_an_account_the_guest_holds",),
    ),
    Mutant(
        "empty-account-accepted",
        "an ACCOUNT of '' or 'None' is an account: every such request shares one",
        "core/keys.py",
        '    if not text.strip() or text == "None":',
        "    if False:",
        (SCOPES + "test_an_account_of_empty_or_none_text_is_refused_as_anonymous",),
    ),
    Mutant(
        "atomic-claim-lock-wait-unbounded",
        "in atomic mode a duplicate's claim waits on the first transaction's row until it ends",
        "core/shell.py",
        "        if store.in_transaction():\n            # Atomic mode",
        "        if False:\n            # Atomic mode",
        (EXH + "test_atomic_mode_conflict_answers_a_duplicate_409_without_waiting_for_the_first",),
    ),
    Mutant(
        "atomic-wait-past-wait-seconds",
        "under wait, an atomic-mode duplicate waits on the row lock past WAIT_SECONDS",
        "core/shell.py",
        "bound = max(bound, deadline - time.monotonic())",
        "bound = max(bound, 3600)",
        (EXH + "test_atomic_mode_wait_bounds_a_duplicates_wait_by_wait_seconds",),
    ),
    Mutant(
        "claim-lock-wait-kept-for-the-view",
        "PostgreSQL's lock_timeout of the claim is left on for the view's own statements",
        "store/database.py",
        "            cursor.execute(\"SELECT set_config('lock_timeout', %s, true)\", [previous])",
        "            pass",
        (EXH + "test_the_claims_lock_wait_bound_is_given_back_to_the_view",),
    ),
    Mutant(
        "max-waiters-ignored",
        "every duplicate of a process may wait under wait: duplicates hold all its threads",
        "core/shell.py",
        "            if self.count >= limit:",
        "            if False:",
        (EXH + "test_with_every_waiter_place_taken_a_duplicate_is_told_409_at_once",),
    ),
    Mutant(
        "waiter-place-never-given-back",
        "a waiter keeps its place: after MAX_WAITERS waits, no duplicate of the process may wait",
        "core/shell.py",
        "        if self.held:\n            waiters.leave()",
        "        if self.held:\n            pass",
        (EXH + "test_a_waiter_gives_its_place_back",),
    ),
    Mutant(
        "wait-seconds-unbounded",
        "WAIT_SECONDS and wait_seconds= accept any wait",
        "conf.py",
        'if name == "WAIT_SECONDS" and value > MAX_WAIT_SECONDS:',
        "if False:",
        (EXH + "test_wait_seconds_has_a_maximum",),
    ),
    Mutant(
        "quota-never-checked",
        "MAX_IN_FLIGHT_PER_ACCOUNT is ignored: an account holds any number of requests",
        "core/shell.py",
        "    if options.account_limit is not None:\n        _within_quota",
        "    if False:\n        _within_quota",
        (EXH + "test_an_account_at_its_quota_is_told_429_before_any_claim",),
    ),
    Mutant(
        "quota-count-without-its-index",
        "the quota's count names no state: the partial index is not used, and every claim of "
        "a busy account reads its completed records",
        "store/database.py",
        """f"AND {column['state']} = '{State.IN_PROGRESS.value}' \"""",
        """f"AND {column['state']} IS NOT NULL \"""",
        (
            EXH + "test_completed_and_lapsed_records_do_not_count_toward_the_quota",
            EXH + "test_the_quota_is_counted_through_the_partial_index_on_postgresql",
        ),
    ),
    Mutant(
        "quota-counts-lapsed-claims",
        "the quota counts dead workers' lapsed claims: an account is refused for nothing running",
        "store/database.py",
        """f"AND {column['lease_expires_at']} > {_clock_sql(connection.vendor, offset=False)} \"""",
        """f"AND {column['lease_expires_at']} IS NOT NULL AND """
        """{_clock_sql(connection.vendor, offset=False)} IS NOT NULL \"""",
        (EXH + "test_completed_and_lapsed_records_do_not_count_toward_the_quota",),
    ),
    Mutant(
        "quota-holds-tasks",
        "tasks are held to the account quota: a queue redelivers them until one completes",
        "core/options.py",
        '"requests": where != TASK}',
        '"requests": True}',
        (EXH + "test_tasks_are_not_held_to_the_account_quota",),
    ),
    Mutant(
        "eviction-never-reported",
        "a Redis that evicts records is taken for one that never does",
        "store/redis.py",
        'return next((p for p in policies if p != "noeviction"), "noeviction")',
        'return "noeviction"',
        (EVICT + "test_a_redis_that_evicts_keys_is_reported",),
    ),
    Mutant(
        "stored-length-replayed",
        "a stored Content-Length is replayed: a redacted replay announces the first body's length",
        "core/responses.py",
        "    return lower not in NEVER_STORED_HEADERS and lower not in BODY_LENGTH_HEADERS",
        "    return lower not in NEVER_STORED_HEADERS",
        (REPLAYED + "test_a_redacted_replay_does_not_carry_the_first_responses_length",),
    ),
    Mutant(
        "replay-without-cache-control",
        "a replay says nothing of caching when the first response said nothing",
        "core/responses.py",
        '    if "Cache-Control" not in response:\n        response["Cache-Control"]',
        '    if False:\n        response["Cache-Control"]',
        (REPLAYED + "test_a_replay_says_no_store_when_the_first_response_said_nothing_of_caching",),
    ),
    Mutant(
        "replay-forgets-the-views-caching",
        "the view's Cache-Control is not stored: its replays say no-store whatever it allowed",
        "core/responses.py",
        'ALWAYS_STORED_HEADERS = ("Content-Type", "Location", "Cache-Control")',
        'ALWAYS_STORED_HEADERS = ("Content-Type", "Location")',
        (REPLAYED + "test_a_replay_keeps_the_caching_the_view_allowed",),
    ),
    Mutant(
        "signals-carry-the-raw-key",
        "receivers get the client's key as it is: an error tracker or a metrics label keeps it",
        "signals.py",
        "key=key_digest(key), **extra",
        "key=key, **extra",
        ("test_signals.py::test_receivers_get_the_keys_digest_and_ask_for_the_key_itself",),
    ),
    Mutant(
        "raw-key-not-given-to-receivers",
        "a receiver that asks for the key itself gets nothing it can use",
        "signals.py",
        "    sending = _sending.set(key)",
        '    sending = _sending.set("")',
        ("test_signals.py::test_the_key_is_given_to_receivers_only_while_the_signal_is_sent",),
    ),
    Mutant(
        "admin-history-keeps-the-key",
        "the admin's history, kept forever, names each released key as it is",
        "operations/admin.py",
        "key=signals.key_digest(record.key),",
        "key=record.key,",
        (EXPOSED + "test_the_history_of_a_release_names_the_key_by_its_digest",),
    ),
    Mutant(
        "admin-any-lookup",
        "the admin's query string takes any field lookup: a full scan of the table per page",
        "operations/admin.py",
        "        return lookup in ALLOWED_LOOKUPS",
        "        return True",
        (EXPOSED + "test_a_lookup_no_index_serves_is_refused",),
    ),
    Mutant(
        "admin-sorts-by-the-query-string",
        "the admin sorts by ?o=: a sort of the whole table per page",
        "operations/admin.py",
        '            return ["-expires_at", "-pk"]\n        return ["-pk"]',
        '            return ["-expires_at", "-pk"]\n'
        "        return super().get_ordering(request, queryset)",
        (EXPOSED + "test_a_sort_in_the_query_string_is_ignored",),
    ),
    Mutant(
        "admin-silent-on-bodies-in-clear",
        "the admin does not say that, without a codec, its readers read every stored body",
        "operations/admin.py",
        '    return {"bodies_in_clear": conf.RESPONSE_CODEC is None}',
        '    return {"bodies_in_clear": False}',
        (EXPOSED + "test_without_a_codec_the_list_and_each_record_say_the_bodies_are_in_clear",),
    ),
    Mutant(
        "client-key-to-another-origin",
        "the client follows a redirect to another origin with the key (and the body)",
        "client/http.py",
        "        if not _key_may_follow(response.request.url, following.url):",
        "        if False:",
        (REDIRECTS + "test_a_redirect_to_another_origin_that_resends_the_body_is_not_followed",),
    ),
    Mutant(
        "client-logs-the-key",
        "the client's logs and errors name the key as it is",
        "client/http.py",
        "            shown=self.log_key(key),",
        "            shown=key,",
        (REDIRECTS + "test_the_key_is_not_logged_or_raised_as_it_is",),
    ),
    Mutant(
        "client-auth-applied-on-redirects",
        "the client applies its credentials again to every redirect, another origin's too",
        "client/http.py",
        "            response = self.http.send(following, auth=None, follow_redirects=False)",
        "            response = self.http.send(\n"
        "                following, auth=_auth(auth), follow_redirects=False\n"
        "            )",
        (REDIRECTS + "test_credentials_are_not_sent_again_to_another_origin",),
    ),
    # Durations have an upper bound (100 years): past it, now + a TTL is not a date.
    Mutant(
        "duration-unbounded",
        "a TTL or lease past the year 9999 is accepted where a view declares it, and a request "
        "under such a setting crashes with OverflowError instead of being refused",
        "conf.py",
        "        if too_long(name, value):\n",
        "        if False:\n",
        (
            DURATIONS + "test_a_views_duration_over_the_bound_is_refused_naming_the_view",
            DURATIONS + "test_a_request_under_a_duration_setting_over_the_bound_runs_nothing",
        ),
    ),
    Mutant(
        "duration-check-unbounded",
        "no system check reports a duration setting past the bound (E028)",
        "checks.py",
        "        if too_long(name, values[name]):\n",
        "        if False:\n",
        (DURATIONS + "test_e028_a_duration_over_a_hundred_years",),
    ),
    Mutant(
        "heartbeat-timeout-unclamped",
        "a lease of months sets a statement_timeout PostgreSQL refuses: no renewal ever succeeds",
        "store/database.py",
        "            milliseconds = min(milliseconds, _PG_MAX_TIMEOUT_MS)\n",
        "",
        (DURATIONS + "test_a_claim_leased_for_the_bound_is_renewed_by_the_heartbeats_statement",),
    ),
    Mutant(
        "purge-age-unbounded",
        "a purge age past 100 years is a traceback (OverflowError), not a usage error",
        "operations/purge.py",
        "    if seconds > MAX_DURATION_SECONDS:\n",
        "    if False:\n",
        (DURATIONS + "test_the_purge_command_refuses_an_age_over_a_hundred_years",),
    ),
    Mutant(
        "prepared-log-says-resent",
        "a statement refused inside a transaction is logged as sent again unprepared, which "
        "it never is (the heartbeat's renewal, a request transaction)",
        "store/database.py",
        "_stop_preparing(connection, error, sent_again=not in_transaction)",
        "_stop_preparing(connection, error, sent_again=True)",
        (
            PREP + "test_the_heartbeat_says_a_refused_statement_in_its_transaction_is_not_"
            "sent_again",
        ),
    ),
    Mutant(
        "own-store-under-atomic-accepted",
        "a view given the Redis store under a project-wide MODE atomic is declared, then "
        "answers 500 to every request",
        "core/options.py",
        'mode = self.mode if own_mode else setting_at_declaration("MODE")',
        "mode = self.mode if own_mode else None",
        (
            REDIS + "test_a_redis_store_of_its_own_under_a_project_wide_atomic_mode_is_refused_"
            "where_declared",
        ),
    ),
    # Unknown outcomes: only an error that says the database rolled the work back is known.
    Mutant(
        "rolled-back-work-keeps-its-key",
        "a lock timeout or deadlock, which the database rolled back, keeps the key for a lease: "
        "the retry is told 409 for an outcome that is known",
        "core/decisions.py",
        "    return isinstance(error, OperationalError) and not rolled_back(error)",
        "    return isinstance(error, OperationalError)",
        (
            UNKNOWN + "test_a_view_whose_row_lock_timed_out_releases_its_key_and_the_retry_runs",
            UNKNOWN + "test_a_view_picked_as_a_deadlock_victim_releases_its_key_and_the_retry_runs",
            UNKNOWN + "test_a_task_whose_row_lock_timed_out_releases_its_key",
        ),
    ),
    Mutant(
        "any-operational-error-rolled-back",
        "every OperationalError counts as rolled back: a lost connection releases the key of "
        "work that may have committed",
        "store/database.py",
        '    return error_kind(error, _vendor_of(error)) == "contention"',
        "    return True",
        (
            UNKNOWN + "test_a_view_that_lost_its_connection_keeps_its_key_until_its_lease_lapses",
            UNKNOWN + "test_a_lost_connection_stays_unknown_and_a_lock_timeout_does_not",
        ),
    ),
    # REQUIRE_BOUND_RESPONSES: once resealed, a response bound to no record is refused.
    Mutant(
        "require-bound-replays-sealed-unbound",
        "under REQUIRE_BOUND_RESPONSES a response sealed before binding (maybe copied from "
        "another account's record) is replayed",
        "core/codecs.py",
        "    if not bound and bound_required():\n        raise _unbound(stored.status)\n",
        "",
        (
            ENCRYPTION + "test_under_require_bound_responses_an_unbound_response_is_refused_never_"
            "rerun",
        ),
    ),
    Mutant(
        "require-bound-replays-clear",
        "under REQUIRE_BOUND_RESPONSES a response stored in clear is replayed",
        "core/codecs.py",
        "        if bound_required():\n"
        "            raise _unbound(stored.status)\n"
        "        return stored",
        "        return stored",
        (
            ENCRYPTION + "test_under_require_bound_responses_an_unbound_response_is_refused_never_"
            "rerun",
        ),
    ),
    Mutant(
        "reseal-binds-an-unbound-copy",
        "under REQUIRE_BOUND_RESPONSES the reseal binds an unbound response to the record it "
        "was copied into, which then replays it",
        "core/codecs.py",
        "        opened = unseal(stored, account=account, endpoint=endpoint, key=key)\n",
        "        opened = (\n"
        "            _unframe(stored.status, codec.decode(stored.body[len(SEALED) :]))\n"
        "            if stored.body.startswith(SEALED_UNBOUND)\n"
        "            else unseal(stored, account=account, endpoint=endpoint, key=key)\n"
        "        )\n",
        (ENCRYPTION + "test_under_require_bound_responses_reseal_never_binds_an_unbound_response",),
    ),
    Mutant(
        "require-bound-without-codec-unwarned",
        "REQUIRE_BOUND_RESPONSES without a codec, which binds nothing, is not warned (W021)",
        "checks.py",
        '        if conf.get("REQUIRE_BOUND_RESPONSES") is True:',
        "        if False:",
        (
            ENCRYPTION + "test_require_bound_responses_without_a_codec_changes_nothing_and_is_"
            "warned",
        ),
    ),
    # Promises an independent mutation run found no main-suite test for. Each survived the
    # suite's modules that concern them (on PostgreSQL) before its test was added, but the
    # heartbeat's wake-up, which test_concurrency's lease test caught there too.
    Mutant(
        "ninja-own-account-ignored",
        "a django-ninja operation's own account= is replaced by ninja's authenticated caller",
        "adapters/ninja.py",
        '    if values.get("account") in (None, _UNSET):\n        values["account"] = _account',
        '    if True:\n        values["account"] = _account',
        ("test_ninja.py::test_an_operations_own_account_takes_precedence_over_ninjas_caller",),
    ),
    Mutant(
        "own-wait-seconds-ignored",
        "a view's or task's own wait_seconds is ignored: WAIT_SECONDS bounds its wait instead",
        "core/options.py",
        '                wait_seconds=float(checked("wait_seconds")),',
        '                wait_seconds=float(conf.checked("WAIT_SECONDS")),',
        (
            DEC + "test_a_views_own_wait_seconds_bounds_its_wait_not_the_setting",
            "test_tasks.py::test_a_tasks_own_wait_seconds_bounds_its_wait_not_the_setting",
        ),
    ),
    Mutant(
        "async-inner-layer-runs-twice",
        "async code calls an inner layer of the same scope twice under one claim: the work of "
        "one key done twice",
        "core/protect.py",
        "        if held[guard.scope]:\n"
        "            return _ran_once(error_response)\n"
        "        with _inner(held, guard.scope):\n"
        "            return await call_view()",
        "        with _inner(held, guard.scope):\n            return await call_view()",
        ("test_middleware.py::test_under_asgi_a_second_inner_call_under_one_claim_is_refused",),
    ),
    Mutant(
        "async-refusal-sent-on-the-loop",
        "an async view's refusal before the claim is sent on the event loop: a receiver that "
        "uses the database fails",
        "core/protect.py",
        "        await sync_to_async(_refused)(request, error)",
        "        _refused(request, error)",
        ("test_async.py::test_a_refusals_receiver_may_use_the_database",),
    ),
    Mutant(
        "endpoint-slash-twin-other-arguments",
        "a path and its slash twin share an endpoint even when they resolve to other arguments",
        "core/keys.py",
        "    same_route = twin.func == match.func and twin.args == match.args and twin.kwargs == "
        "match.kwargs",
        "    same_route = twin.func == match.func",
        (DEC + "test_slash_twins_that_resolve_to_other_arguments_keep_their_own_keys",),
    ),
    Mutant(
        "heartbeat-not-woken-by-a-shorter-lease",
        "a claim with a shorter lease than the heartbeat sleeps on does not wake it: its lease "
        "lapses while its view runs",
        "core/heartbeat.py",
        "        if sleeping is None or lease / 3 < sleeping:",
        "        if sleeping is None:",
        ("test_heartbeat.py::test_a_claim_with_a_shorter_lease_wakes_the_sleeping_heartbeat",),
    ),
    Mutant(
        "resumed-claim-untold",
        "a claim resumed after its lost reply runs the view without 'claimed': the metrics count "
        "it as 'other' and an audit of executions misses it",
        "core/shell.py",
        "            # view is about to run under a new claim, so this is ``claimed``.\n"
        '            _report(scope, logging.DEBUG, "Idempotency key claimed.", '
        "signal=signals.claimed)\n",
        "            # view is about to run under a new claim, so this is ``claimed``.\n",
        ("test_decorators.py::test_a_claim_resumed_after_its_lost_reply_is_told_as_claimed",),
    ),
    Mutant(
        "signals-observer-silences-receivers",
        "with the metrics on, a receiver of one's own stops getting the signals: the metrics' "
        "slot takes the place of Django's receivers instead of coming before them",
        "signals.py",
        "    if not signal.receivers:\n        return\n    sending = _sending.set(key)",
        "    if signal.observer is not None or not signal.receivers:\n        return\n"
        "    sending = _sending.set(key)",
        ("test_observe.py::test_a_receiver_of_ones_own_sees_what_the_metrics_see",),
    ),
    Mutant(
        "signals-observer-not-called",
        "the metrics' slot is never called: every request is counted as 'other'",
        "signals.py",
        "    if signal.observer is not None:\n        signal.observer(account=account",
        "    if False:\n        signal.observer(account=account",
        ("test_observe.py::test_each_outcome_is_counted_once_under_its_label",),
    ),
    Mutant(
        "metrics-waited-counted-as-replayed",
        "a duplicate that waited for the first request, then replayed it, is counted as a plain "
        "replay: the waits an IN_FLIGHT 'wait' policy causes disappear from the metrics",
        "core/observe.py",
        '        frame.outcome = "waited_then_replayed" if waited else "replayed"',
        '        frame.outcome = "replayed"',
        ("test_observe.py::test_a_duplicate_that_waited_and_replayed_is_waited_then_replayed",),
    ),
    Mutant(
        "metrics-mismatch-under-another-label",
        "a 422 (a key reused for another request) is counted as a 409 in flight",
        "core/observe.py",
        '        (signals.mismatch, _outcome_of("mismatch")),',
        '        (signals.mismatch, _outcome_of("in_flight")),',
        ("test_observe.py::test_each_outcome_is_counted_once_under_its_label",),
    ),
    Mutant(
        "metrics-failed-open-counted-as-unavailable",
        "a request run unprotected after a store failure (ON_STORE_ERROR 'open') is counted as "
        "a 503",
        "core/observe.py",
        '        frame.outcome = "failed_open" if policy == "open" else "store_unavailable"',
        '        frame.outcome = "store_unavailable"',
        ("test_observe.py::test_store_unavailable_and_failed_open_are_counted",),
    ),
    Mutant(
        "metrics-key-in-the-log-line",
        "the request log line carries the client's key instead of its HMAC",
        "core/observe.py",
        '            "idempotency_key_hmac": None if frame.key is None else '
        "signals.key_digest(frame.key),",
        '            "idempotency_key_hmac": frame.key,',
        ("test_observe.py::test_one_log_line_per_request_with_the_keys_hmac_only",),
    ),
    Mutant(
        "metrics-path-as-route",
        "http.route is the request's path, not its route template: one series per order id",
        "core/observe.py",
        '    return str(match.route) if match is not None else ""',
        "    return request.path",
        ("test_observe.py::test_routes_are_templates_and_no_key_or_account_is_a_label",),
    ),
    Mutant(
        "metrics-multiprocess-not-summed",
        "the metrics view exports the answering worker's values only: under gunicorn -w 4 a "
        "scrape sees about a quarter of the requests",
        "metrics/prometheus.py",
        "        multiprocess.MultiProcessCollector(scraped)  # type: ignore[no-untyped-call]",
        "        scraped.register(_Default())",
        (
            "test_observe_multiprocess.py::"
            "test_a_scrape_sums_every_workers_counts_and_drops_an_exited_workers_gauges",
        ),
    ),
    Mutant(
        "metrics-in-flight-gauge-of-dead-workers",
        "the in-flight gauge keeps the claims of workers that exited: it sums every process "
        "that ever ran",
        "metrics/prometheus.py",
        '            multiprocess_mode="livesum",',
        '            multiprocess_mode="sum",',
        (
            "test_observe_multiprocess.py::"
            "test_a_scrape_sums_every_workers_counts_and_drops_an_exited_workers_gauges",
        ),
    ),
    Mutant(
        "metrics-histogram-bound-in-the-next-bucket",
        "a store operation's duration (or a response's size) equal to a bucket's bound is "
        "counted in the next bucket, not in the one whose bound holds it, as prometheus-client "
        "counts it: the quantiles drift",
        "metrics/prometheus.py",
        "        index = bisect_left(bounds, amount)  # the first bound >= amount, the last +Inf",
        "        index = bisect_left(bounds, amount) + (amount in bounds[:-1])",
        (
            "test_observe.py::"
            "test_store_durations_and_sizes_fall_in_the_buckets_prometheus_client_would_choose",
        ),
    ),
    Mutant(
        "metrics-span-event-on-take-over-missing",
        "a take-over leaves no event on the request's span",
        "core/observe.py",
        '        (signals.lease_taken_over, _with_event("taken_over", "idempotency.taken_over")),',
        '        (signals.lease_taken_over, _outcome_of("taken_over")),',
        ("test_observe.py::test_span_events_on_take_over_and_outcome_not_stored",),
    ),
    Mutant(
        "heartbeat-timeout-in-seconds",
        "the renewal's statement_timeout is sent in seconds, read as milliseconds: a row lock "
        "of a few milliseconds fails every renewal",
        "store/database.py",
        "            milliseconds = max(1, math.ceil(seconds * 1000))",
        "            milliseconds = max(1, math.ceil(seconds))",
        ("test_heartbeat.py::test_a_renewal_waits_out_a_row_lock_shorter_than_its_timeout",),
    ),
    Mutant(
        "eviction-check-cluster-unreachable",
        "the eviction check lets a cluster that no node answers raise: `manage.py check` (and "
        "runserver, migrate) crashes with StoreError instead of staying silent",
        "store/redis.py",
        "        except (redis.RedisError, StoreError):  # unreachable (a cluster no node "
        "answers), a bad URL",
        "        except redis.RedisError:",
        ("test_docs.py::test_settings_snippets_pasted_pass_the_system_checks",),
    ),
    Mutant(
        "server-imports-the-client",
        "the server imports the client package, whose transport (httpx) is an optional extra: "
        "a project without it cannot start",
        "core/keys.py",
        'logger = logging.getLogger("idempotency_django")',
        'import idempotency_django.client\n\nlogger = logging.getLogger("idempotency_django")',
        ("test_layout.py::test_the_server_needs_no_httpx",),
    ),
    Mutant(
        "public-path-not-the-module",
        "an old public import path is a copy of the moved module's names, not the module: a "
        "patch or a monkeypatch made through it no longer reaches the code",
        "keys.py",
        "sys.modules[__name__] = _module",
        "pass",
        ("test_layout.py",),
    ),
]

ROOT = Path(__file__).resolve().parent.parent
STARTED = time.monotonic()
PACKAGE = "idempotency_django"
PYTEST = ["-x", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "--reuse-db"]
# --full: the whole suite but the end-to-end tests, this file loaded as a plugin (``-p
# mutants``, from .ci on the path) that moves the mutant's named tests to the front.
FULL = ["-m", "not e2e", "-p", "mutants"]
RUN_FIRST = "MUTANTS_RUN_FIRST"  # the named tests, one a line


@pytest.hookimpl(trylast=True)  # after pytest-django's own ordering, which is kept otherwise
def pytest_collection_modifyitems(items: list[Any]) -> None:
    """(The plugin of ``--full``.) The mutant's named tests first: with ``-x`` a mutant they
    kill stops there; the verdict is the same in any order."""
    named = tuple(f"tests/{test}" for test in os.environ.get(RUN_FIRST, "").split("\n") if test)
    if named:
        prefixes = tuple(p for test in named for p in (test + "::", test + "["))
        items.sort(key=lambda item: not (item.nodeid in named or item.nodeid.startswith(prefixes)))


@dataclass
class Outcome:
    status: str  # killed, killed (timeout), SURVIVED, ERROR
    seconds: float
    detail: str = ""


def check_mutants(copy: Path) -> list[str]:
    """Every problem with the list: a snippet not found exactly once, an edit that does not
    compile, a duplicate id."""
    problems = []
    seen: set[str] = set()
    for mutant in MUTANTS:
        if mutant.id in seen:
            problems.append(f"{mutant.id}: duplicate id")
        seen.add(mutant.id)
        path = copy / PACKAGE / mutant.file
        source = path.read_text() if path.is_file() else ""
        count = source.count(mutant.original)
        if count != 1:
            problems.append(
                f"{mutant.id}: snippet found {count} times in {PACKAGE}/{mutant.file} "
                f"(expected once): {mutant.original!r}"
            )
            continue
        try:
            compile(source.replace(mutant.original, mutant.replacement), str(path), "exec")
        except SyntaxError as error:
            problems.append(f"{mutant.id}: the mutated file does not compile: {error}")
    return problems


def copy_tree(destination: Path) -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # listed but deleted in the working tree: skip it
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def run_pytest(
    copy: Path,
    env: dict[str, str],
    tests: tuple[str, ...],
    timeout: float,
    *extra: str,
    zygote: Zygote | None = None,
) -> tuple[int | None, str]:
    """pytest's exit code (None after a timeout) and its output: in a child forked from the
    job's ``zygote`` when it has one, else in a new interpreter."""
    args = [*PYTEST, *extra, *(f"tests/{t}" for t in tests)]
    if zygote is not None:
        return zygote.run(args, env, timeout)
    command = [sys.executable, "-m", "pytest", *args]
    process = subprocess.Popen(
        command,
        cwd=copy,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so that a timeout ends the servers a test started too
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return None, process.communicate()[0]
    except BaseException:  # interrupted: its own session does not get the Ctrl-C
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return process.returncode, output


# -- the zygote: pytest's runs forked from an interpreter that imported the heavy libraries ----
#
# A run of a mutant's named tests takes a few seconds, and half of that was the interpreter
# importing pytest's plugins and the libraries the tests use (Hypothesis, Faker, Schemathesis,
# Celery, redis-py, psycopg: about 3 s of CPU each time, measured). Each job starts one
# zygote, which imports only those (never Django's settings, the package or the tests), and
# forks a child per run: the child imports the package as it is on disk at that moment (the
# mutant applied), runs ``pytest.main`` in a session of its own (a timeout kills the servers a
# test started too), and exits. ``--no-fork`` runs each in a new interpreter instead.

PRELOAD = (
    "pytest_django",
    "hypothesis",
    "faker",
    "factory",
    "schemathesis",
    "httpx",
    "redis",
    "psycopg",
    "celery",
    "trio",
    "yaml",
    "requests",
    "pydantic",
)

ZYGOTE = r"""
import json, os, sys
import pytest
for name in sys.argv[1:]:
    try:
        __import__(name)
    except Exception:  # a library that is not installed: the tests import it themselves
        pass
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            os.environ.clear()
            os.environ.update(job["env"])
            log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(log, 1)
            os.dup2(log, 2)
            code = int(pytest.main(job["args"]))
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 3
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class Zygote:
    """One job's forking interpreter (see above)."""

    def __init__(self, copy: Path, env: dict[str, str]) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="zygote-"))
        self.process = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE, *PRELOAD],
            cwd=copy,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.runs = 0
        self._answer(None)  # ready

    def _answer(self, timeout: float | None) -> dict[str, Any] | None:
        assert self.process.stdout is not None
        if timeout is not None:
            ready, _, _ = select.select([self.process.stdout], [], [], max(0.0, timeout))
            if not ready:
                return None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the mutants' zygote ended")
        return json.loads(line)  # type: ignore[no-any-return]

    def run(self, args: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, str]:
        assert self.process.stdin is not None
        self.runs += 1
        log = self.directory / f"run-{self.runs}.log"
        job = {"args": [*args, "-W", "ignore::pytest.PytestAssertRewriteWarning"], "env": env}
        self.process.stdin.write(json.dumps({**job, "log": str(log)}) + "\n")
        self.process.stdin.flush()
        started = self._answer(None)
        assert started is not None
        pid = int(started["pid"])
        try:
            answer = self._answer(timeout)
            if answer is None:  # its session: the test's servers go too
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                self._answer(None)
                return None, log.read_text(errors="replace")
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            raise
        return int(answer["code"]), log.read_text(errors="replace")

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(30)
        shutil.rmtree(self.directory, ignore_errors=True)


def first_failure(output: str) -> str:
    match = re.search(r"^(?:FAILED|ERROR) (tests/.+?)(?: - .*)?$", output, re.MULTILINE)
    return match.group(1).removeprefix("tests/") if match else ""


def drop_test_databases(url: str) -> None:
    """The test databases kept between runs (``--reuse-db``), on PostgreSQL."""
    parts = urlsplit(url)
    if not parts.scheme.startswith("postgres"):
        return
    import psycopg

    name = parts.path.lstrip("/")
    try:
        admin = urlunsplit(parts._replace(path="/postgres"))
        with psycopg.connect(admin, autocommit=True) as connection:
            for database in (f"test_{name}", f"test_{name}_store"):
                connection.execute(f'DROP DATABASE IF EXISTS "{database}"')
    except psycopg.Error as error:
        print(f"note: could not drop the test databases: {error}")


def run_all(
    mutants: list[Mutant],
    copy: Path,
    env: dict[str, str],
    timeout: float | None,
    full: bool,
    zygote: Zygote | None = None,
) -> dict[str, Outcome] | None:
    """Each mutant's outcome; None when the selected tests fail unmutated (on the store
    each mutant's tests run on: ``Mutant.store``)."""
    extra = FULL if full else []
    took = 0.0
    for store in dict.fromkeys(m.store for m in mutants):
        ours = [m for m in mutants if m.store == store]
        selected = ("",) if full else tuple(dict.fromkeys(t for m in ours for t in m.tests))
        begun = time.monotonic()
        # Generous: an unmutated run that times out stops the check (exit 2), it kills nothing.
        first_timeout = 3 * timeout if timeout is not None else 3600.0 if full else 360.0
        code, output = run_pytest(
            copy,
            {**env, **STORE_ENV[store]},
            selected,
            first_timeout,
            *extra,
            "--create-db",
            zygote=zygote,
        )
        if code != 0:
            print(output[-5000:])
            print(
                f"The selected tests fail (or hang) unmutated on the {store} store: "
                "the check would mean nothing."
            )
            return None
        seconds = time.monotonic() - begun
        took = max(took, seconds)
        what = "the whole suite (but e2e)" if full else f"the {len(selected)} selections"
        elapsed = time.monotonic() - STARTED
        print(
            f"Unmutated, {store} store: {what} pass ({seconds:.1f} s; at {elapsed:.0f} s)",
            flush=True,
        )
    selected = ("",)  # --full: each mutant faces the whole suite
    if timeout is None:  # a survivor of --full runs everything: leave it room under load
        timeout = max(120.0, 3 * took) if full else 120.0

    outcomes: dict[str, Outcome] = {}
    recreate = False
    for mutant in mutants:
        path = copy / PACKAGE / mutant.file
        original = path.read_text()
        path.write_text(original.replace(mutant.original, mutant.replacement))
        begun = time.monotonic()
        try:
            recreated = ("--create-db",) if recreate else ()
            store_env = {**env, **STORE_ENV[mutant.store]}
            if full:
                store_env[RUN_FIRST] = "\n".join(mutant.tests)
                code, output = run_pytest(
                    copy, store_env, selected, timeout, *extra, *recreated, zygote=zygote
                )
            else:
                code, output = run_pytest(
                    copy, store_env, mutant.tests, timeout, *recreated, zygote=zygote
                )
        finally:
            path.write_text(original)
        seconds = time.monotonic() - begun
        recreate = code is None  # a killed run may have left rows behind
        if code is None:
            outcome = Outcome("killed (timeout)", seconds, f"no answer in {timeout:.0f} s")
        elif code == 1:
            outcome = Outcome("killed", seconds, first_failure(output))
        elif code == 0:
            outcome = Outcome("SURVIVED", seconds)
        else:
            outcome = Outcome("ERROR", seconds, f"pytest exit code {code}")
            print(output[-3000:])
        outcomes[mutant.id] = outcome
        elapsed = time.monotonic() - STARTED
        print(f"  {mutant.id}: {outcome.status} ({seconds:.1f} s; at {elapsed:.0f} s)", flush=True)
    return outcomes


def uses_redis(mutant: Mutant) -> bool:
    """Its tests use the one Redis, its throwaway servers or the one local cluster (which they
    kill and reshard), or run on the Redis store: two jobs must never run such tests at the
    same time."""
    return mutant.store == "redis" or any("redis" in test.split("::")[0] for test in mutant.tests)


# A Redis mutant's tests take about twice as long as another's (measured: 5.1 s against
# 2.4 s in CI), and the job that runs them runs the Redis store's unmutated tests too.
REDIS_WEIGHT = 2.0
REDIS_BASELINE_WEIGHT = 4.0


def share_out(mutants: list[Mutant], jobs: int) -> list[list[Mutant]]:
    """The mutants of each job: all the Redis ones in the first, the rest shared out so that
    the jobs' expected times even out."""
    groups: list[list[Mutant]] = [[] for _ in range(jobs)]
    load = [0.0] * jobs
    groups[0] = [m for m in mutants if uses_redis(m)]
    if groups[0]:
        load[0] = REDIS_WEIGHT * len(groups[0]) + REDIS_BASELINE_WEIGHT
    for mutant in (m for m in mutants if not uses_redis(m)):
        lightest = min(range(jobs), key=lambda job: load[job])
        groups[lightest].append(mutant)
        load[lightest] += 1.0
    return [group for group in groups if group]


def check_group(
    mutants: list[Mutant],
    url: str,
    timeout: float | None,
    full: bool,
    job: int = 0,
    fork: bool = True,
) -> dict[str, Outcome] | None:
    """The outcomes of these mutants, run one after another in a copy of their own."""
    with tempfile.TemporaryDirectory(prefix="mutants-") as temporary:
        copy = Path(temporary)
        copy_tree(copy)
        problems = check_mutants(copy)
        if problems:
            print("The mutant list no longer matches the code; update .ci/mutants.py:")
            print("\n".join(f"  {problem}" for problem in problems))
            return None
        env = {
            **os.environ,
            "DATABASE_URL": url,
            # .ci too under --full: this file is then the tests' ordering plugin.
            "PYTHONPATH": os.pathsep.join([str(copy), *([str(copy / ".ci")] if full else [])]),
            "PYTHONDONTWRITEBYTECODE": "1",  # a mutant never runs from a stale .pyc
        }
        if job:  # the Celery tests' broker: a Redis database of the job's own
            env["CELERY_TEST_BROKER"] = f"redis://127.0.0.1:6379/{8 + job}"
        where = subprocess.run(
            [sys.executable, "-c", f"import {PACKAGE}; print({PACKAGE}.__file__)"],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
        )
        if not Path(where.stdout.strip() or "/").resolve().is_relative_to(copy.resolve()):
            print(where.stderr[-2000:])
            print(f"The tests would import {PACKAGE} from {where.stdout.strip()!r}, not {copy}.")
            return None
        zygote = Zygote(copy, env) if fork else None
        try:
            return run_all(mutants, copy, env, timeout, full, zygote)
        finally:
            if zygote is not None:
                zygote.close()
            drop_test_databases(url)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database-url", required=True, help="PostgreSQL DATABASE_URL")
    parser.add_argument(
        "--timeout",
        type=float,
        help="seconds per mutant (default: 120; with --full, three times the unmutated run)",
    )
    parser.add_argument("--only", nargs="+", metavar="ID", help="run these mutants only")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="mutants checked side by side, each job in its own copy and databases",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="each mutant faces the whole suite but the e2e tests, not its named tests",
    )
    parser.add_argument(
        "--no-fork",
        action="store_true",
        help="run pytest in a new interpreter each time, not forked from the job's zygote",
    )
    args = parser.parse_args()
    unknown = set(args.only or ()) - {m.id for m in MUTANTS}
    if unknown:
        parser.error(f"no such mutant: {', '.join(sorted(unknown))}")
    mutants = [m for m in MUTANTS if not args.only or m.id in args.only]
    started = time.monotonic()
    jobs = max(1, min(args.jobs, len(mutants)))
    groups = share_out(mutants, jobs)
    jobs = len(groups)
    urls = [args.database_url if i == 0 else f"{args.database_url}_{i}" for i in range(jobs)]
    if jobs == 1:
        outcomes = check_group(groups[0], urls[0], args.timeout, args.full, 0, not args.no_fork)
    else:  # each job: its own copy of the tree and its own databases
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            results = list(
                pool.map(
                    check_group,
                    groups,
                    urls,
                    [args.timeout] * jobs,
                    [args.full] * jobs,
                    range(jobs),
                    [not args.no_fork] * jobs,
                )
            )
        outcomes = None if any(r is None for r in results) else {}
        for result in results:
            if outcomes is not None and result is not None:
                outcomes.update(result)
    if outcomes is None:
        return 2

    print(f"\n{'mutant':<32} {'result':<17} {'secs':>5}  breaks / tests run (first failure)")
    for mutant in mutants:
        outcome = outcomes[mutant.id]
        print(f"{mutant.id:<32} {outcome.status:<17} {outcome.seconds:>5.1f}  {mutant.breaks}")
        shown = f" ({outcome.detail})" if outcome.detail not in ("", *mutant.tests) else ""
        named = "the whole suite, first: " if args.full else ""
        print(f"{'':<57}{named}{', '.join(mutant.tests)}{shown}")
    bad = [m for m in mutants if outcomes[m.id].status in ("SURVIVED", "ERROR")]
    total = time.monotonic() - started
    mode = "the whole suite (but e2e)" if args.full else "the named tests"
    killed = len(mutants) - len(bad)
    print(f"\nScore against {mode}: {killed}/{len(mutants)} killed ({killed / len(mutants):.0%}).")
    if bad:
        print(f"\n{len(bad)} of {len(mutants)} mutants not killed in {total:.0f} s: ", end="")
        print(", ".join(m.id for m in bad))
        return 1
    print(f"\nAll {len(mutants)} mutants killed in {total:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
