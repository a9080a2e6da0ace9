from __future__ import annotations

from django.urls import path

from tests.project.ninja_views import api

urlpatterns = [path("ninja/", api.urls)]
