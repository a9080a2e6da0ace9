"""The nemesis: faults injected on a schedule, each recorded in the history (``start``,
``stop``, targets, what was done).

App-server faults:

- ``kill``: SIGKILL the worker that has just charged the provider (the newest ledger line's
  pid; a random worker if none charged within 2 s): the key stays claimed until its lease
  lapses, and a retry runs the view again. Excused (the process died after its effect).
- ``pause``: SIGSTOP that worker for longer than the lease (1.5 x lease + 1 s), then
  SIGCONT: another worker takes the key over once the lease lapses and runs the view
  again. Excused (a pause longer than the lease); the frozen worker's completion is
  fenced out by the take-over's token.
- ``pause-short``: SIGSTOP for a third of the lease: the heartbeat resumes in time, no
  take-over. Never an excuse.
- ``skew``: the second app server's clocks run ``SKEW_SECONDS`` ahead (libfaketime,
  ``FAKETIME=+30``) for the whole run; the fault is recorded from the first injection to
  the end of traffic. A clock that jumps mid-run cannot be had: libfaketime fails
  Python's ``time.sleep`` (``clock_nanosleep`` with EINVAL) unless the monotonic clock
  is faked too, and a monotonic clock that jumps back hangs every sleep. Never an
  excuse: leases run on the store's clock.

Store faults (``stall``, ``sleep``, ``terminate``, ``restart``, ``failover``,
``kill-primary``) are the topology's (``Topology.inject``); network faults (``partition``,
``delay``) are ``network.Network``'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.campaign.history import History

APP_FAULTS = frozenset({"kill", "pause", "pause-short", "skew"})
SKEW_SECONDS = 30
FAKETIME_LIBRARY = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"


def faketime_env() -> dict[str, str]:
    """The environment of the app server whose clocks run ahead (``skew``)."""
    return {"LD_PRELOAD": FAKETIME_LIBRARY, "FAKETIME": f"+{SKEW_SECONDS}"}


class Nemesis:
    def __init__(
        self,
        faults: list[str],
        history: History,
        *,
        workers: Callable[[], list[int]],
        ledger: Path,
        lease: float,
        seed: int,
        inject_store: Callable[[str, float], str],
        inject_network: Callable[[str, float], str] | None = None,
        skewed: bool = False,
        skew_workers: Callable[[], list[int]] | None = None,
        interval: tuple[float, float] = (1.0, 3.0),
    ) -> None:
        self.faults = faults
        self.history = history
        self.workers = workers
        self.ledger = ledger
        self.lease = lease
        self.rng = random.Random(seed ^ 0x5EED)
        self.inject_store = inject_store
        self.inject_network = inject_network
        self.skewed = skewed
        self.skew_workers = skew_workers
        self.interval = interval
        self.stopping = threading.Event()
        self.errors: list[str] = []
        self.injected = 0
        self.last_end = 0.0  # time.time() of the last fault's end

    def _newest_charger(self, within: float = 2.0) -> int | None:
        """The pid of the next charge the provider makes (a ledger line written after now),
        waiting up to ``within`` seconds."""
        size = self.ledger.stat().st_size if self.ledger.exists() else 0
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.ledger.exists() and self.ledger.stat().st_size > size:
                with self.ledger.open("rb") as file:
                    file.seek(size)
                    lines = file.read().splitlines()
                for line in lines:
                    with contextlib.suppress(ValueError):
                        return int(json.loads(line)["pid"])
            time.sleep(0.005)  # the ledger is the signal; a short poll keeps us close to it
        return None

    def _target(self) -> int:
        pid = self._newest_charger()
        workers = self.workers()
        if pid is None or pid not in workers:
            pid = self.rng.choice(workers)
        return pid

    def inject(self, fault: str) -> None:
        seconds = {
            "pause": 1.5 * self.lease + 1.0,
            "pause-short": self.lease / 3,
            "skew": 0.0,
            "restart": 1.0,
            "stall": min(0.6 * self.lease, 2.0),
            "sleep": min(0.6 * self.lease, 2.0),
            "partition": min(0.6 * self.lease, 2.0),
            "partition-long": 1.5 * self.lease + 1.0,
            "delay": 2 * self.lease,
        }.get(fault, 0.0)
        targets: list[int] = []
        if fault in ("kill", "pause", "pause-short"):
            targets = [self._target()]
        elif fault in ("skew", "partition", "partition-long", "delay"):
            # the second app server: the skewed one, the one behind the faulty network
            targets = self.skew_workers() if self.skew_workers is not None else []
        start = self.history.add(
            process="nemesis", type="start", fault=fault, targets=targets, seconds=seconds
        )
        detail = ""
        try:
            detail = self._do(fault, targets, seconds)
        except Exception as error:
            detail = f"failed: {type(error).__name__}: {error}"
            self.errors.append(f"{fault}: {detail}")
        end = self.history.add(
            process="nemesis", type="stop", fault=fault, targets=targets, detail=detail,
            start=start["index"],
        )  # fmt: skip
        self.last_end = end["t"]
        self.injected += 1

    def _do(self, fault: str, targets: list[int], seconds: float) -> str:
        if fault == "kill":
            os.kill(targets[0], signal.SIGKILL)
            return f"SIGKILL {targets[0]}"
        if fault in ("pause", "pause-short"):
            os.kill(targets[0], signal.SIGSTOP)
            try:
                time.sleep(seconds)  # the pause's length is the fault
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(targets[0], signal.SIGCONT)
            return f"SIGSTOP {targets[0]} for {seconds:.1f} s, then SIGCONT"
        if fault == "skew":
            if not self.skewed:
                raise RuntimeError("skew needs the second app server under libfaketime")
            return f"clocks of {targets} +{SKEW_SECONDS} s (libfaketime, the whole run)"
        if fault in ("partition", "partition-long", "delay", "loss"):
            if self.inject_network is None:
                raise RuntimeError(f"{fault} needs --network (the app in a namespace)")
            return self.inject_network(fault, seconds)
        return self.inject_store(fault, seconds)

    def run(self, until: float) -> None:
        """Inject the faults in turn (each in a random order per round) until
        ``time.monotonic()`` passes ``until``."""
        time.sleep(1.0)  # let traffic start
        order: list[str] = []
        while time.monotonic() < until and not self.stopping.is_set():
            if not order:
                order = list(self.faults)
                self.rng.shuffle(order)
            self.inject(order.pop())
            time.sleep(self.rng.uniform(*self.interval))


def describe(faults: list[str]) -> str:
    return ",".join(faults) if faults else "none"


def parse(text: str) -> list[str]:
    return [
        fault for fault in (part.strip() for part in text.split(",")) if fault and fault != "none"
    ]


def targets_of(entry: dict[str, Any]) -> list[int]:
    return [int(pid) for pid in entry.get("targets") or []]
