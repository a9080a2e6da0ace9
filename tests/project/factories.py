from __future__ import annotations

from datetime import timedelta
from typing import Any

import factory
from django.contrib.auth.models import User
from django.utils import timezone

from idempotency_django.models import IdempotencyRecord


class UserFactory(factory.django.DjangoModelFactory[User]):
    class Meta:
        model = User
        django_get_or_create = ("username",)

    username = factory.Sequence(lambda n: f"user{n}")


class IdempotencyRecordFactory(factory.django.DjangoModelFactory[IdempotencyRecord]):
    class Meta:
        model = IdempotencyRecord

    account = "1"
    endpoint = "POST /effect/"
    key = factory.Sequence(lambda n: f"key-{n}")
    fingerprint = "2:" + "0" * 64  # the current canonical form's version
    token = factory.Sequence(lambda n: f"{n:032x}")
    state = IdempotencyRecord.State.IN_PROGRESS
    created_at = factory.LazyFunction(timezone.now)
    lease_expires_at = factory.LazyAttribute(lambda o: o.created_at + timedelta(seconds=10))
    expires_at = factory.LazyAttribute(lambda o: o.created_at + timedelta(days=1))

    @classmethod
    def completed(cls, **kwargs: Any) -> IdempotencyRecord:
        return cls(
            state=IdempotencyRecord.State.COMPLETED,
            lease_expires_at=None,
            response_status=201,
            response_body=b'{"stored": true}',
            response_headers=[["Content-Type", "application/json"]],
            completed_at=timezone.now(),
            **kwargs,
        )
