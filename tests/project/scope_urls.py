"""Routes for tests/test_scopes.py (``@pytest.mark.urls``)."""

from __future__ import annotations

from django.urls import path

from tests.project import scope_views

urlpatterns = [
    path("refunds/", scope_views.RefundView.as_view()),
    path("payments/", scope_views.payment),
    path("guest-checkout/", scope_views.guest_checkout),
]
