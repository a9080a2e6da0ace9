"""URLs of ``tests.project.kit_views``, used with
``@pytest.mark.urls("tests.project.kit_urls")``."""

from __future__ import annotations

from django.urls import include, path
from rest_framework.routers import SimpleRouter

from tests.project import kit_views

router = SimpleRouter()
router.register("drf/charges", kit_views.ChargeViewSet, basename="kit-drf-charge")
router.register("drf/mixin", kit_views.MixinChargeViewSet, basename="kit-drf-mixin")
router.register(
    "drf/unprotected", kit_views.UnprotectedChargeViewSet, basename="kit-drf-unprotected"
)

urlpatterns = [
    path("kit/charges/", kit_views.charge),
    path("kit/unprotected/", kit_views.unprotected_charge),
    path("kit/stores-failures/", kit_views.stores_failures),
    path("kit/ignores-body/", kit_views.ignores_body),
    path("kit/naive-dedupe/", kit_views.naive_dedupe),
    path("kit/validating/", kit_views.validating),
    path("kit/downstream/", kit_views.downstream),
    path("kit/", include(router.urls)),
]
