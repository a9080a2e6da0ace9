"""The public import path of ``idempotency_django.adapters.decorators``: the same module
object under its old name (``docs/layout.md``)."""

import sys

from idempotency_django.adapters import decorators as _module
from idempotency_django.adapters.decorators import *  # noqa: F403  (for type checkers)

sys.modules[__name__] = _module
