"""The quickstart: a plain view and a class-based view, protected by ``@idempotent``."""

# docs:start
import json

from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from idempotency_django.decorators import idempotent

from .auth import api_auth_required  # yours: sets request.user, or answers 401
from .models import Order  # yours


@csrf_exempt  # API clients send no CSRF token: without this, a 403 (CSRF)
@require_POST
@api_auth_required  # outside @idempotent: the key is scoped to request.user
@idempotent
def create_order(request):
    order = Order.objects.create(label=json.loads(request.body)["item"])
    return JsonResponse({"id": order.pk}, status=201)


# docs:end


# docs:class-based
from django.utils.decorators import method_decorator
from django.views import View


@method_decorator(
    [csrf_exempt, api_auth_required, idempotent(in_flight="wait")], name="dispatch"
)
class OrderView(View):
    def post(self, request):
        order = Order.objects.create(label=json.loads(request.body)["item"])
        return JsonResponse({"id": order.pk}, status=201)


# docs:class-based-end
