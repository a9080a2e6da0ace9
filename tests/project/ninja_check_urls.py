"""A URLconf that builds its django-ninja API when imported: ``IdempotentRouter`` decides at
import which operations it wraps, so ``tests/test_checks.py`` imports this afresh under a
bad ``IDEMPOTENCY`` setting to show that ``manage.py check`` reports it instead of crashing."""

from __future__ import annotations

from django.http import HttpRequest
from django.urls import path
from ninja import NinjaAPI

from idempotency_django.ninja import IdempotentRouter

api = NinjaAPI(urls_namespace="tests-ninja-check")
router = IdempotentRouter()


@router.post("/charges/")
def charge(request: HttpRequest) -> dict[str, int]:
    return {"charged": 1}


api.add_router("/", router)

urlpatterns = [path("ninja-check/", api.urls)]
