"""The campaign's history: every client attempt and every fault, one JSON line each, in
the order they happened (``history.jsonl``).

A client attempt is two entries, as in a Jepsen history: ``invoke`` when it is sent, then
its completion: ``ok`` (a definitive answer: 2xx, or a 4xx the server stored, such as a
declined card), ``fail`` (refused before the view ran: ``409`` key in flight, ``429``) or
``info`` (outcome unknown: a timeout, a reset connection, a 5xx: the view may have run).
Each names the key, the request body's digest and the amount (which names the key in the
provider's ledger), the status, the response's digest and body, and whether the server
said it was a replay. A fault is ``process: "nemesis"``: ``start`` and ``stop`` entries
with its name, its targets (worker pids) and what was done.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


class History:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self._index = 0

    def add(self, **entry: Any) -> dict[str, Any]:
        with self._lock:
            entry = {"index": self._index, "t": time.time(), **entry}
            self._index += 1
            self._file.write(json.dumps(entry) + "\n")
            self._file.flush()
        return entry

    def close(self) -> None:
        self._file.close()


def read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    entries = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                entries.append(json.loads(line))
            except ValueError:  # a line cut by a SIGKILL mid-write: never ours, but be safe
                continue
    return entries
