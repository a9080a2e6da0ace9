"""drf-idempotency 1.0.0, wired as its README's quick start says, on the bench's bare view.

``drf_idempotency`` in ``INSTALLED_APPS`` (migrated), its ``IdempotencyMiddleware`` last in
``MIDDLEWARE`` (after the benchmark's authentication middleware), and the database backend.
"""

from __future__ import annotations

from benchmarks.benchproject.peer_base import *  # noqa: F403
from benchmarks.benchproject.peer_base import INSTALLED_APPS, MIDDLEWARE

INSTALLED_APPS = [*INSTALLED_APPS, "drf_idempotency"]
MIDDLEWARE = [*MIDDLEWARE, "drf_idempotency.middleware.IdempotencyMiddleware"]
IDEMPOTENCY = {"BACKEND": "drf_idempotency.backends.database.DatabaseBackend"}
