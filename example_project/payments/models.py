from __future__ import annotations

from django.conf import settings
from django.db import models


class Charge(models.Model):
    """One succeeded charge at the (fake) card provider: the side effect that must not
    happen twice for one Idempotency-Key."""

    account = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    amount = models.PositiveIntegerField()
    currency = models.CharField(max_length=3)
    card = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.public_id

    @property
    def public_id(self) -> str:
        return f"ch_{self.pk}"

    def as_json(self) -> dict[str, object]:
        return {
            "id": self.public_id,
            "amount": self.amount,
            "currency": self.currency,
            "status": "succeeded",
        }
