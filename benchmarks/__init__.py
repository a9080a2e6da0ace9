"""Benchmarks and the fault-injection soak of idempotency_django (see ``README.md`` here)."""
