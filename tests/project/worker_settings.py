"""A Celery worker's settings module: the test project's, without what only a web process
needs (no URLconf, no middleware, no templates, no admin), with DRF still installed."""

from __future__ import annotations

from tests.project.settings import *  # noqa: F403
from tests.project.settings import INSTALLED_APPS

del ROOT_URLCONF, MIDDLEWARE, TEMPLATES  # noqa: F821

INSTALLED_APPS = [app for app in INSTALLED_APPS if app != "django.contrib.admin"]
