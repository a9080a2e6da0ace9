"""End-to-end tests: the example payments API under gunicorn, over HTTP, on a real database."""
