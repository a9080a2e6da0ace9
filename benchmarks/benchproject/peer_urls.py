"""The peers' servers serve the bare views, plain and DRF (their middleware protects them),
and readiness."""

from __future__ import annotations

from django.urls import path

from benchmarks.benchproject import drf_views, views

urlpatterns = [
    path("bench/bare/", views.bare, name="bench-bare"),
    path("bench/drf/bare/", drf_views.bare, name="bench-drf-bare"),
    path("bench/ping/", views.ping, name="bench-ping"),
]
