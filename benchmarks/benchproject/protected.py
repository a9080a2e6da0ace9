"""The benchmark's view behind ``@idempotent``: the same charge as ``views.bare``."""

from __future__ import annotations

from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from benchmarks.benchproject.views import charge
from idempotency_django.decorators import idempotent

commit = csrf_exempt(require_POST(idempotent(charge)))
atomic = csrf_exempt(require_POST(idempotent(mode="atomic")(charge)))
