"""A URLconf whose decorator hides a DRF view from ``IdempotencyMiddleware`` (check E027),
next to one that wraps it as Django's decorators do (``functools.wraps``: no error)."""

from __future__ import annotations

from django.urls import path

from tests.project import middleware_views

urlpatterns = [
    path("hidden/", middleware_views.hiding(middleware_views.TokenChargeView.as_view())),
    path("counted/", middleware_views.counted(middleware_views.TokenChargeView.as_view())),
    path("plain/", middleware_views.hiding(middleware_views.plain)),
]
