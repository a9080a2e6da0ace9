"""The public import path of ``idempotency_django.core.codecs``: the same module
object under its old name (``docs/layout.md``)."""

import sys

from idempotency_django.core import codecs as _module
from idempotency_django.core.codecs import *  # noqa: F403  (for type checkers)

sys.modules[__name__] = _module
