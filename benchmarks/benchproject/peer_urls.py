"""The peers' servers serve the bare view (their middleware protects it) and readiness."""

from __future__ import annotations

from django.urls import path

from benchmarks.benchproject import views

urlpatterns = [
    path("bench/bare/", views.bare, name="bench-bare"),
    path("bench/ping/", views.ping, name="bench-ping"),
]
