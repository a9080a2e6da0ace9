"""Soak settings: the example project's, unchanged, plus the ``benchmarks.soakproject`` app,
which only listens (idempotency signals, log records) and writes what it hears to
``$SOAK_EVENTS_DIR``. Only for ``benchmarks/soak.py``.
"""

from __future__ import annotations

import os

from example_project.settings import *  # noqa: F403
from example_project.settings import IDEMPOTENCY, INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "benchmarks.soakproject"]

if os.environ.get("SOAK_SABOTAGE") == "1":
    # ``soak.py --sabotage``: the app switched off, to show that the checks catch it.
    IDEMPOTENCY = {**IDEMPOTENCY, "ENABLED": False}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {
        "console": {"class": "logging.StreamHandler", "level": "WARNING"},
        "events": {"class": "benchmarks.soakproject.events.EventLogHandler", "level": "WARNING"},
    },
    "loggers": {
        "idempotency_django": {"handlers": ["console", "events"], "level": "INFO"},
        # A view that raised (a 500): its exception, for the soak's report.
        "django.request": {"handlers": ["events"], "level": "ERROR"},
    },
}
