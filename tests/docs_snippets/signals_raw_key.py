"""A receiver that needs the key itself asks for it (docs/signals.md)."""

from __future__ import annotations

audit: list[str] = []
notified: list[tuple[str, str]] = []


def notify_client(account: str, key: str) -> None:
    notified.append((account, key))


# docs:start
from django.dispatch import receiver

from idempotency_django import signals


@receiver(signals.released)
def on_released(sender, account, endpoint, key, **kwargs):
    audit.append(f"released {key}")  # hmac-sha256:…, never the key
    notify_client(account, signals.raw_key())  # the key the client sent


# docs:end
