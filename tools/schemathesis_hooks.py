"""Schemathesis hooks for the example's contract run (``tools/contract.py``).

A fresh Idempotency-Key per request: Schemathesis generates keys from the published pattern
and would send one key with several bodies (a 422, documented but not what a case tests) or
replay an earlier case's answer. Every key the server would accept is replaced by a new
UUID, in the same form (a quoted key stays quoted); a malformed one is kept, so its 400 is
still tested. Every request goes through ``before_call``, the checks' extra requests too.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import schemathesis

from idempotency_django.keys import KEY_PATTERN

HEADER = "idempotency-key"
ACCEPTED = re.compile(KEY_PATTERN)  # exactly what the server accepts (tests/test_openapi.py)


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    headers = case.headers
    if not headers:
        return
    for name, value in list(headers.items()):
        if name.lower() != HEADER or not isinstance(value, str):
            continue
        if ACCEPTED.fullmatch(value) is None:
            continue  # a malformed key: the server must refuse it (400), keep it
        fresh = f"st-{uuid.uuid4()}"
        headers[name] = f'"{fresh}"' if value.startswith('"') else fresh
