from __future__ import annotations

from django.conf import settings
from django.contrib import admin
from django.urls import path
from drf_spectacular.views import SpectacularAPIView
from rest_framework.routers import SimpleRouter

from example_project.payments import api, ninja_api, views
from idempotency_django.health import idempotency_health_view

router = SimpleRouter()
router.register("api/charges", api.ChargeViewSet, basename="api-charges")

urlpatterns = [
    path("admin/", admin.site.urls),
    # The idempotency health check, for readiness probes (docs/health.md).
    # docs:health
    path("health/idempotency/", idempotency_health_view),
    # docs:health-end
    path("charges/", views.charges, name="charges"),
    # Where a new charge's Location points: /charges/ch_<n>, no trailing slash.
    path("charges/<str:charge_id>", views.charge_detail, name="charge-detail"),
    path("async/charges/", views.async_charges, name="async-charges"),
    *router.urls,
    # The OpenAPI documents, each with the Idempotency-Key contract and its expiry policy:
    # drf-spectacular's for /api/charges/ (YAML; ?format=json for JSON) and ninja's.
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    # /ninja/charges/ and /ninja/openapi.json
    path("ninja/", ninja_api.api.urls),
]

if "prometheus" in (settings.IDEMPOTENCY.get("METRICS") or ()):
    from idempotency_django.metrics.prometheus import metrics_view

    # Scraped by Prometheus; in a real project keep it off the public internet.
    urlpatterns.append(path("metrics", metrics_view, name="metrics"))

# Problem responses (application/problem+json) for what Django answers itself: a body it
# cannot parse (400) and a view that raised (500).
handler400 = "example_project.payments.views.bad_request"
handler500 = "example_project.payments.views.server_error"
