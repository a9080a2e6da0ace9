"""The DRF view of ``drf_views`` behind ``IdempotentMixin``: on the project's store (the
database store, or the Redis store on the Redis servers: ``EXAMPLE_REDIS_URL``)."""

from __future__ import annotations

from benchmarks.benchproject.drf_views import Charge
from idempotency_django.drf import IdempotentMixin


class IdempotentCharge(IdempotentMixin, Charge):
    pass


protected = IdempotentCharge.as_view()
