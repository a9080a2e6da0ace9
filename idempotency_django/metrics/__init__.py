"""The exporters of ``IDEMPOTENCY["METRICS"]``: ``prometheus`` and ``opentelemetry``, each
behind its extra, both fed by ``observe``'s signal receivers. docs/observability.md."""
