"""The shop's entry points, one per way of protecting a view."""

from __future__ import annotations

import json
import os
import signal

from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from rest_framework import permissions, viewsets
from rest_framework.authentication import TokenAuthentication

from django_idempotency import idempotent
from django_idempotency.drf import IdempotentMixin
from example_project.provider import client as provider
from example_project.shop.models import Booking, Order, Payment
from example_project.shop.serializers import BookingSerializer


def _json(request: HttpRequest) -> dict:
    try:
        data = json.loads(request.body or b"{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


@csrf_exempt
@require_POST
@idempotent
def create_order(request: HttpRequest) -> JsonResponse:
    """Atomic mode: the order and the stored response commit together."""
    data = _json(request)
    if not isinstance(data.get("item"), str):
        return JsonResponse({"error": "send JSON with an 'item'"}, status=400)
    order = Order.objects.create(item=data["item"], quantity=int(data.get("quantity", 1)))
    response = JsonResponse(
        {"id": order.pk, "item": order.item, "quantity": order.quantity}, status=201
    )
    response["Location"] = f"/orders/{order.pk}/"
    return response


@csrf_exempt
@require_POST
@idempotent
async def create_order_async(request: HttpRequest) -> JsonResponse:
    """An async view, atomic mode: ``acreate`` joins the claim's transaction.

    Under an ASGI server the view's database calls run on the request's own
    thread, inside the transaction that holds the key (docs: Async views).
    """
    data = _json(request)
    if not isinstance(data.get("item"), str):
        return JsonResponse({"error": "send JSON with an 'item'"}, status=400)
    order = await Order.objects.acreate(item=data["item"], quantity=int(data.get("quantity", 1)))
    response = JsonResponse(
        {"id": order.pk, "item": order.item, "quantity": order.quantity, "view": "async"},
        status=201,
    )
    response["Location"] = f"/orders/{order.pk}/"
    return response


class BookingViewSet(IdempotentMixin, viewsets.ModelViewSet):
    """DRF: bookings are scoped to the token's user, claimed after authentication."""

    serializer_class = BookingSerializer
    authentication_classes = [TokenAuthentication]
    permission_classes = [permissions.IsAuthenticated]

    def get_queryset(self):  # type: ignore[no-untyped-def]
        return Booking.objects.filter(user=self.request.user).order_by("pk")

    def perform_create(self, serializer: BookingSerializer) -> None:
        serializer.save(user=self.request.user)


@csrf_exempt
@require_POST
@idempotent(atomic=False, lease=settings.EXAMPLE_PAYMENT_LEASE)
def create_payment(request: HttpRequest) -> JsonResponse:
    """Lease mode: the charge happens at a provider our transaction cannot undo.

    The provider gets a key derived from ours, the same on every retry, so a
    retry that takes over after a crash finds the first charge instead of
    making a second one.
    """
    data = _json(request)
    if not isinstance(data.get("amount"), int) or not isinstance(data.get("reference"), str):
        return JsonResponse({"error": "send JSON with 'reference' and 'amount'"}, status=400)
    charge = provider.charge(data["amount"], request.idempotency.derive("charge"))  # type: ignore[attr-defined]
    if settings.EXAMPLE_ALLOW_CRASH and request.headers.get("X-Simulate-Crash") == "after-charge":
        # The worker dies between the remote charge and recording the payment.
        os.kill(os.getpid(), signal.SIGKILL)
    payment = Payment.objects.create(
        reference=data["reference"], amount=data["amount"], charge_id=charge.pk
    )
    return JsonResponse(
        {"id": payment.pk, "reference": payment.reference, "charge": charge.pk}, status=201
    )
