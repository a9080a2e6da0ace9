"""What both peers' settings start from: the benchmark's, without idempotency_django.

The same example project, cheap header authentication and persistent connections as our
scenarios (``settings.py``), serving ``peer_urls`` (the bare view). idempotency_django is
left out: drf-idempotency reads a setting of the same name, ``IDEMPOTENCY``, and refuses
our keys in it, and so is the example's DRF exception handler (it imports our DRF module).
"""

from __future__ import annotations

from benchmarks.benchproject.settings import *  # noqa: F403
from benchmarks.benchproject.settings import INSTALLED_APPS, MIDDLEWARE
from example_project.settings import REST_FRAMEWORK

ROOT_URLCONF = "benchmarks.benchproject.peer_urls"
INSTALLED_APPS = [app for app in INSTALLED_APPS if app != "idempotency_django"]
MIDDLEWARE = [name for name in MIDDLEWARE if not name.startswith("idempotency_django")]
IDEMPOTENCY: dict[str, object] = {}
# The example's DRF exception handler imports idempotency_django's DRF module: DRF's own.
REST_FRAMEWORK = {
    name: value for name, value in REST_FRAMEWORK.items() if name != "EXCEPTION_HANDLER"
}
