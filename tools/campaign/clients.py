"""Clients that send keyed charges the way real ones retry, and record every attempt.

Each client thread runs one key after another until traffic stops. A key is one charge
(its amount is the key's serial number, so the provider's ledger names the key) sent by a
scenario:

- ``plain``: send, retry until a definitive answer;
- ``concurrent``: two senders at once, each retrying (the duplicate in flight);
- ``impatient``: the first attempt gives up after 50 ms (an ``info``: outcome unknown),
  then retry;
- ``late``: after the definitive answer, the same request again once the lease has lapsed
  (a late duplicate), which must replay;
- ``declined``: a declined card (402, stored: replayed like a 201).

Every attempt gives up after ``timeout`` (the lease + 1 s by default: a client does not
wait for ever, and a retry after a pause longer than the lease meets a lapsed lease).
Retries: ``409`` waits its ``Retry-After`` (capped at a second), ``429``/``5xx``/no answer
back off 0.1-0.5 s. Every attempt is in the history (``history``).
"""

from __future__ import annotations

import base64
import http.client
import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tools.campaign.history import History, digest

USERS = {"alice": "alice", "bob": "bob"}
HTTP_TIMEOUT = 30.0
IMPATIENT_TIMEOUT = 0.05
MIX = {"plain": 40, "concurrent": 20, "impatient": 15, "late": 15, "declined": 10}
REFUSED = frozenset({409, 429})


@dataclass
class Key:
    serial: int
    key: str
    user: str
    scenario: str
    card: str
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def body(self) -> bytes:
        return json.dumps({"amount": self.serial, "currency": "EUR", "card": self.card}).encode()


class Clients:
    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        history: History,
        *,
        run_id: str,
        seed: int,
        lease: float,
        traffic_end: float,
        drain_end: float,
        timeout: float = HTTP_TIMEOUT,
    ) -> None:
        self.timeout = timeout
        self.endpoints = endpoints
        self.history = history
        self.run_id = run_id
        self.seed = seed
        self.lease = lease
        self.traffic_end = traffic_end  # time.monotonic(): no new key after this
        self.drain_end = drain_end  # time.monotonic(): no retry after this
        self.keys: list[Key] = []
        self._lock = threading.Lock()
        self._late: list[tuple[float, Key]] = []
        self._threads: list[threading.Thread] = []
        self.crashes: list[str] = []

    # -- one attempt

    def send(self, key: Key, process: str, rng: random.Random, timeout: float) -> dict[str, Any]:
        host, port = rng.choice(self.endpoints)
        body = key.body
        common = {
            "process": process,
            "key": key.key,
            "amount": key.serial,
            "user": key.user,
            "body": digest(body),
            "port": port,
        }
        self.history.add(type="invoke", **common)
        credentials = base64.b64encode(f"{key.user}:{USERS[key.user]}".encode()).decode()
        connection = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            connection.request(
                "POST",
                "/charges/",
                body=body,
                headers={
                    "Content-Type": "application/json",
                    "Authorization": f"Basic {credentials}",
                    "Idempotency-Key": key.key,
                },
            )
            response = connection.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as error:
            return self.history.add(type="info", error=f"{type(error).__name__}: {error}", **common)
        finally:
            connection.close()
        status = response.status
        kind = "info" if status >= 500 else "fail" if status in REFUSED else "ok"
        return self.history.add(
            type=kind,
            status=status,
            response=digest(data),
            response_body=data.decode("utf-8", "replace")[:400],
            replayed=response.getheader("Idempotent-Replayed") == "true",
            retry_after=response.getheader("Retry-After"),
            **common,
        )

    def until_definitive(
        self, key: Key, process: str, rng: random.Random, first_timeout: float | None = None
    ) -> dict[str, Any] | None:
        timeout = first_timeout or self.timeout
        while time.monotonic() < self.drain_end:
            entry = self.send(key, process, rng, timeout)
            timeout = self.timeout
            if entry["type"] == "ok":
                return entry
            if entry.get("status") == 409:
                try:
                    wait = float(entry.get("retry_after") or 1)
                except ValueError:
                    wait = 1.0
                time.sleep(min(wait, 1.0) * rng.uniform(0.5, 1.0))
            else:
                time.sleep(rng.uniform(0.1, 0.5))
        return None

    # -- the scenarios

    def new_key(self, rng: random.Random) -> Key:
        scenario = rng.choices(list(MIX), weights=list(MIX.values()))[0]
        with self._lock:
            serial = len(self.keys) + 1
            key = Key(
                serial=serial,
                key=f"camp-{self.run_id}-{serial}",
                user=rng.choice(list(USERS)),
                scenario=scenario,
                card="tok_declined" if scenario == "declined" else "tok_visa",
            )
            self.keys.append(key)
        return key

    def client(self, number: int) -> None:
        rng = random.Random(self.seed * 1000 + number)
        process = f"c{number}"
        try:
            while time.monotonic() < self.traffic_end:
                key = self.new_key(rng)
                if key.scenario == "concurrent":
                    other = threading.Thread(
                        target=self.until_definitive,
                        args=(key, f"{process}b", random.Random(rng.random())),
                    )
                    other.start()
                    self.until_definitive(key, process, rng)
                    other.join()
                elif key.scenario == "impatient":
                    self.until_definitive(key, process, rng, first_timeout=IMPATIENT_TIMEOUT)
                else:
                    self.until_definitive(key, process, rng)
                if key.scenario == "late":
                    with self._lock:
                        self._late.append((time.monotonic() + self.lease + 1.0, key))
        except Exception as error:  # a client bug: reported, the run fails
            self.crashes.append(f"{process}: {type(error).__name__}: {error}")

    def late_sender(self) -> None:
        rng = random.Random(self.seed)
        while time.monotonic() < self.drain_end:
            with self._lock:
                due = [item for item in self._late if item[0] <= time.monotonic()]
                self._late = [item for item in self._late if item[0] > time.monotonic()]
                idle = not due and not self._late and time.monotonic() > self.traffic_end
            for _, key in due:
                self.until_definitive(key, "late", rng)
            if idle and all(not t.is_alive() for t in self._threads):
                return
            time.sleep(0.1)

    def run(self, count: int) -> None:
        self._threads = [
            threading.Thread(target=self.client, args=(n,), name=f"client-{n}")
            for n in range(count)
        ]
        late = threading.Thread(target=self.late_sender, name="late")
        for thread in self._threads:
            thread.start()
        late.start()
        for thread in self._threads:
            thread.join()
        late.join()

    def final_replays(self) -> None:
        """After the campaign: every key twice more (each must be a replay, byte-equal to
        the stored answer; the first may run the view again if an excused run lost its
        completion, and the second must then replay it)."""
        rng = random.Random(self.seed + 1)
        for key in self.keys:
            self.send(key, "final", rng, HTTP_TIMEOUT)
            self.send(key, "final", rng, HTTP_TIMEOUT)
