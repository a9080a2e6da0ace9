"""The example project as the soak runs it: the same URLs, views and settings, plus an app
that records what the server saw (``events.py``) for the soak's invariant checks."""
