"""The public import path of ``idempotency_django.adapters.ninja``: the same module
object under its old name (``docs/layout.md``)."""

import sys

from idempotency_django.adapters import ninja as _module
from idempotency_django.adapters.ninja import *  # noqa: F403  (for type checkers)

sys.modules[__name__] = _module
