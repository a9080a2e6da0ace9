"""Which ``ATOMIC_REQUESTS`` transactions a protected view runs in: the same answer in every
adapter (``@idempotent``, the DRF mixin, the middleware), honouring the author's
``@transaction.non_atomic_requests`` opt-out. Each view records whether its work ran inside a
transaction on ``default``, as the author would observe it."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connections, transaction
from django.http import HttpRequest, HttpResponse
from django.urls import path
from rest_framework.authentication import TokenAuthentication
from rest_framework.authtoken.models import Token
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from idempotency_django.decorators import idempotent
from idempotency_django.drf import IdempotentMixin

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.urls("tests.test_protect"),
]

seen: list[bool] = []


def _record() -> None:
    seen.append(connections["default"].in_atomic_block)


class _Authenticated(APIView):
    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated]

    def post(self, request: Request) -> Response:
        _record()
        return Response({"ok": True}, status=201)


class MixinView(IdempotentMixin, _Authenticated):
    pass


class MixinDispatchOptOut(IdempotentMixin, _Authenticated):
    @transaction.non_atomic_requests
    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        return super().dispatch(request, *args, **kwargs)


class PlainDRFView(_Authenticated):
    """No mixin: protected by the middleware, when it is installed."""


@idempotent
def decorated(request: HttpRequest) -> HttpResponse:
    _record()
    return HttpResponse(status=201)


@transaction.non_atomic_requests
@idempotent
def decorated_opted_out(request: HttpRequest) -> HttpResponse:
    _record()
    return HttpResponse(status=201)


# non_atomic_requests marks the view it is given: each URL has a view of its own.
urlpatterns = [
    path("mixin/", MixinView.as_view()),
    path("mixin-opted-out/", transaction.non_atomic_requests(MixinView.as_view())),
    path("mixin-dispatch-opted-out/", MixinDispatchOptOut.as_view()),
    path("plain-drf/", PlainDRFView.as_view()),
    path("plain-drf-opted-out/", transaction.non_atomic_requests(PlainDRFView.as_view())),
    path("decorated/", decorated),
    path("decorated-opted-out/", decorated_opted_out),
]


@pytest.fixture(autouse=True)
def atomic_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    seen.clear()
    monkeypatch.setitem(connections["default"].settings_dict, "ATOMIC_REQUESTS", True)


@pytest.fixture
def middleware(settings: Any) -> None:
    settings.MIDDLEWARE = [
        *settings.MIDDLEWARE,
        "idempotency_django.middleware.IdempotencyMiddleware",
    ]


def _send(client: Any, url: str, user: User) -> Any:
    token = Token.objects.create(user=user).key
    return client.post(
        url,
        data="{}",
        content_type="application/json",
        headers={"Idempotency-Key": "k1", "Authorization": f"Token {token}", "X-User": "alice"},
    )


@pytest.mark.parametrize(
    ("url", "in_transaction"),
    [
        ("/mixin/", True),
        ("/mixin-opted-out/", False),
        ("/mixin-dispatch-opted-out/", False),
        ("/decorated/", True),
        ("/decorated-opted-out/", False),
    ],
)
def test_a_protected_view_runs_in_the_request_transactions_its_author_kept(
    client: Any, alice: User, url: str, in_transaction: bool
) -> None:
    response = _send(client, url, alice)

    assert response.status_code == 201
    assert seen == [in_transaction]


@pytest.mark.parametrize(
    ("url", "in_transaction"),
    [
        ("/plain-drf/", True),
        ("/plain-drf-opted-out/", False),
        ("/mixin-opted-out/", False),
    ],
)
def test_under_the_middleware_too(
    client: Any, alice: User, middleware: None, url: str, in_transaction: bool
) -> None:
    response = _send(client, url, alice)

    assert response.status_code == 201
    assert response.headers.get("Idempotent-Replayed") is None
    assert seen == [in_transaction]


def test_the_request_transactions_answer_keeps_its_documented_import_path() -> None:
    """``protect.request_transactions`` (and ``RequestTransactions``) still import from where
    the docs first named them, and are the transaction module's own."""
    from idempotency_django.core import protect, transactions

    assert protect.request_transactions is transactions.request_transactions
    assert protect.RequestTransactions is transactions.RequestTransactions
