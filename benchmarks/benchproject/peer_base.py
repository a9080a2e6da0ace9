"""What both peers' settings start from: the benchmark's, without idempotency_django.

The same example project, cheap header authentication and persistent connections as our
scenarios (``settings.py``), serving ``peer_urls`` (the bare view). idempotency_django is
left out: drf-idempotency reads a setting of the same name, ``IDEMPOTENCY``, and refuses
our keys in it.
"""

from __future__ import annotations

from benchmarks.benchproject.settings import *  # noqa: F403
from benchmarks.benchproject.settings import INSTALLED_APPS, MIDDLEWARE

ROOT_URLCONF = "benchmarks.benchproject.peer_urls"
INSTALLED_APPS = [app for app in INSTALLED_APPS if app != "idempotency_django"]
MIDDLEWARE = [name for name in MIDDLEWARE if not name.startswith("idempotency_django")]
IDEMPOTENCY: dict[str, object] = {}
