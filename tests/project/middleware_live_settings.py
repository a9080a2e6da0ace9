"""The example project with ``IdempotencyMiddleware`` installed, for the live tests
(``tests/e2e/test_middleware_live.py``): the example's own settings, plus the middleware
last in ``MIDDLEWARE`` and URLs with views that nothing but the middleware protects."""

from __future__ import annotations

from example_project.settings import *  # noqa: F403
from example_project.settings import MIDDLEWARE as EXAMPLE_MIDDLEWARE

MIDDLEWARE = [
    *EXAMPLE_MIDDLEWARE,
    "tests.project.middleware_live_urls.BasicAuthMiddleware",
    "idempotency_django.middleware.IdempotencyMiddleware",
]
ROOT_URLCONF = "tests.project.middleware_live_urls"
