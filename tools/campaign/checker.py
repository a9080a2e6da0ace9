"""The checker: a campaign's history and the provider's ledger, per key, against the
promise. ``python -m tools.campaign.checker RUN_DIR`` checks a recorded run again.

Per key it asserts:

1. **executions ≤ 1 + excused.** An execution is a charge in the provider's ledger (the
   amount names the key). One is *excused* by a recorded fault of the process that made it,
   during the request that made it: a SIGKILL after its side effect, or a pause longer
   than the lease (then another worker may take the key over); or a store or network
   fault during that request, which then failed (5xx) after its side effect: the view's own
   work failed, a failure is not stored, and the retry runs the view again (the contract
   of every 5xx); or a store outage during that request as long as two thirds of the lease
   (a restart, a failover, a long partition): the store stayed unreachable for the rest of
   the run's lease, which lapsed. Each excused execution is listed with its fault. With a
   deduplicating provider, also: **provider charges ≤ 1**, excused or not (downstream
   keys).
2. **Replays are byte-equal to the stored answer**: every definitive answer (2xx, or a
   stored 4xx) equals the answer replayed after the campaign, status and bytes; an answer
   of an excused execution that lost its completion to the take-over may differ (listed).
3. **No 2xx without a committed effect**: a 201's charge id is in the account's charges,
   with the key's amount, and the provider charged that amount.
4. **Nothing in progress after the faults**: no ``409`` later than lease + MAX_RUN_SECONDS
   (+ 2 s of slack) after the last fault ended, and every key got a definitive answer.
5. **Every key answered replays after the campaign**: the final request is a replay
   (``Idempotent-Replayed: true``) of the stored answer.
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.campaign.history import read

SLACK_SECONDS = 2.0
# Outages of the store that may outlast the rest of a run's lease (§ "the store stayed
# unreachable for the rest of that run's lease"): only one as long as 2/3 of the lease can
# (the heartbeat renews every third of it), and only then is a second run excused.
NETWORK_FAULTS = frozenset({"partition", "partition-long", "delay"})
STORE_OUTAGES = frozenset({"restart", "failover", "kill-primary", "partition-long"})
# Faults of the store or of the network to it: one that fails the view's own work after
# its side effect (a 5xx: not stored, the key released or kept until its lease lapses)
# excuses the run that a retry then makes.
STORE_FAULTS = frozenset(
    {
        "stall",
        "sleep",
        "terminate",
        "restart",
        "failover",
        "kill-primary",
        "partition",
        "partition-long",
        "delay",
        "loss",
    }
)


@dataclass
class Request:
    pid: int
    key: str
    begin: float
    end: float | None = None
    status: int | None = None


@dataclass
class Result:
    run: dict[str, Any]
    keys: int = 0
    executions: int = 0
    provider_charges: int = 0
    excused: list[tuple[str, str]] = field(default_factory=list)  # (fault, what)
    violations: list[str] = field(default_factory=list)
    answers: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        return not self.violations

    def row(self) -> dict[str, Any]:
        excused_by = Counter(fault for fault, _ in self.excused if fault != "answer")
        return {
            "store": self.run.get("store", "?"),
            "faults": ",".join(f"{name} x{n}" for name, n in sorted(self.faults.items())) or "none",
            "keys": self.keys,
            "executions": self.executions,
            "provider charges": self.provider_charges,
            "excused": ", ".join(f"{n} ({name})" for name, n in sorted(excused_by.items())) or "0",
            "violations": len(self.violations),
            "503s": self.answers.get("503", 0),
            "unknown": self.answers.get("info", 0),
            "seconds": round(float(self.run.get("seconds", 0))),
        }


def _server_requests(
    directory: Path, skew: dict[str, float]
) -> tuple[dict[int, list[Request]], dict[int, float]]:
    """Each worker's keyed requests, and the clock offset of each worker whose server ran
    with a skewed clock (its times are corrected by it here)."""
    requests: dict[int, list[Request]] = defaultdict(list)
    open_: dict[int, Request] = {}
    lines = [line for path in directory.glob("server-*.jsonl") for line in read(path)]
    offsets = {
        int(line["pid"]): float(skew.get(str(line.get("port")), 0.0))
        for line in lines
        if line["event"] == "begin"
    }
    for line in lines:
        line["t"] -= offsets.get(int(line["pid"]), 0.0)
    for line in sorted(lines, key=lambda entry: entry["t"]):
        pid = int(line["pid"])
        if line["event"] == "begin":
            request = Request(pid, line["key"], line["t"])
            open_[pid] = request
            requests[pid].append(request)
        elif line["event"] == "end" and pid in open_:
            open_[pid].end = line["t"]
            open_[pid].status = line.get("status")
            del open_[pid]
    return requests, offsets


def _request_of(requests: dict[int, list[Request]], pid: int, t: float) -> Request | None:
    found = None
    for request in requests.get(pid, []):
        if request.begin <= t and (request.end is None or request.end >= t):
            found = request
    return found


def _excuse(
    charge: dict[str, Any], request: Request | None, faults: list[dict[str, Any]], lease: float
) -> str | None:
    """The recorded fault that excuses this execution, described, or None."""
    pid = int(charge["pid"])
    ended = request.end if request is not None and request.end is not None else float("inf")
    began = request.begin if request is not None else charge["t"]
    for fault in faults:
        name = fault["fault"]
        if name in NETWORK_FAULTS and pid not in fault["targets"]:
            continue  # a partition or delay of the other app server's network
        if (
            name in STORE_FAULTS
            and request is not None
            and (request.status or 0) >= 500
            and fault["t"] <= ended
            and fault["stop_t"] >= began
        ):
            return (
                f"by {name} (during the request, which failed with {request.status} after "
                f"its charge: a failure is not stored, and a retry runs the view again)"
            )
        outage = fault["stop_t"] - fault["t"]
        if (
            name in STORE_OUTAGES
            and outage >= 2 / 3 * lease
            and fault["t"] <= ended
            and fault["stop_t"] >= began
        ):
            return (
                f"by {name} (the store unreachable {outage:.1f} s during the request, at "
                f"least the rest of its lease: renewed every {lease / 3:.1f} s, it lapses "
                f"{2 / 3 * lease:.1f} s into an outage at the earliest)"
            )
        if pid not in fault["targets"]:
            continue
        if name == "kill" and charge["t"] <= fault["t"] <= ended:
            return (
                f"by kill (SIGKILL of pid {pid} {fault['t'] - charge['t']:.2f} s after its charge)"
            )
        if (
            name == "pause"
            and fault["seconds"] > lease
            and fault["t"] <= ended
            and fault["stop_t"] >= began
        ):
            return (
                f"by pause (SIGSTOP of pid {pid} for {fault['seconds']:.1f} s > lease "
                f"{lease:.1f} s, {fault['t'] - charge['t']:+.2f} s from its charge)"
            )
    return None


def check(directory: Path) -> Result:
    run = json.loads((directory / "run.json").read_text())
    lease = float(run["lease"])
    max_run = float(run["max_run"])
    history = read(directory / "history.jsonl")
    ledger = read(directory / "ledger" / "ledger.jsonl")
    charges = json.loads((directory / "charges.json").read_text())
    requests, offsets = _server_requests(directory, run.get("skew", {}))
    by_key: dict[str, list[Request]] = defaultdict(list)
    for listed in requests.values():
        for request in listed:
            by_key[request.key].append(request)
    for line in ledger:
        line["t"] -= offsets.get(int(line["pid"]), 0.0)
    result = Result(run=run)

    faults: list[dict[str, Any]] = []
    starts = {}
    for entry in history:
        if entry.get("process") != "nemesis":
            continue
        if entry["type"] == "start":
            starts[entry["index"]] = entry
        elif entry["type"] == "stop":
            start = starts[entry["start"]]
            faults.append({**start, "stop_t": entry["t"], "detail": entry.get("detail", "")})
            result.faults[start["fault"]] += 1
    faults_end = max((fault["stop_t"] for fault in faults), default=run.get("traffic_start", 0))

    keys: dict[str, dict[str, Any]] = {}
    entries: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for entry in history:
        if entry.get("process") == "nemesis":
            continue
        keys.setdefault(entry["key"], {"amount": entry["amount"], "user": entry["user"]})
        entries[entry["key"]].append(entry)
        if entry["type"] == "info":
            result.answers["info"] += 1
        if entry.get("status"):
            result.answers[str(entry["status"])] += 1
    result.keys = len(keys)
    by_amount: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for line in ledger:
        by_amount[int(line["amount"])].append(line)
    charge_ids = {
        user: {charge["id"]: charge["amount"] for charge in listed}
        for user, listed in charges.items()
    }

    for key, info in sorted(keys.items(), key=lambda item: item[1]["amount"]):
        amount = info["amount"]
        executed = sorted(by_amount.get(amount, []), key=lambda line: line["t"])
        result.executions += len(executed)
        charged = [line for line in executed if not line.get("deduplicated")]
        result.provider_charges += len(charged)
        excused = []
        for line in executed:
            why = _excuse(line, _request_of(requests, int(line["pid"]), line["t"]), faults, lease)
            if why is not None:
                fault = why.split(" ")[1]
                excused.append((fault, f"{key}: execution in pid {line['pid']} {why}"))
        if len(executed) > 1:
            result.excused.extend(excused[: len(executed) - 1])
        if len(executed) > 1 + len(excused):
            pids = ", ".join(
                f"pid {line['pid']} at +{line['t'] - run['traffic_start']:.2f} s"
                for line in executed
            )
            result.violations.append(
                f"{key}: {len(executed)} executions, {len(excused)} excused ({pids})"
            )
        if run.get("deduplicate") and len(charged) > 1:
            result.violations.append(f"{key}: the deduplicating provider charged {len(charged)}x")

        attempts = entries[key]
        final = [e for e in attempts if e["process"] == "final" and e["type"] != "invoke"]
        # A run of the key that a fault cut before its outcome was stored, with or without a
        # charge (a declined card charges nothing, and its 402 is lost the same way).
        cut = bool(excused) or any(
            _excuse({"pid": r.pid, "t": r.begin}, r, faults, lease) is not None
            for r in by_key.get(key, [])
        )
        if len(final) == 2 and cut and not final[0].get("replayed"):
            # The first request after the campaign ran the view again: an excused run lost
            # its completion and its lease lapsed. The second must replay that answer.
            final = final[1:]
        answers = [e for e in attempts if e["process"] != "final" and e["type"] == "ok"]
        late_409 = [
            e
            for e in attempts
            if e.get("status") == 409 and e["t"] > faults_end + lease + max_run + SLACK_SECONDS
        ]
        if late_409:
            result.violations.append(
                f"{key}: still in progress {late_409[-1]['t'] - faults_end:.1f} s after the "
                f"faults stopped (lease {lease} s + MAX_RUN_SECONDS {max_run} s)"
            )
        if not answers:
            result.violations.append(f"{key}: no definitive answer during the campaign")
            continue
        if not final:
            result.violations.append(f"{key}: no final replay was sent")
            continue
        stored = final[-1]
        unreplayed = [e for e in final if e["type"] != "ok" or not e.get("replayed")]
        if unreplayed or any(e["response"] != stored["response"] for e in final):
            e = (unreplayed or final)[0]
            result.violations.append(
                f"{key}: after the campaign, {e.get('status')} replayed="
                f"{e.get('replayed')} ({e.get('response_body', e.get('error'))!r})"
            )
            continue
        differing = [
            e
            for e in answers
            if (e["status"], e["response"]) != (stored["status"], stored["response"])
        ]
        if differing and cut and len(differing) <= max(len(excused), 1):
            result.excused.extend(
                (
                    "answer",
                    f"{key}: answer {e['status']} {e['response_body']!r} differs from the "
                    f"stored {stored['response_body']!r}: an excused run's lost completion",
                )
                for e in differing
            )
        elif differing:
            e = differing[0]
            result.violations.append(
                f"{key}: answered {e['status']} {e['response_body']!r} (entry {e['index']}), "
                f"but the stored answer is {stored['status']} {stored['response_body']!r}"
            )
        for e in answers:
            if 200 <= e["status"] < 300:
                body = json.loads(e["response_body"])
                if charge_ids.get(info["user"], {}).get(body.get("id")) != amount:
                    result.violations.append(
                        f"{key}: 2xx {body!r} (entry {e['index']}) names no committed charge "
                        f"of {amount} for {info['user']}"
                    )
                elif not executed:
                    result.violations.append(f"{key}: 2xx, but the provider charged nothing")
    return result


COLUMNS = (
    "store",
    "faults",
    "keys",
    "executions",
    "provider charges",
    "excused",
    "violations",
    "503s",
    "unknown",
    "seconds",
)


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table (it reads as text too)."""
    lines = [
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    lines += ["| " + " | ".join(str(row[c]) for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def report(result: Result, out: Any = sys.stdout) -> None:
    print(table([result.row()]), file=out)
    for _, line in result.excused:
        print(f"  excused: {line}", file=out)
    for line in result.violations:
        print(f"  VIOLATION: {line}", file=out)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tools.campaign.checker RUN_DIR", file=sys.stderr)
        return 2
    result = check(Path(args[0]))
    report(result)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
