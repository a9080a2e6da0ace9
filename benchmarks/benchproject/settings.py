"""Benchmark settings: the example project's, plus a cheap header authentication and the
benchmark URLs. Only for ``benchmarks/run.py``.

- Every scenario authenticates the same cheap way: ``X-Bench-User`` names a user, resolved
  once per process (no password hash per request), so that what is measured is our cost.
- Persistent database connections (``CONN_MAX_AGE``), as a production deployment has: a
  new connection per request would add the same large constant to every scenario and hide
  the cost of the app behind it.
- The DRF scenario (``drf_views.py``) authenticates as most DRF projects do instead: DRF's
  ``TokenAuthentication``, a ``SELECT`` per request (``rest_framework.authtoken``).
- ``DEBUG`` off (Django would keep every query in memory).
"""

from __future__ import annotations

from example_project.settings import *  # noqa: F403
from example_project.settings import DATABASES, INSTALLED_APPS, MIDDLEWARE

DEBUG = False
ROOT_URLCONF = "benchmarks.benchproject.urls"
# The DRF scenario's TokenAuthentication (drf_views.py): a token table, one SELECT a request.
INSTALLED_APPS = [*INSTALLED_APPS, "rest_framework.authtoken"]
MIDDLEWARE = [*MIDDLEWARE, "benchmarks.benchproject.auth.BenchUserMiddleware"]
DATABASES["default"]["CONN_MAX_AGE"] = 600
DATABASES["default"]["CONN_HEALTH_CHECKS"] = False

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"idempotency_django": {"handlers": ["console"], "level": "WARNING"}},
}
