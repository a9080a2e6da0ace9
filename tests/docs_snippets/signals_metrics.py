"""Counting the app's signals in Prometheus (``prometheus-client``, not a
dependency)."""

# docs:start
from prometheus_client import CollectorRegistry, Counter

from idempotency_django import signals

REGISTRY = CollectorRegistry()  # or prometheus_client's default REGISTRY
EVENTS = Counter(
    "idempotency_events_total",
    "Idempotency events",
    ["event", "endpoint"],
    registry=REGISTRY,
)


def count(event):
    def receiver_(sender, endpoint, **kwargs):
        EVENTS.labels(event, endpoint).inc()  # label by endpoint, never by key

    return receiver_


def connect():  # call once, e.g. from your AppConfig.ready()
    for name in (
        "claimed",
        "replayed",
        "in_flight",
        "mismatch",
        "released",
        "lease_taken_over",
        "completion_lost",
        "store_unavailable",
        "outcome_not_stored",
    ):
        getattr(signals, name).connect(
            count(name), weak=False, dispatch_uid=f"metrics-{name}"
        )


# docs:end
