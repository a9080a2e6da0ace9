from __future__ import annotations

from django.urls import path

from benchmarks.benchproject import views

urlpatterns = [
    path("bench/null/", views.null, name="bench-null"),
    path("bench/bare/", views.bare, name="bench-bare"),
    path("bench/commit/", views.commit, name="bench-commit"),
    path("bench/atomic/", views.atomic, name="bench-atomic"),
    path("bench/ping/", views.ping, name="bench-ping"),
]
