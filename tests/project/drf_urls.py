from __future__ import annotations

from django.urls import path
from rest_framework.routers import SimpleRouter

from tests.project import drf_views

router = SimpleRouter()
router.register("api/charges", drf_views.ChargeViewSet, basename="charges")

urlpatterns = [
    *router.urls,
    path("api/throttled/", drf_views.ThrottledView.as_view()),
    path("api/tenant/", drf_views.TenantView.as_view()),
]
