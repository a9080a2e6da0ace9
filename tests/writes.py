"""A store's typed writes, as the engine makes them (``shell._write``, ``shell.complete``),
for tests that talk to a store directly."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.utils import timezone

from idempotency_django.store.base import Completion, Scope, Write, duration

FINGERPRINT = "2:" + "a" * 64


def write(
    token: str,
    *,
    account: str = "1",
    endpoint: str = "POST /effect/",
    key: str = "k1",
    fingerprint: str = FINGERPRINT,
    lease: float = 30,
    ttl: float | None = 3600,
    now: datetime | None = None,
) -> Write:
    """What a claim (or a take-over) of ``account``/``endpoint``/``key`` writes, now."""
    return Write(
        Scope(account, endpoint, key),
        token,
        fingerprint,
        now or timezone.now(),
        timedelta(seconds=lease),
        duration(ttl),
    )


def completion(
    status: int = 201,
    body: bytes | None = b"done",
    *,
    headers: tuple[tuple[str, str], ...] = (("Location", "/x/1"),),
    ttl: float | None = 3600,
    now: datetime | None = None,
) -> Completion:
    """What a completion writes, now."""
    return Completion(status, headers, body, now or timezone.now(), duration(ttl))
