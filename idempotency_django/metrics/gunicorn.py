"""A gunicorn configuration for the Prometheus exporter under several workers:

    gunicorn -c python:idempotency_django.metrics.gunicorn -w 4 myproject.wsgi

(or copy these lines into your own ``gunicorn.conf.py``). prometheus-client's multiprocess
mode needs ``PROMETHEUS_MULTIPROC_DIR`` set before prometheus_client is first imported,
emptied when the server starts (an earlier run's files would be summed in), and each
worker's live gauges dropped when it exits. This module does all three: it sets the
directory (unless the environment names one) when gunicorn reads it, in the master, before
any worker imports the application. docs/observability.md.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="prometheus-multiproc-")


def on_starting(server: Any) -> None:
    """Start from an empty directory: the files of a previous run are not this run's."""
    directory = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.db"):
        stale.unlink()


def child_exit(server: Any, worker: Any) -> None:
    """A worker exited: its live gauges (``livesum``, ``livemax``) no longer count; its
    counters and histograms stay in the sums."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)  # type: ignore[no-untyped-call]
