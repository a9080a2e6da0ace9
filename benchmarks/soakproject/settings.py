"""Soak settings: the example project's, unchanged, plus the ``benchmarks.soakproject`` app,
which only listens (idempotency signals, log records) and writes what it hears to
``$SOAK_EVENTS_DIR``. Only for ``benchmarks/soak.py``.
"""

from __future__ import annotations

import os

from example_project.settings import *  # noqa: F403
from example_project.settings import IDEMPOTENCY, INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "benchmarks.soakproject"]

# ``soak.py --sabotage``: a defect planted to show that the checks catch it.
SABOTAGE = os.environ.get("SOAK_SABOTAGE", "")
if SABOTAGE == "disabled":
    # The app switched off: keys charge twice.
    IDEMPOTENCY = {**IDEMPOTENCY, "ENABLED": False}
elif SABOTAGE == "rollback":
    # Claim, view and outcome in one transaction: a killed worker's claim rolls back, so a
    # retry claims the key afresh within the lease, after the view had already called the
    # provider. The charge rolls back too, so only the re-run rule can see it.
    IDEMPOTENCY = {**IDEMPOTENCY, "MODE": "atomic"}

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
