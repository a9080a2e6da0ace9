from __future__ import annotations

from django.urls import path

from example_project.payments import views

urlpatterns = [
    path("charges/", views.charges, name="charges"),
]
