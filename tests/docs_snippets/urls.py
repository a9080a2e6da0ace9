"""Routes for the documentation's snippets (``tests/test_docs.py``)."""

from django.urls import path
from rest_framework.routers import SimpleRouter

from tests.docs_snippets import downstream, drf, ninja_api, quickstart

router = SimpleRouter()
router.register("drf/charges", drf.ChargeViewSet, basename="docs-charges")
router.register("drf/orders", drf.OrderViewSet, basename="docs-orders")

urlpatterns = [
    path("orders/", quickstart.create_order),
    path("cbv/orders/", quickstart.OrderView.as_view()),
    path("orders/<int:order_id>/pay/", downstream.pay_order),
    path("ninja/", ninja_api.api.urls),
    *router.urls,
]
