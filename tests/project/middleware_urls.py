"""URLs for the middleware tests (``ROOT_URLCONF`` in ``tests/test_middleware*.py``)."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.admin.views.decorators import staff_member_required
from django.urls import include, path
from rest_framework.routers import SimpleRouter

from tests.project import middleware_views, views

router = SimpleRouter()
router.register("mw/viewset", middleware_views.ChargeViewSet, basename="mw-viewset")

urlpatterns = [
    path("mw/plain/", middleware_views.plain, name="mw-plain"),
    path("mw/exempt/", middleware_views.exempt, name="mw-exempt"),
    path("mw/named/", middleware_views.named, name="mw-named"),
    path("mw/async/", middleware_views.async_plain, name="mw-async"),
    path("mw/class/", middleware_views.PlainClassView.as_view()),
    path("mw/exempt-class/", middleware_views.ExemptClassView.as_view()),
    path("mw/drf/", middleware_views.TokenChargeView.as_view()),
    path("mw/mixin/", middleware_views.MixinChargeView.as_view()),
    path("mw/api-function/", middleware_views.api_function),
    path("mw/exempt-drf/", middleware_views.ExemptAPIView.as_view()),
    # Decorators the URLconf wraps around views: the middleware runs them, DRF views included.
    path("mw/staff-drf/", staff_member_required(middleware_views.TokenChargeView.as_view())),
    path(
        "mw/forbidden-drf/", middleware_views.forbidding(middleware_views.TokenChargeView.as_view())
    ),
    path(
        "mw/async-forbidden-drf/",
        middleware_views.async_forbidding(middleware_views.TokenChargeView.as_view()),
    ),
    path(
        "mw/forbidden-viewset/",
        middleware_views.forbidding(middleware_views.ChargeViewSet.as_view({"post": "create"})),
    ),
    path("mw/counted-drf/", middleware_views.counted(middleware_views.TokenChargeView.as_view())),
    path("mw/forbidden-plain/", middleware_views.forbidding(middleware_views.plain)),
    path("mw/counted-plain/", middleware_views.counted(middleware_views.plain)),
    path("mw/non-atomic/", middleware_views.non_atomic),
    path("mw/ns/", include(([path("plain/", middleware_views.named, name="n")], "mwns"))),
    # Protected by their own decorator: the middleware must not protect them twice.
    path("mw/decorated/", views.effect),
    path("mw/decorated-class/", views.EffectView.as_view()),
    path("mw/decorated-async/", views.async_effect),
    path("mw/decorated-fields/", views.fields),
    # Nested layers of one scope: claimed by the middleware, met again inside the view.
    path("mw/wrapped/", middleware_views.wrapped),
    path("mw/calls-charge/", middleware_views.calls_charge),
    path("mw/wrapped-calls-charge/", middleware_views.wrapped_calls_charge),
    path("mw/calls-charge-twice/", middleware_views.calls_charge_twice),
    path("mw/calls-another-scope/", middleware_views.calls_another_scope),
    path("mw/async-wrapped/", middleware_views.async_wrapped),
    path("mw/async-calls-charge/", middleware_views.async_calls_charge),
    path("mw/async-calls-charge-twice/", middleware_views.async_calls_charge_twice),
    path("", include(router.urls)),
    path("admin/", admin.site.urls),
]
