from __future__ import annotations

from django.db import models


class SideEffect(models.Model):
    """One row per execution of a test view's body: what "exactly once" is counted in."""

    label = models.CharField(max_length=100)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.label} #{self.pk}"


class DeferredChild(models.Model):
    """A row with a foreign key that PostgreSQL checks at COMMIT: a way to make a
    transaction fail after its view has returned."""

    parent = models.ForeignKey(SideEffect, on_delete=models.DO_NOTHING)

    def __str__(self) -> str:
        return f"child of {self.parent_id}"
