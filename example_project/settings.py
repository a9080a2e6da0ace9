"""A small payments API that shows idempotency_django in use.

SQLite with no setup; ``DATABASE_URL`` (``postgres://…`` or ``mysql://…``) selects a real
database. Not a production configuration: ``DEBUG`` and the secret key come from the
environment with demo defaults.
"""

from __future__ import annotations

import os
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("EXAMPLE_SECRET_KEY", "example-project-demo-secret-key-change-me")
DEBUG = os.environ.get("EXAMPLE_DEBUG", "") == "1"
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "[::1]", "testserver"]
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "example_project.urls"
WSGI_APPLICATION = "example_project.wsgi.application"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL") or f"sqlite:///{BASE_DIR / 'example.sqlite3'}",
    ),
}
# PostgreSQL: let psycopg prepare the statements idempotency_django sends on every request
# (docs/store.md, "PostgreSQL: prepared statements"; Django leaves prepared statements off for the
# sake of transaction-mode poolers). EXAMPLE_PG_PREPARE_THRESHOLD=off turns it off.
# Preparing pays only on a connection that outlives requests: with Django's default
# CONN_MAX_AGE=0 each request opens a new one, and no statement is sent 5 times on it. So
# the connections then persist: EXAMPLE_CONN_MAX_AGE seconds (default 60, and 0 without
# prepared statements), checked before reuse.
_conn_max_age = os.environ.get("EXAMPLE_CONN_MAX_AGE")
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    _threshold = os.environ.get("EXAMPLE_PG_PREPARE_THRESHOLD", "5")
    if _threshold != "off":
        DATABASES["default"].setdefault("OPTIONS", {})["prepare_threshold"] = int(_threshold)
        _conn_max_age = _conn_max_age or "60"
if _conn_max_age:
    DATABASES["default"]["CONN_MAX_AGE"] = int(_conn_max_age)
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "idempotency_django",
    "example_project.payments",
]

# Sessions, CSRF and messages serve the admin (/admin/). The payments API does not use them:
# its view is csrf_exempt and authenticates every request with HTTP Basic.
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# The admin's CSS and JavaScript: served by runserver with EXAMPLE_DEBUG=1 (under gunicorn,
# collect them with collectstatic and serve STATIC_ROOT, or go without styles).
STATIC_URL = "static/"

# The demo users have demo passwords and every API request checks one (HTTP Basic), so the
# example hashes with few iterations. Keep Django's default hashers in a real project.
PASSWORD_HASHERS = ["example_project.payments.hashers.DemoPBKDF2PasswordHasher"]

# /api/charges/ (example_project/payments/api.py): JSON in, JSON out, and every error an
# application/problem+json response, like the plain views'. The parser turns a body nested
# too deep (and NaN, invalid UTF-8, …) into a 400 instead of a RecursionError (a 500).
REST_FRAMEWORK = {
    "DEFAULT_PARSER_CLASSES": ["example_project.payments.parsers.JSONParser"],
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "example_project.payments.parsers.ContentNegotiation",
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "EXCEPTION_HANDLER": "example_project.payments.api.problem_exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}

# /api/schema/: the OpenAPI document of /api/charges/ (drf-spectacular).
SPECTACULAR_SETTINGS = {"TITLE": "Payments (Django REST framework)", "VERSION": "1"}

IDEMPOTENCY = {
    "LEASE_SECONDS": float(os.environ.get("EXAMPLE_LEASE_SECONDS", "10")),
    "MAX_RUN_SECONDS": float(os.environ.get("EXAMPLE_MAX_RUN_SECONDS", "300")),
    "ON_DISCONNECT": os.environ.get("EXAMPLE_ON_DISCONNECT", "finish"),
    # EXAMPLE_METRICS=prometheus (or opentelemetry, or both, comma-separated): metrics, and
    # /metrics for Prometheus (docs/observability.md). EXAMPLE_LOG_REQUESTS=1: a log line per
    # protected request.
    "METRICS": [name for name in os.environ.get("EXAMPLE_METRICS", "").split(",") if name] or None,
    "LOG_REQUESTS": os.environ.get("EXAMPLE_LOG_REQUESTS", "") == "1",
}
# EXAMPLE_REDIS_URL (e.g. redis://127.0.0.1:6379/0): the Redis store keeps the keys, and the
# database holds no IdempotencyRecord rows.
if os.environ.get("EXAMPLE_REDIS_URL"):
    IDEMPOTENCY["STORE"] = "idempotency_django.store.redis.RedisStore"
    IDEMPOTENCY["STORE_OPTIONS"] = {
        "URL": os.environ["EXAMPLE_REDIS_URL"],
        "KEY_PREFIX": os.environ.get("EXAMPLE_REDIS_KEY_PREFIX", "idem"),
    }

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {
        "idempotency_django": {"handlers": ["console"], "level": "INFO"},
        # A view that raised (a 500): its traceback, in the server's log.
        "django.request": {"handlers": ["console"], "level": "ERROR"},
    },
}
