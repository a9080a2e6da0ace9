"""The example project with a few more views for the live ASGI tests
(``tests/e2e/test_uvicorn.py``): the example's own settings, and
``tests.project.asgi_live_urls``."""

from __future__ import annotations

from example_project.settings import *  # noqa: F403

ROOT_URLCONF = "tests.project.asgi_live_urls"
