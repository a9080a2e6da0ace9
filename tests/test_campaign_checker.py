"""The campaign's checker (``tools.campaign.checker``) on small recorded runs: what it
must flag and what a recorded fault excuses. The planted-defect campaigns that prove it
against a live server are ``python -m tools.campaign.ci``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tools.campaign import checker

LEASE = 3.0
T0 = 1_000_000.0


class Run:
    """A run directory written by hand: the history, the ledger, the server's log."""

    def __init__(self, directory: Path, *, deduplicate: bool = False) -> None:
        self.directory = directory
        (directory / "ledger").mkdir()
        self.history: list[dict[str, Any]] = []
        self.ledger: list[dict[str, Any]] = []
        self.server: list[dict[str, Any]] = []
        self.charges: dict[str, list[dict[str, Any]]] = {"alice": [], "bob": []}
        self.deduplicate = deduplicate
        self.next_charge = 1

    def _add(self, t: float, **entry: Any) -> dict[str, Any]:
        entry = {"index": len(self.history), "t": T0 + t, **entry}
        self.history.append(entry)
        return entry

    def request(
        self,
        key: str,
        amount: int,
        *,
        begin: float,
        end: float | None,
        pid: int = 1,
        charge_at: float | None = None,
        answer: str | None = None,
        status: int = 201,
        process: str = "c0",
        replayed: bool = False,
        deduplicated: bool = False,
    ) -> str | None:
        """One attempt, as the client, the server and the provider record it; returns the
        answer's body (a new charge's unless ``answer`` is given)."""
        common = {"process": process, "key": key, "amount": amount, "user": "alice"}
        self._add(begin, type="invoke", **common)
        self.server.append({"t": T0 + begin, "pid": pid, "event": "begin", "key": key})
        if charge_at is not None:
            self.ledger.append(
                {"t": T0 + charge_at, "pid": pid, "amount": amount, "deduplicated": deduplicated}
            )
            if answer is None:
                charge = {"id": f"ch_{self.next_charge}", "amount": amount}
                self.next_charge += 1
                self.charges["alice"].append(charge)
                answer = json.dumps({**charge, "currency": "EUR", "status": "succeeded"})
        if end is None:
            return answer
        self.server.append(
            {"t": T0 + end, "pid": pid, "event": "end", "key": key, "status": status}
        )
        kind = "fail" if status == 409 else "info" if status >= 500 else "ok"
        body = answer or "{}"
        self._add(
            end,
            type=kind,
            status=status,
            response=str(hash(body)),
            response_body=body,
            replayed=replayed,
            **common,
        )
        return answer

    def timeout(self, key: str, amount: int, at: float) -> None:
        self._add(at, type="info", process="c0", key=key, amount=amount, user="alice",
                  error="TimeoutError")  # fmt: skip

    def fault(self, fault: str, pid: int | None, start: float, stop: float) -> None:
        entry = self._add(start, process="nemesis", type="start", fault=fault,
                          targets=[] if pid is None else [pid], seconds=stop - start)  # fmt: skip
        self._add(stop, process="nemesis", type="stop", fault=fault, start=entry["index"],
                  targets=entry["targets"])  # fmt: skip

    def final(self, key: str, amount: int, answer: str | None, at: float = 60.0) -> None:
        for offset in (0.0, 0.1):
            self.request(key, amount, begin=at + offset, end=at + offset + 0.01,
                         answer=answer, process="final", replayed=True, pid=9)  # fmt: skip

    def check(self) -> checker.Result:
        def lines(entries: list[dict[str, Any]]) -> str:
            return "".join(json.dumps(entry) + "\n" for entry in entries)

        run = {"store": "test", "lease": LEASE, "max_run": 10.0, "traffic_start": T0,
               "seconds": 1, "deduplicate": self.deduplicate}  # fmt: skip
        (self.directory / "run.json").write_text(json.dumps(run))
        (self.directory / "history.jsonl").write_text(lines(self.history))
        (self.directory / "ledger" / "ledger.jsonl").write_text(lines(self.ledger))
        (self.directory / "server-1.jsonl").write_text(lines(self.server))
        (self.directory / "charges.json").write_text(json.dumps(self.charges))
        return checker.check(self.directory)


def test_one_execution_and_its_replays_pass(tmp_path: Path) -> None:
    run = Run(tmp_path)
    answer = run.request("k1", 1, begin=0.0, end=0.5, charge_at=0.3)
    run.request("k1", 1, begin=1.0, end=1.01, answer=answer, replayed=True)
    run.final("k1", 1, answer)
    result = run.check()
    assert result.violations == []
    assert (result.keys, result.executions) == (1, 1)


def test_a_second_execution_without_a_fault_is_a_violation(tmp_path: Path) -> None:
    """What a store that skips the claim produces: two requests, two charges."""
    run = Run(tmp_path)
    first = run.request("k1", 1, begin=0.0, end=0.5, charge_at=0.3, pid=1)
    run.request("k1", 1, begin=0.1, end=0.6, charge_at=0.4, pid=2)
    run.final("k1", 1, first)
    result = run.check()
    assert any("2 executions, 0 excused" in line for line in result.violations)
    assert not result.ok


def test_a_kill_after_the_charge_excuses_the_next_run(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.request("k1", 1, begin=0.0, end=None, charge_at=0.3, pid=1)
    run.fault("kill", 1, 0.35, 0.35)
    run.timeout("k1", 1, 0.4)
    answer = run.request("k1", 1, begin=3.5, end=4.0, charge_at=3.8, pid=2)
    run.final("k1", 1, answer)
    result = run.check()
    assert result.violations == []
    assert [fault for fault, _ in result.excused] == ["kill"]


def test_a_kill_after_the_request_ended_excuses_nothing(tmp_path: Path) -> None:
    run = Run(tmp_path)
    first = run.request("k1", 1, begin=0.0, end=0.5, charge_at=0.3, pid=1)
    run.fault("kill", 1, 0.6, 0.6)
    run.request("k1", 1, begin=3.5, end=4.0, charge_at=3.8, pid=2, answer=first)
    run.final("k1", 1, first)
    assert any("2 executions, 0 excused" in line for line in run.check().violations)


def test_a_pause_shorter_than_the_lease_excuses_nothing(tmp_path: Path) -> None:
    run = Run(tmp_path)
    first = run.request("k1", 1, begin=0.0, end=2.0, charge_at=0.3, pid=1)
    run.fault("pause", 1, 0.4, 0.4 + LEASE / 3)
    run.request("k1", 1, begin=1.0, end=1.5, charge_at=1.3, pid=2, answer=first)
    run.final("k1", 1, first)
    assert any("2 executions, 0 excused" in line for line in run.check().violations)


def test_a_pause_longer_than_the_lease_excuses_the_take_over(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.request("k1", 1, begin=0.0, end=6.0, charge_at=0.3, pid=1)
    run.fault("pause", 1, 0.4, 0.4 + 1.5 * LEASE + 1)
    answer = run.request("k1", 1, begin=4.0, end=4.5, charge_at=4.3, pid=2)
    run.final("k1", 1, answer)
    result = run.check()
    assert result.violations == []
    assert [fault for fault, _ in result.excused] == ["pause", "answer"]


def test_a_replay_that_differs_is_a_violation(tmp_path: Path) -> None:
    run = Run(tmp_path)
    answer = run.request("k1", 1, begin=0.0, end=0.5, charge_at=0.3)
    assert answer is not None
    run.request("k1", 1, begin=1.0, end=1.01, answer=answer + " ", replayed=True)
    run.final("k1", 1, answer)
    assert any("but the stored answer is" in line for line in run.check().violations)


def test_a_2xx_without_a_committed_charge_is_a_violation(tmp_path: Path) -> None:
    run = Run(tmp_path)
    answer = run.request("k1", 1, begin=0.0, end=0.5, charge_at=0.3)
    run.charges["alice"] = []  # the charge row never committed
    run.final("k1", 1, answer)
    assert any("names no committed charge" in line for line in run.check().violations)


def test_a_key_in_progress_long_after_the_faults_is_a_violation(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.fault("stall", None, 0.0, 1.0)
    answer = run.request("k1", 1, begin=0.0, end=0.5, charge_at=0.3)
    run.request("k1", 1, begin=20.0, end=20.01, status=409, answer="{}")
    run.final("k1", 1, answer)
    assert any("still in progress" in line for line in run.check().violations)


def test_a_deduplicating_provider_that_charged_twice_is_a_violation_even_if_excused(
    tmp_path: Path,
) -> None:
    run = Run(tmp_path, deduplicate=True)
    run.request("k1", 1, begin=0.0, end=None, charge_at=0.3, pid=1)
    run.fault("kill", 1, 0.35, 0.35)
    answer = run.request("k1", 1, begin=3.5, end=4.0, charge_at=3.8, pid=2)
    run.final("k1", 1, answer)
    assert any("deduplicating provider charged 2x" in line for line in run.check().violations)


def test_a_deduplicated_second_run_keeps_one_provider_charge(tmp_path: Path) -> None:
    run = Run(tmp_path, deduplicate=True)
    run.request("k1", 1, begin=0.0, end=None, charge_at=0.3, pid=1)
    run.fault("kill", 1, 0.35, 0.35)
    answer = run.request("k1", 1, begin=3.5, end=4.0, charge_at=3.8, pid=2, deduplicated=True)
    run.final("k1", 1, answer)
    result = run.check()
    assert result.violations == []
    assert (result.executions, result.provider_charges) == (2, 1)


def _declined_then_run_again(run: Run) -> None:
    """A declined card's 402, then the first request after the campaign runs the view again
    (not a replay): the 402 was never stored."""
    declined = '{"type": "urn:example-payments:card-declined", "status": 402}'
    run.request("k1", 1, begin=0.0, end=4.0, answer=declined, status=402)
    run.request("k1", 1, begin=60.0, end=60.3, answer=declined, status=402, process="final")
    run.request("k1", 1, begin=60.4, end=60.41, answer=declined, status=402,
                process="final", replayed=True)  # fmt: skip


def test_an_answer_lost_in_a_store_outage_longer_than_the_lease_may_run_again(
    tmp_path: Path,
) -> None:
    run = Run(tmp_path)
    run.fault("restart", None, 0.5, 0.5 + LEASE)
    _declined_then_run_again(run)
    assert run.check().violations == []


def test_an_answer_lost_without_a_fault_is_a_violation(tmp_path: Path) -> None:
    run = Run(tmp_path)
    run.fault("restart", None, 0.5, 0.5 + LEASE / 3)  # too short for the lease to lapse
    _declined_then_run_again(run)
    assert any("after the campaign, 402 replayed=False" in v for v in run.check().violations)
