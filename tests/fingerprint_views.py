"""Views for the multipart fingerprint tests: each execution writes one ``SideEffect`` and
answers with what the view itself read, so a test sees that uploads reach it intact."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from django.core.files.uploadedfile import TemporaryUploadedFile, UploadedFile
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_protect
from rest_framework.parsers import MultiPartParser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from idempotency_django.decorators import idempotent
from idempotency_django.drf import IdempotentMixin
from tests.models import SideEffect


def _seen(fields: Any, files: Any) -> dict[str, Any]:
    def read(upload: UploadedFile[Any]) -> dict[str, Any]:
        return {
            "name": upload.name,
            "sha256": hashlib.sha256(upload.read()).hexdigest(),
            "spooled": isinstance(upload, TemporaryUploadedFile),
        }

    return {
        "fields": {name: fields.getlist(name) for name in fields},
        "files": {name: [read(upload) for upload in files.getlist(name)] for name in files},
    }


def _upload(request: HttpRequest, label: str) -> HttpResponse:
    effect = SideEffect.objects.create(label=label)
    return JsonResponse({"effect": effect.pk, **_seen(request.POST, request.FILES)}, status=201)


@idempotent
def upload(request: HttpRequest) -> HttpResponse:
    return _upload(request, "upload")


# CsrfViewMiddleware's check, as the middleware runs it: it reads request.POST (the token
# is a form field) before the view, so the multipart body is parsed before @idempotent.
@csrf_protect
@idempotent
def upload_after_csrf(request: HttpRequest) -> HttpResponse:
    return _upload(request, "upload_after_csrf")


class UploadView(IdempotentMixin, APIView):
    parser_classes = [MultiPartParser]

    def post(self, request: Request) -> Response:
        effect = SideEffect.objects.create(label="drf-upload")
        seen = _seen(request.POST, request.FILES)
        return Response({"effect": effect.pk, **seen}, status=201)


def parse_post_first(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Read ``request.POST`` before ``view`` runs, as a middleware might."""

    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        request.POST  # noqa: B018 - parsing is the point
        return view(request, *args, **kwargs)

    return wrapper
