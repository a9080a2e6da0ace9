"""Views for the multipart fingerprint tests: each execution writes one ``SideEffect`` and
answers with what the view itself read, so a test sees that uploads reach it intact."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from typing import Any

from django.core.files.uploadedfile import TemporaryUploadedFile, UploadedFile
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt, csrf_protect
from rest_framework.parsers import JSONParser, MultiPartParser
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


# -- views that read request.body (webhooks verifying a signature over the raw body) ----------

#: The shared secret of the signed views: a sender signs the raw body with it.
WEBHOOK_SECRET = b"whsec-test"


def signature(body: bytes) -> str:
    return hmac.new(WEBHOOK_SECRET, body, hashlib.sha256).hexdigest()


def _signed(request: Any, label: str) -> dict[str, Any] | None:
    """What a webhook handler does: the signature over the raw body first, then the parsed
    form (both must work in one view); ``None`` when the signature does not match."""
    computed = signature(request.body)
    if not hmac.compare_digest(computed, request.headers.get("X-Signature", "")):
        return None
    effect = SideEffect.objects.create(label=label)
    seen = (
        _seen(request.POST, request.FILES) if request.content_type.startswith("multipart/") else {}
    )
    return {"effect": effect.pk, "signature": computed, **seen}


def _signed_response(request: HttpRequest, label: str) -> HttpResponse:
    seen = _signed(request, label)
    if seen is None:
        return JsonResponse({"detail": "bad signature"}, status=401)
    return JsonResponse(seen, status=201)


@idempotent
def signed(request: HttpRequest) -> HttpResponse:
    return _signed_response(request, "signed")


@idempotent
async def async_signed(request: HttpRequest) -> HttpResponse:
    from asgiref.sync import sync_to_async

    return await sync_to_async(_signed_response)(request, "async-signed")


@csrf_exempt
def unprotected_signed(request: HttpRequest) -> HttpResponse:
    """Left to ``IdempotencyMiddleware`` (undecorated), csrf-exempt as a webhook is."""
    return _signed_response(request, "mw-signed")


class SignedView(IdempotentMixin, APIView):
    parser_classes = [MultiPartParser, JSONParser]

    def post(self, request: Request) -> Response:
        seen = _signed(request, "drf-signed")
        if seen is None:
            return Response({"detail": "bad signature"}, status=401)
        return Response(seen, status=201)


class UnprotectedSignedView(APIView):
    """Left to ``IdempotencyMiddleware`` (which runs it with the mixin)."""

    parser_classes = [MultiPartParser, JSONParser]

    def post(self, request: Request) -> Response:
        seen = _signed(request, "mw-drf-signed")
        if seen is None:
            return Response({"detail": "bad signature"}, status=401)
        return Response(seen, status=201)


@csrf_exempt
def unprotected_upload(request: HttpRequest) -> HttpResponse:
    """Reads only ``request.POST``/``FILES``: left to ``IdempotencyMiddleware``."""
    return _upload(request, "mw-upload")
