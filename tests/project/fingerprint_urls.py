"""Routes for tests/test_fingerprints.py (``@pytest.mark.urls``), kept apart from the shared
``tests/project/urls.py``."""

from __future__ import annotations

from django.urls import path

from tests.project import fingerprint_views as views

urlpatterns = [
    path("upload/", views.upload),
    path("upload-after-csrf/", views.upload_after_csrf),
    path("api/upload/", views.UploadView.as_view()),
    path("api/upload-parsed/", views.parse_post_first(views.UploadView.as_view())),
    path("signed/", views.signed),
    path("async/signed/", views.async_signed),
    path("api/signed/", views.SignedView.as_view()),
    # Undecorated: protected by IdempotencyMiddleware where a test installs it.
    path("mw/signed/", views.unprotected_signed),
    path("api/mw/signed/", views.UnprotectedSignedView.as_view()),
    path("mw/upload/", views.unprotected_upload),
]
