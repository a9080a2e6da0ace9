"""The app: registers the system checks and, with drf-spectacular, the schema extension."""

from __future__ import annotations

from django.apps import AppConfig


class IdempotencyConfig(AppConfig):
    name = "idempotency_django"
    verbose_name = "Idempotency"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from idempotency_django import checks

        checks.register()
        try:
            import drf_spectacular  # noqa: F401
        except ImportError:
            return
        from idempotency_django import openapi  # noqa: F401  (registers the extension)
