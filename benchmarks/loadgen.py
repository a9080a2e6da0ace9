#!/usr/bin/env python
"""A small HTTP load generator for ``benchmarks/run.py``, run as a process of its own.

``POST`` one JSON body with ``X-Bench-User`` and an ``Idempotency-Key`` that is new for
every request (a random UUID) or fixed, in one of two modes:

- closed loop (``--concurrency N``): N threads send back to back (the throughput fallback
  when ``wrk`` is not installed);
- open loop (``--rate R``): requests are *scheduled* R per second, whatever the server does,
  and each latency counts from its scheduled time, so a stalled server shows up in the
  latency instead of silently lowering the rate (no coordinated omission). This is the
  latency probe of the purge scenario.

It runs for ``--duration`` seconds or until SIGINT/SIGTERM, then prints one JSON object:
counts, statuses, percentiles and, with ``--samples``, every ``[sent_at, latency, status]``
(``sent_at`` in ``time.time()`` seconds, so the caller can line samples up with events).
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import sys
import threading
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

TIMEOUT_SECONDS = 10.0


class Load:
    def __init__(self, args: argparse.Namespace) -> None:
        url = urlsplit(args.url)
        self.host = url.hostname or "127.0.0.1"
        self.port = url.port or 80
        self.path = url.path or "/"
        self.user: str = args.user
        self.fixed_key: str | None = args.key
        self.token: str | None = args.token
        self.body: bytes = args.body.encode()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.samples: list[tuple[float, float, int]] = []  # (sent_at, latency, status or 0)
        self.errors: dict[str, int] = {}

    def send(self) -> int:
        """One request; its status, or 0 when it failed without an answer."""
        key = self.fixed_key or str(uuid.uuid4())
        connection = http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT_SECONDS)
        try:
            connection.request(
                "POST",
                self.path,
                body=self.body,
                headers={
                    "Content-Type": "application/json",
                    "X-Bench-User": self.user,
                    "Idempotency-Key": key,
                    "Connection": "close",
                    **({"Authorization": f"Token {self.token}"} if self.token else {}),
                },
            )
            response = connection.getresponse()
            response.read()
            return response.status
        except (OSError, http.client.HTTPException) as exc:
            name = type(exc).__name__
            with self.lock:
                self.errors[name] = self.errors.get(name, 0) + 1
            return 0
        finally:
            connection.close()

    def record(self, sent_at: float, latency: float, status: int) -> None:
        with self.lock:
            self.samples.append((sent_at, latency, status))

    def closed_loop(self, deadline: float) -> None:
        while not self.stop.is_set() and time.monotonic() < deadline:
            wall, started = time.time(), time.monotonic()
            status = self.send()
            self.record(wall, time.monotonic() - started, status)

    def open_loop(self, rate: float, deadline: float, schedule: _Schedule) -> None:
        while not self.stop.is_set():
            due = schedule.next()
            if due >= deadline:
                return
            pause = due - time.monotonic()
            if pause > 0 and self.stop.wait(pause):
                return
            wall = time.time() + (due - time.monotonic())
            status = self.send()
            self.record(wall, time.monotonic() - due, status)


class _Schedule:
    """Send times ``start + i / rate``, handed out once each, to any thread."""

    def __init__(self, start: float, rate: float) -> None:
        self.start = start
        self.rate = rate
        self.index = 0
        self.lock = threading.Lock()

    def next(self) -> float:
        with self.lock:
            due = self.start + self.index / self.rate
            self.index += 1
            return due


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(pct / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--user", default="alice")
    parser.add_argument("--key", default=None, help="a fixed key (default: new per request)")
    parser.add_argument("--body", required=True)
    parser.add_argument("--token", default=None, help="sent as Authorization: Token TOKEN")
    parser.add_argument("--duration", type=float, required=True)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--concurrency", type=int, help="closed loop with N threads")
    mode.add_argument("--rate", type=float, help="open loop, requests per second")
    parser.add_argument("--threads", type=int, default=16, help="threads of the open loop")
    parser.add_argument("--samples", action="store_true", help="print every sample")
    args = parser.parse_args(argv)

    load = Load(args)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: load.stop.set())
    started = time.monotonic()
    deadline = started + args.duration
    if args.concurrency:
        count = args.concurrency
        threads = [
            threading.Thread(target=load.closed_loop, args=(deadline,), daemon=True)
            for _ in range(count)
        ]
    else:
        schedule = _Schedule(started + 0.05, args.rate)
        threads = [
            threading.Thread(
                target=load.open_loop, args=(args.rate, deadline, schedule), daemon=True
            )
            for _ in range(args.threads)
        ]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        # Wake up now and then, so that a signal handler's stop is seen promptly.
        for thread in threads:
            thread.join(0.2)
    elapsed = time.monotonic() - started

    with load.lock:
        samples = list(load.samples)
    latencies = [latency for _, latency, status in samples if status]
    statuses: dict[str, int] = {}
    for _, _, status in samples:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    result: dict[str, Any] = {
        "requests": len(samples),
        "answered": len(latencies),
        "duration": elapsed,
        "statuses": statuses,
        "errors": load.errors,
        "p50": percentile(latencies, 50),
        "p90": percentile(latencies, 90),
        "p99": percentile(latencies, 99),
        "max": max(latencies, default=float("nan")),
    }
    if args.samples:
        result["samples"] = samples
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
