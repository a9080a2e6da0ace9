from __future__ import annotations

from django.urls import include, path, re_path
from rest_framework.routers import SimpleRouter

from idempotency_django.health import idempotency_health_view
from tests.project import atomicity_views, drf_views, views

# A router whose routes take a path with or without its trailing slash (the usual recipe:
# DRF's own argument takes a bool).
slash_optional = SimpleRouter()
slash_optional.trailing_slash = "/?"
slash_optional.register("api/slash-optional", drf_views.ChargeViewSet, basename="slash-optional")

urlpatterns = [
    path("health/idempotency/", idempotency_health_view),
    path("effect/", views.effect),
    path("effect/<int:number>/", views.effect),
    path("keyed-effect/", views.keyed_effect),
    re_path(r"^optional-slash/?$", views.effect),
    re_path(r"^optional-slash/(?P<number>[0-9]+)/?$", views.effect),
    # One view whose argument takes the slash too: /captures-slash/7 and /captures-slash/7/
    # resolve to it with "7" and "7/", two requests (a <path:> converter does the same).
    re_path(r"^captures-slash/(?P<number>[0-9]+/?)$", views.effect),
    path("apart", views.effect),
    path("apart/", views.slash_twin),
    path("optional/", views.optional),
    path("atomic/", views.atomic),
    path("atomic-waiting/", views.atomic_waiting),
    path("atomic-short-wait/", views.atomic_short_wait),
    path("inside-atomic/", views.inside_atomic),
    path("waiting/", views.waiting),
    path("short-wait/", views.short_wait),
    path("fields/", views.fields),
    path("custom-fingerprint/", views.custom_fingerprint),
    path("only-201/", views.only_201),
    path("with-put/", views.with_put),
    path("stream/", views.stream),
    path("class-based/", views.EffectView.as_view()),
    path("async/", views.async_effect),
    path("async-receipt/", views.async_receipt),
    path("loses-its-connection/", views.loses_its_connection),
    path("dies-mid-write/", views.dies_mid_write),
    path("forgets-prepared-statements/", views.forgets_prepared_statements),
    path("", include("tests.project.drf_urls")),
    path("api/atomic-charge/", atomicity_views.AtomicChargeView.as_view()),
    path("api/writes-then-fails/", atomicity_views.WritesThenFailsView.as_view()),
    path("orphan/", atomicity_views.orphan),
    *slash_optional.urls,
    path("orphan-in-store/", atomicity_views.orphan_in_store),
]
