"""A fake card provider: slow like a real one, and with cards that fail like real ones."""

from __future__ import annotations

import asyncio
import os
import time


class CardDeclined(Exception):
    pass


class ProviderTimeout(Exception):
    pass


def _delay() -> float:
    return int(os.environ.get("EXAMPLE_PROVIDER_DELAY_MS", "300")) / 1000


def _outcome(card: str) -> None:
    if card == "tok_declined":
        raise CardDeclined(card)
    if card == "tok_timeout":
        raise ProviderTimeout(card)


def charge(card: str, amount: int, currency: str) -> None:
    time.sleep(_delay())
    _outcome(card)


async def acharge(card: str, amount: int, currency: str) -> None:
    await asyncio.sleep(_delay())
    _outcome(card)
