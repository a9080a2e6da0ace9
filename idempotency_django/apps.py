"""The app: registers the system checks, forgets a deleted user's records (``accounts``)
and, with drf-spectacular, registers the schema extension."""

from __future__ import annotations

from django.apps import AppConfig


class IdempotencyConfig(AppConfig):
    name = "idempotency_django"
    verbose_name = "Idempotency"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.conf import settings
        from django.db.models.signals import post_delete

        from idempotency_django import accounts, checks

        checks.register()
        post_delete.connect(
            accounts.user_deleted,
            sender=settings.AUTH_USER_MODEL,
            dispatch_uid="idempotency_django.accounts.user_deleted",
        )
        try:
            import drf_spectacular  # noqa: F401
        except ImportError:
            return
        from idempotency_django import openapi  # noqa: F401  (registers the extension)
