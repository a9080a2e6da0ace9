"""Routes for tests/test_fingerprints.py (``@pytest.mark.urls``), kept apart from the shared
``tests/urls.py``."""

from __future__ import annotations

from django.urls import path

from tests import fingerprint_views as views

urlpatterns = [
    path("upload/", views.upload),
    path("upload-after-csrf/", views.upload_after_csrf),
    path("api/upload/", views.UploadView.as_view()),
    path("api/upload-parsed/", views.parse_post_first(views.UploadView.as_view())),
]
