"""Settings for the test suite: SQLite by default, ``DATABASE_URL`` for a real database."""

from __future__ import annotations

import os

import dj_database_url

SECRET_KEY = "tests-only-not-secret"
DEBUG = False
USE_TZ = True
# UTC: the admin's date_hierarchy needs MariaDB's time-zone tables for any other zone.
TIME_ZONE = "UTC"
ALLOWED_HOSTS = ["testserver", "localhost", "127.0.0.1"]
ROOT_URLCONF = "tests.project.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL") or "sqlite:///tests.sqlite3",
        conn_max_age=0,
    ),
}
DATABASES["default"]["TEST"] = {"NAME": None}
# PostgreSQL with prepared statements (docs/store.md, "PostgreSQL: prepared statements"): .ci/run
# runs the store's tests once more with TEST_PREPARE_THRESHOLD=5; the suite itself runs with
# Django's default (none prepared).
if os.environ.get("TEST_PREPARE_THRESHOLD"):
    DATABASES["default"].setdefault("OPTIONS", {})["prepare_threshold"] = int(
        os.environ["TEST_PREPARE_THRESHOLD"]
    )
# A second database on the same server, for a store kept apart from the work
# (IDEMPOTENCY["DATABASE"]); only the tests that ask for it create it.
DATABASES["store"] = {
    **DATABASES["default"],
    "NAME": f"{DATABASES['default']['NAME']}_store",
    "TEST": {"NAME": None},
}

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "idempotency_django",
    "tests",
]

MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "tests.project.middleware.HeaderUserMiddleware",  # last: X-User decides request.user
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
            ]
        },
    }
]
STATIC_URL = "static/"

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"null": {"class": "logging.NullHandler"}},
    "loggers": {"idempotency_django": {"handlers": ["null"], "propagate": True}},
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.BasicAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "UNAUTHENTICATED_USER": None,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}
