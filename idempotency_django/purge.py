"""The public import path of ``idempotency_django.operations.purge``: the same module
object under its old name (``docs/layout.md``)."""

import sys

from idempotency_django.operations import purge as _module
from idempotency_django.operations.purge import *  # noqa: F403  (for type checkers)

sys.modules[__name__] = _module
