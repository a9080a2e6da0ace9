from __future__ import annotations

from django.urls import path

from benchmarks.benchproject import drf_protected, drf_views, protected, views

urlpatterns = [
    path("bench/null/", views.null, name="bench-null"),
    path("bench/bare/", views.bare, name="bench-bare"),
    path("bench/commit/", protected.commit, name="bench-commit"),
    path("bench/atomic/", protected.atomic, name="bench-atomic"),
    path("bench/drf/bare/", drf_views.bare, name="bench-drf-bare"),
    path("bench/drf/protected/", drf_protected.protected, name="bench-drf-protected"),
    path("bench/ping/", views.ping, name="bench-ping"),
]
