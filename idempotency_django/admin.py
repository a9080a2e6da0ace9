"""The public import path of ``idempotency_django.operations.admin``: the same module
object under its old name (``docs/layout.md``)."""

import sys

from idempotency_django.operations import admin as _module
from idempotency_django.operations.admin import *  # noqa: F403  (for type checkers)

sys.modules[__name__] = _module
