"""The server's side of the campaign history: one JSON line per keyed request begun and
ended, with the worker's pid, in ``$CAMPAIGN_DIR/server-<pid>.jsonl``.

The checker matches each provider charge (the ledger names the pid that made it and when)
with the request that made it, and so with the faults that hit that process during that
request. Each line is one ``O_APPEND`` write: a worker killed with SIGKILL has written every
line it got to. The middleware is outermost, so a request's end is after its outcome was
stored (or given up).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

from django.http import HttpRequest, HttpResponse

_fds: dict[int, int] = {}


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def write(event: dict[str, Any]) -> None:
    directory = os.environ.get("CAMPAIGN_DIR")
    if not directory:
        return
    pid = os.getpid()
    fd = _fds.get(pid)
    if fd is None:
        path = os.path.join(directory, f"server-{pid}.jsonl")
        fd = _fds[pid] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, (json.dumps({"t": time.time(), "pid": pid, **event}) + "\n").encode())


class RequestLog:
    """Logs the begin and end (status, replayed) of every request with an Idempotency-Key;
    plants the defect named by ``CAMPAIGN_DEFECT`` when the worker loads it (``defects``)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        from tools.campaign import defects

        defects.plant(os.environ.get("CAMPAIGN_DEFECT", ""))
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        key = request.headers.get("Idempotency-Key")
        if key is None or request.method != "POST":
            return self.get_response(request)
        write({"event": "begin", "key": key, "port": request.META.get("SERVER_PORT")})
        response = self.get_response(request)
        write(
            {
                "event": "end",
                "key": key,
                "status": response.status_code,
                "replayed": response.get("Idempotent-Replayed") == "true",
                "response": digest(response.content) if not response.streaming else None,
            }
        )
        return response
