"""django-ninja: a protected router and one protected operation."""

from django.contrib.auth import authenticate
from ninja import Schema
from ninja.security import HttpBasicAuth

from .models import Order


class BasicAuth(HttpBasicAuth):
    """A ninja authenticator that returns the user (HTTP Basic here; an API key in
    yours)."""

    def authenticate(self, request, username, password):
        return authenticate(request, username=username, password=password)


class ChargeIn(Schema):
    amount: int


class ChargeOut(Schema):
    id: int


RefundIn, RefundOut = ChargeIn, ChargeOut


# docs:start
from ninja import NinjaAPI
from ninja.responses import Status

from idempotency_django.ninja import IdempotentRouter, idempotent

api = NinjaAPI(urls_namespace="docs-snippet")
charges = IdempotentRouter(auth=BasicAuth())  # every POST and PATCH operation (METHODS)


@charges.post("/", response={201: ChargeOut})
def create_charge(request, payload: ChargeIn):
    return Status(
        201, {"id": Order.objects.create(label=f"charge {payload.amount}").pk}
    )


@api.post("/refunds/", auth=BasicAuth(), response={201: RefundOut})
@idempotent(in_flight="wait")  # one operation: below the route decorator
def refund(request, payload: RefundIn):
    return Status(
        201, {"id": Order.objects.create(label=f"refund {payload.amount}").pk}
    )


api.add_router("/charges/", charges)
# docs:end
