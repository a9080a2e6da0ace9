"""The Prometheus exporter across processes, as gunicorn's workers run it: each counts in
its own process (prometheus-client's multiprocess files), and whichever answers the scrape
exports the sums; a worker that exited no longer counts in the live gauges. The processes
are real (``python -c``), so prometheus-client picks its multiprocess mode at import as it
does under gunicorn (``idempotency_django.metrics.gunicorn``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

WORKER = textwrap.dedent(
    """
    import sys
    from idempotency_django.metrics import prometheus
    recorder = prometheus.recorder()
    from idempotency_django.core.observe import Frame
    frame = Frame(route="charges/", method="POST", store="database", started=0.0)
    for _ in range(int(sys.argv[1])):
        recorder.end(frame, "replayed", 0.001)
    recorder.end(frame, "claimed", 0.001)
    recorder.heartbeat(int(sys.argv[2]), float(sys.argv[3]), 0.5, 0)
    print("done", flush=True)
    sys.stdin.read()  # alive until told to exit
    """
)

SCRAPE = textwrap.dedent(
    """
    from idempotency_django.core import observe
    observe.purge_lag_seconds = lambda: None  # no database here
    from prometheus_client import generate_latest
    from idempotency_django.metrics import prometheus
    print(generate_latest(prometheus.registry()).decode())
    """
)


CHILD_EXIT = textwrap.dedent(
    """
    import sys
    from idempotency_django.metrics import gunicorn

    class Worker:
        pid = int(sys.argv[1])

    gunicorn.child_exit(None, Worker())
    """
)


def run(code: str, directory: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def scrape(directory: Path) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    process = run(SCRAPE, directory)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(out)
        for sample in family.samples
    }


def test_a_scrape_sums_every_workers_counts_and_drops_an_exited_workers_gauges(
    tmp_path: Path,
) -> None:
    workers = [run(WORKER, tmp_path, "3", "2", "40"), run(WORKER, tmp_path, "5", "1", "7")]
    for worker in workers:
        assert worker.stdout is not None
        assert worker.stdout.readline() == "done\n"
    labels = {
        "idempotency_store": "database",
        "http_route": "charges/",
        "http_request_method": "POST",
    }

    def requests(
        outcome: str, samples: dict[tuple[str, frozenset[tuple[str, str]]], float]
    ) -> float:
        key = frozenset({**labels, "idempotency_outcome": outcome}.items())
        return samples[("idempotency_requests_total", key)]

    samples = scrape(tmp_path)
    assert requests("replayed", samples) == 3 + 5
    assert requests("claimed", samples) == 2
    assert samples[("idempotency_claims_in_flight", frozenset())] == 2 + 1
    assert samples[("idempotency_claims_oldest_age_seconds", frozenset())] == 40

    first = workers[0]
    assert first.stdin is not None
    first.stdin.close()
    first.wait(60)

    exited = run(CHILD_EXIT, tmp_path, str(first.pid))  # what gunicorn's master calls
    exited.communicate(timeout=60)
    assert exited.returncode == 0
    samples = scrape(tmp_path)
    assert requests("replayed", samples) == 3 + 5  # what it counted stays counted
    assert samples[("idempotency_claims_in_flight", frozenset())] == 1  # its claims do not
    assert samples[("idempotency_claims_oldest_age_seconds", frozenset())] == 7

    second = workers[1]
    assert second.stdin is not None
    second.stdin.close()
    second.wait(60)
