"""The example project's settings, as the campaign runs it (``tools.campaign.runner``).

Unchanged but for: the host of the namespaced app server (``network``); the request log
(``serverlog``), outermost; the Redis store's options the campaign varies
(``CAMPAIGN_REDIS_WAIT_REPLICAS``, ``CAMPAIGN_REDIS_SOCKET_TIMEOUT``); and a planted defect
(``CAMPAIGN_DEFECT``, see ``defects``) for proving the checker.
"""

from __future__ import annotations

import os
from typing import cast

from example_project.settings import *  # noqa: F403
from example_project.settings import ALLOWED_HOSTS, IDEMPOTENCY, MIDDLEWARE

MIDDLEWARE = ["tools.campaign.serverlog.RequestLog", *MIDDLEWARE]
# The app server in the campaign's network namespace (``network``) is reached there.
ALLOWED_HOSTS = [*ALLOWED_HOSTS, "169.254.40.2"]

IDEMPOTENCY = dict(IDEMPOTENCY)
if isinstance(IDEMPOTENCY.get("STORE_OPTIONS"), dict):
    options = dict(cast("dict[str, object]", IDEMPOTENCY["STORE_OPTIONS"]))
    if os.environ.get("CAMPAIGN_REDIS_WAIT_REPLICAS"):
        options["WAIT_REPLICAS"] = int(os.environ["CAMPAIGN_REDIS_WAIT_REPLICAS"])
        options["WAIT_TIMEOUT_MS"] = int(os.environ.get("CAMPAIGN_REDIS_WAIT_TIMEOUT_MS", "500"))
    if os.environ.get("CAMPAIGN_REDIS_SOCKET_TIMEOUT"):
        options["SOCKET_TIMEOUT"] = float(os.environ["CAMPAIGN_REDIS_SOCKET_TIMEOUT"])
    IDEMPOTENCY["STORE_OPTIONS"] = options
if os.environ.get("CAMPAIGN_DEFECT") == "no-claim":
    IDEMPOTENCY["STORE"] = (
        "tools.campaign.defects.NoClaimRedisStore"
        if os.environ.get("EXAMPLE_REDIS_URL")
        else "tools.campaign.defects.NoClaimDatabaseStore"
    )

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler", "level": "WARNING"}},
    "loggers": {
        "idempotency_django": {"handlers": ["console"], "level": "WARNING"},
        "django.request": {"handlers": ["console"], "level": "ERROR"},
    },
}
