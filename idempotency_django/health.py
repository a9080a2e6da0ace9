"""The public import path of ``idempotency_django.operations.health``: the same module
object under its old name (``docs/layout.md``)."""

import sys

from idempotency_django.operations import health as _module
from idempotency_django.operations.health import *  # noqa: F403  (for type checkers)

sys.modules[__name__] = _module
