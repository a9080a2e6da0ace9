"""The app: registers the system checks, forgets a deleted user's records (``accounts``),
connects the metrics and the request log when the settings ask for them (``observe``) and,
with drf-spectacular, registers the schema extension."""

from __future__ import annotations

from django.apps import AppConfig


class IdempotencyConfig(AppConfig):
    name = "idempotency_django"
    verbose_name = "Idempotency"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.conf import settings
        from django.core.signals import setting_changed
        from django.db.models.signals import post_delete

        from idempotency_django import checks
        from idempotency_django.core import accounts, observe

        checks.register()
        post_delete.connect(
            accounts.user_deleted,
            sender=settings.AUTH_USER_MODEL,
            dispatch_uid="idempotency_django.accounts.user_deleted",
        )
        # Nothing, unless METRICS or LOG_REQUESTS is set (a missing extra, a bad setting:
        # checks E060, E061, E001).
        observe.setting_changed("IDEMPOTENCY")
        setting_changed.connect(
            observe.setting_changed, dispatch_uid="idempotency_django.core.observe"
        )
        try:
            import drf_spectacular  # noqa: F401
        except ImportError:
            return
        from idempotency_django.adapters import openapi  # noqa: F401  (registers the extension)
