"""The public import path of ``idempotency_django.core.responses``: the same module
object under its old name (``docs/layout.md``)."""

import sys

from idempotency_django.core import responses as _module
from idempotency_django.core.responses import *  # noqa: F403  (for type checkers)

sys.modules[__name__] = _module
