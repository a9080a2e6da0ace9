"""Calls released together: the one barrier helper of the tests and the tools.

Concurrency tests need their duplicates to reach the claim at the same moment, not one
after the other as threads happen to start; a barrier releases them together.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def start_together(
    count: int, call: Callable[[], T], *, within: float = 30.0
) -> tuple[queue.Queue[T], list[threading.Thread]]:
    """Start ``count`` threads that each call ``call`` once, released together by a barrier.

    Returns at once: each result is put on the queue as it comes, and the caller joins the
    threads (a test often holds one call inside its view while it reads the others')."""
    barrier = threading.Barrier(count, timeout=within)
    results: queue.Queue[T] = queue.Queue()

    def run() -> None:
        barrier.wait()
        results.put(call())

    threads = [threading.Thread(target=run) for _ in range(count)]
    for thread in threads:
        thread.start()
    return results, threads


def concurrently(count: int, call: Callable[[], T], *, within: float = 60.0) -> list[T]:
    """Call ``call`` from ``count`` threads released together and wait for them all: the
    results in the order they came; an exception in any thread fails the caller."""

    def guarded() -> T | BaseException:
        try:
            return call()
        except BaseException as exc:
            return exc

    results, threads = start_together(count, guarded, within=within)
    for thread in threads:
        thread.join(within)
    assert not any(thread.is_alive() for thread in threads), f"not done within {within}s"
    done = [results.get_nowait() for _ in range(results.qsize())]
    errors = [result for result in done if isinstance(result, BaseException)]
    assert not errors, errors
    return done  # type: ignore[return-value]
