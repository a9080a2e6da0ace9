"""The settings the documentation shows, one file each, exactly as a user writes them
in a settings module (``IDEMPOTENCY = {...}``, ``MIDDLEWARE = [...]``): the docs
include each file whole, and ``tests/test_docs.py`` pastes each into a settings module
and runs the system checks on it."""
