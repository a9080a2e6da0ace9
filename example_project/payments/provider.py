"""A fake card provider: slow like a real one, and with cards that fail like real ones."""

from __future__ import annotations

import os
import time


class CardDeclined(Exception):
    pass


class ProviderTimeout(Exception):
    pass


def charge(card: str, amount: int, currency: str) -> None:
    time.sleep(int(os.environ.get("EXAMPLE_PROVIDER_DELAY_MS", "300")) / 1000)
    if card == "tok_declined":
        raise CardDeclined(card)
    if card == "tok_timeout":
        raise ProviderTimeout(card)
