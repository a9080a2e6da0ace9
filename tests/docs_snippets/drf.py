"""The DRF mixin, on a viewset with a custom action and on a model viewset."""

from rest_framework import serializers, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from .models import Order


class OrderSerializer(serializers.ModelSerializer):
    class Meta:
        model = Order
        fields = ["id", "label"]


# docs:start
from idempotency_django.drf import IdempotentMixin, IdempotentModelViewSet


class ChargeViewSet(IdempotentMixin, viewsets.ViewSet):
    idempotency_actions = {"create", "refund"}  # default: every method in METHODS
    idempotency_in_flight = "wait"  # any @idempotent argument, prefixed idempotency_

    def create(self, request):
        charge = Order.objects.create(label=request.data["label"])
        return Response({"id": charge.pk}, status=201)

    @action(detail=True, methods=["post"])
    def refund(self, request, pk=None):
        refund = Order.objects.create(label=f"refund of {pk}")
        return Response({"id": refund.pk}, status=201)


class OrderViewSet(IdempotentModelViewSet):  # create and partial_update are idempotent
    queryset = Order.objects.all()
    serializer_class = OrderSerializer


# docs:end
