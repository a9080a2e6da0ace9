from __future__ import annotations

from django.apps import AppConfig


class SoakConfig(AppConfig):
    name = "benchmarks.soakproject"
    label = "soak"

    def ready(self) -> None:
        from benchmarks.soakproject import events

        events.connect()
