from __future__ import annotations

import json
from typing import Any

from django.http import HttpResponse


def problem(status: int, slug: str, title: str, **extra: Any) -> HttpResponse:
    body = {"type": f"urn:example-payments:{slug}", "title": title, "status": status, **extra}
    return HttpResponse(json.dumps(body), status=status, content_type="application/problem+json")
