"""The shape most projects run: a DRF ``APIView`` with per-request database authentication.

``Charge`` authenticates with DRF's ``TokenAuthentication`` (``rest_framework.authtoken``:
one ``SELECT`` of the token joined to its user on every request, as DRF does it), requires
an authenticated user, parses the body with DRF's parser and runs the same charge as
``views.bare`` (one ``INSERT``). It imports nothing of idempotency_django, so the peers'
servers serve this very view behind their middleware; ours are in ``drf_protected.py``.
"""

from __future__ import annotations

from rest_framework.authentication import TokenAuthentication
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from example_project.payments import service


class Charge(APIView):
    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated]

    def post(self, request: Request) -> Response:
        outcome = service.charge(request.user, request.data)  # type: ignore[arg-type]
        return Response(
            outcome.data,
            status=outcome.status,
            headers=outcome.headers,
            content_type=outcome.content_type,
        )


bare = Charge.as_view()
