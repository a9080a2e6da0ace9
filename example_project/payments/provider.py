"""A fake card provider: slow like a real one, and with cards that fail like real ones.

Like a real provider it can keep a ledger and deduplicate by idempotency key, for the
fault campaign (``python -m tools.campaign``, docs/reliability.md), which counts the side
effects where they happen:

- ``EXAMPLE_PROVIDER_LEDGER`` (a directory): every charge the provider makes is one JSON
  line in ``ledger.jsonl`` (time, pid, amount, the idempotency key it was sent), written
  with one ``O_APPEND`` write once the charge is made, so a worker killed a moment later
  loses nothing.
- ``EXAMPLE_PROVIDER_DEDUPLICATE=1`` (with a ledger): a second charge with a key the
  provider has seen charges nothing, as Stripe answers a reused ``Idempotency-Key``
  with the first charge; the ledger line says ``"deduplicated": true``. The key is
  claimed with ``O_CREAT | O_EXCL`` on a file named after it, atomic across processes.
- ``EXAMPLE_PROVIDER_REPLY_MS``: how long the provider's answer takes to come back once the
  charge is made (default 0): the window in which a process that dies has charged but not
  stored its outcome.
"""

from __future__ import annotations

import asyncio
import json
import os
import time


class CardDeclined(Exception):
    pass


class ProviderTimeout(Exception):
    pass


def _delay() -> float:
    return int(os.environ.get("EXAMPLE_PROVIDER_DELAY_MS", "300")) / 1000


def _reply_delay() -> float:
    return int(os.environ.get("EXAMPLE_PROVIDER_REPLY_MS", "0")) / 1000


def _outcome(card: str) -> None:
    if card == "tok_declined":
        raise CardDeclined(card)
    if card == "tok_timeout":
        raise ProviderTimeout(card)


def _record(amount: int, currency: str, idempotency_key: str | None) -> None:
    """The charge, in the ledger (if one is kept); deduplicated by key if asked to."""
    directory = os.environ.get("EXAMPLE_PROVIDER_LEDGER")
    if not directory:
        return
    deduplicated = False
    if idempotency_key and os.environ.get("EXAMPLE_PROVIDER_DEDUPLICATE") == "1":
        keys = os.path.join(directory, "keys")
        os.makedirs(keys, exist_ok=True)
        try:
            os.close(os.open(os.path.join(keys, idempotency_key), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            deduplicated = True
    line = {
        "t": time.time(),
        "pid": os.getpid(),
        "amount": amount,
        "currency": currency,
        "idempotency_key": idempotency_key,
        "deduplicated": deduplicated,
    }
    fd = os.open(
        os.path.join(directory, "ledger.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
    )
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    finally:
        os.close(fd)


def charge(card: str, amount: int, currency: str, idempotency_key: str | None = None) -> None:
    time.sleep(_delay())
    _outcome(card)
    _record(amount, currency, idempotency_key)
    time.sleep(_reply_delay())


async def acharge(
    card: str, amount: int, currency: str, idempotency_key: str | None = None
) -> None:
    await asyncio.sleep(_delay())
    _outcome(card)
    _record(amount, currency, idempotency_key)
    await asyncio.sleep(_reply_delay())
