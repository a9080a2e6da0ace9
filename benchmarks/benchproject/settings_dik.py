"""django-idempotency-key 1.3.0, wired as its README says, on the benchmark's bare view.

- ``IdempotencyKeyMiddleware`` (the README's first form: every unsafe request needs a key),
  last, after the benchmark's authentication middleware.
- ``CacheKeyStorage`` on a Redis cache: the README's storage for a cache shared by every
  process (its default, ``MemoryKeyStorage``, is a dict per worker: a retry that reaches
  another gunicorn worker would run again). Django's own ``RedisCache``.
- ``CONFLICT_STATUS_CODE: None``: a replay answers the first response's status (the
  default answers it as a ``409``, which a client would have to tell apart from a real
  conflict; the README offers ``None`` for this).
- Everything else at the README's defaults: the ``ThreadLock`` (per process) around the
  lookup.
"""

from __future__ import annotations

import os

from benchmarks.benchproject.peer_base import *  # noqa: F403
from benchmarks.benchproject.peer_base import MIDDLEWARE

MIDDLEWARE = [*MIDDLEWARE, "idempotency_key.middleware.IdempotencyKeyMiddleware"]

CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "idempotency": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"),
        # Each run its own keys; they expire within the hour.
        "KEY_PREFIX": os.environ.get("BENCH_REDIS_PREFIX", "idempotency-bench"),
        "TIMEOUT": 3600,
    },
}

IDEMPOTENCY_KEY = {
    "CONFLICT_STATUS_CODE": None,
    "STORAGE": {
        "CLASS": "idempotency_key.storage.CacheKeyStorage",
        "CACHE_NAME": "idempotency",
    },
}
