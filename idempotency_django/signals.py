"""Signals sent by the engine, for metrics and alerting.

Every signal is sent with ``sender=IdempotencyRecord`` and the keyword arguments
``account``, ``endpoint`` and ``key``; see the README for what each one means.
"""

from __future__ import annotations

from django.dispatch import Signal

#: A request claimed a key that was absent (or expired) and its view is about to run.
claimed = Signal()
#: A completed key was replayed; ``status`` is the stored status code.
replayed = Signal()
#: A duplicate arrived while the key's first request was still running.
in_flight = Signal()
#: A key was reused with a different request (answered 422).
mismatch = Signal()
#: A claim was released because its view failed (exception or unstored status).
released = Signal()
#: A claim whose lease had lapsed (its worker died or overran) was taken over.
lease_taken_over = Signal()
#: A finished view could not store its outcome: its claim had been taken over.
completion_lost = Signal()
