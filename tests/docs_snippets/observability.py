"""What docs/observability.md shows: the settings, the URL of the metrics view,
structlog's bridge; ``tests/test_observe.py`` runs each."""

import structlog
from django.urls import path

# docs:settings
# pip install "idempotency-django[prometheus]"      (or [opentelemetry], or both)
IDEMPOTENCY = {
    "METRICS": "prometheus",  # or "opentelemetry", or ["prometheus", "opentelemetry"]
    "LOG_REQUESTS": True,  # optional: one log line per protected request
}
# docs:settings-end

# docs:urls
from idempotency_django.metrics.prometheus import metrics_view

urlpatterns = [
    # ... your project's URLs
    path("metrics", metrics_view),
]
# docs:urls-end


def formatter():
    # docs:structlog
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.add_log_level,
            structlog.stdlib.ExtraAdder(),
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.JSONRenderer(),
        ],
    )
    # {"idempotency_outcome": "replayed", "http_route": "charges/", ...}
    # docs:structlog-end
    return formatter
