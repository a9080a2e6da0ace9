"""A key for the call a view makes to a provider, derived from the incoming one."""

from django.http import JsonResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.csrf import csrf_exempt

from .auth import api_auth_required
from .models import Order


class stripe:  # stands in for the Stripe SDK: records each call's key
    calls: list[dict] = []

    class PaymentIntent:
        @staticmethod
        def create(**arguments):
            stripe.calls.append(arguments)
            return {"id": f"pi_{len(stripe.calls)}"}


# docs:start
from idempotency_django.decorators import idempotent
from idempotency_django.downstream import downstream_key_for


@csrf_exempt
@api_auth_required
@idempotent
def pay_order(request, order_id):
    order = get_object_or_404(Order, pk=order_id)
    intent = stripe.PaymentIntent.create(
        amount=1000,
        currency="eur",
        metadata={"order": order.pk},
        idempotency_key=downstream_key_for(request, "stripe-payment-intent"),
    )
    return JsonResponse({"payment_intent": intent["id"]}, status=201)


# docs:end


# docs:guest
def guest_payment_key(request):
    """With ANONYMOUS = "bypass", a guest's request runs unprotected: scope its
    downstream key by something only that guest holds, here its session."""
    if request.session.session_key is None:
        request.session.save()
    account = f"guest:{request.session.session_key}"
    return downstream_key_for(request, "stripe-payment-intent", account=account)


# docs:guest-end
