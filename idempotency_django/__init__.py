"""Make POST and PATCH safe to retry: one Idempotency-Key runs a view at most once."""

from __future__ import annotations

__version__ = "0.2.0"
