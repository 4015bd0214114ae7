"""The shop's entry points, one per way of protecting a view."""

from __future__ import annotations

import json
import os
import signal
import time

from django.conf import settings
from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST
from rest_framework import permissions, viewsets
from rest_framework.authentication import TokenAuthentication

from django_idempotency import idempotent, webhooks
from django_idempotency.drf import IdempotentMixin
from example_project.provider import client as provider
from example_project.shop.models import Booking, Order, Payment, Receipt
from example_project.shop.serializers import BookingSerializer

#: What the landing page lists: each endpoint, and what to try first (the
#: lines ``python3 dev.py serve`` prints, for the address the page was read at).
ENDPOINTS = [
    ("GET, POST", "/checkout/", "a checkout form for browsers: double-click Pay, get one order"),
    ("POST", "/orders/", "an order: @idempotent, atomic mode"),
    ("GET", "/orders/<int:pk>/", "an order's page, where the checkout lands"),
    ("POST", "/async-orders/", "the same order from an async def view"),
    ("GET, POST", "/api/bookings/", "bookings: a DRF viewset with IdempotentMixin, token auth"),
    ("POST", "/payments/", "a payment: lease mode, charging the fake provider once"),
    ("POST", "/receipts/", "a receipt: an idempotent Celery task, published on commit"),
    ("POST", "/webhooks/provider/", "the provider's signed webhook: webhooks.STANDARD"),
    ("GET", "/receipts/list/?order=<id>", "an order's receipts"),
    ("GET", "/provider/charges/?key=<key>", "the fake payment provider's ledger"),
    ("GET", "/api/schema/", "the OpenAPI schema, with Idempotency-Key documented"),
    ("GET", "/admin/", "the idempotency records (after manage.py createsuperuser)"),
]
TRY_IT = """\
curl -i -X POST {base}/orders/ -H 'Idempotency-Key: order-1' \\
     -H 'Content-Type: application/json' -d '{{"item": "book"}}'
# the same command again: same 201, same body, plus Idempotent-Replayed: true
curl -i -X POST {base}/orders/ -H 'Idempotency-Key: order-1' \\
     -H 'Content-Type: application/json' -d '{{"item": "lamp"}}'
# same key, different body: 422
curl -i -X POST {base}/async-orders/ -H 'Idempotency-Key: order-2' \\
     -H 'Content-Type: application/json' -d '{{"item": "mug"}}'
# an async view: the same rules
"""


@require_GET
def index(request: HttpRequest) -> HttpResponse:
    """The landing page: what the shop serves, and the curl lines to try it."""
    base = request.build_absolute_uri("/").rstrip("/")
    context = {"base": base, "endpoints": ENDPOINTS, "try_it": TRY_IT.format(base=base)}
    return render(request, "shop/index.html", context)


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


@idempotent
def checkout(request: HttpRequest) -> HttpResponse:
    """A server-rendered form, as a shop's checkout is: the key is a hidden field.

    The template renders ``{% idempotency_key_field %}``, so a double-clicked
    Pay button sends one key twice: the second POST waits for the first and
    is answered with its redirect, and the shopper lands on the one order.
    The payment step is slow on purpose (``EXAMPLE_CHECKOUT_SECONDS``), as a
    provider's round trip is, to make the double click easy to try.
    """
    # The session starts with the form, so a guest's POSTs are scoped by it.
    request.session.setdefault("shop", "guest")
    item = request.POST.get("item", "").strip() if request.method == "POST" else ""
    quantity = request.POST.get("quantity") or "1"
    if request.method != "POST" or not item or not quantity.isdigit():
        error = "Choose an item and a quantity." if request.method == "POST" else ""
        return render(request, "shop/checkout.html", {"error": error, "item": item})
    time.sleep(settings.EXAMPLE_CHECKOUT_SECONDS)  # the payment provider's round trip
    order = Order.objects.create(item=item, quantity=int(quantity))
    return redirect("order-detail", order.pk)


@require_GET
def order_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """Where the checkout lands: one order, however many times Pay was clicked."""
    order = get_object_or_404(Order, pk=pk)
    return render(request, "shop/order.html", {"order": order, "orders": Order.objects.count()})


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
        if getattr(self, "swagger_fake_view", False):  # OpenAPI schema generation: no user
            return Booking.objects.none()
        return Booking.objects.filter(user=self.request.user).order_by("pk")

    def perform_create(self, serializer: BookingSerializer) -> None:
        serializer.save(user=self.request.user)


@csrf_exempt
@require_POST
@idempotent(atomic=False, lease=settings.EXAMPLE_PAYMENT_LEASE)
def create_payment(request: HttpRequest) -> JsonResponse:
    """Lease mode: the charge happens at a provider our transaction cannot undo.

    Two steps, each recorded as done with a checkpoint: charge the provider
    (with a key derived from ours, the same on every attempt, so that even a
    repeated call charges once), then record the payment. A retry that takes
    over after a crash resumes after the last checkpoint: it neither charges
    again nor records a second payment.
    """
    data = _json(request)
    if not isinstance(data.get("amount"), int) or not isinstance(data.get("reference"), str):
        return JsonResponse({"error": "send JSON with 'reference' and 'amount'"}, status=400)
    info = request.idempotency  # type: ignore[attr-defined]
    done = info.checkpoints
    if "charged" in done:
        charge_id = done["charged"]["charge"]
    else:
        charge_id = provider.charge(data["amount"], info.derive("charge")).pk
        info.checkpoint("charged", {"charge": charge_id})
    if settings.EXAMPLE_ALLOW_CRASH and request.headers.get("X-Simulate-Crash") == "after-charge":
        # The worker dies between the remote charge and recording the payment.
        os.kill(os.getpid(), signal.SIGKILL)
    if "recorded" in done:
        payment = Payment.objects.get(pk=done["recorded"]["payment"])
    else:
        payment = Payment.objects.create(
            reference=data["reference"], amount=data["amount"], charge_id=charge_id
        )
        info.checkpoint("recorded", {"payment": payment.pk})
    body = {
        "id": payment.pk,
        "reference": payment.reference,
        "charge": charge_id,
        "attempt": info.attempt,
        "resumed after": sorted(done),
    }
    return JsonResponse(body, status=201)


@csrf_exempt
@require_POST
@idempotent
def request_receipt(request: HttpRequest) -> JsonResponse:
    """Atomic mode, publishing a Celery task only once the transaction commits.

    Published inside the transaction, the task could run before the commit
    (and miss the order) or for a request that then rolls back. A replayed
    request does not run the view, so it publishes nothing; a new request
    for the same order does, and the task's own key makes it one receipt.
    """
    from example_project.shop.tasks import send_receipt  # Celery is optional

    data = _json(request)
    order_id = data.get("order")
    order = Order.objects.filter(pk=order_id).first() if isinstance(order_id, int) else None
    if order is None:
        return JsonResponse({"error": "send JSON with the 'order' id"}, status=400)
    transaction.on_commit(lambda: send_receipt.delay(order.pk))
    return JsonResponse({"order": order.pk, "receipt": "queued"}, status=202)


@require_GET
def list_receipts(request: HttpRequest) -> JsonResponse:
    """The receipts of one order, for the walkthrough to count."""
    receipts = Receipt.objects.filter(order_id=request.GET.get("order")).order_by("pk")
    return JsonResponse({"receipts": [{"id": r.pk, "order": r.order_id} for r in receipts]})


@csrf_exempt
@require_POST
@webhooks.standard_signature(lambda: settings.PROVIDER_WEBHOOK_SECRET)
@idempotent(**webhooks.STANDARD)
def provider_webhook(request: HttpRequest) -> HttpResponse:
    """The fake provider says a charge settled: once per event, however often it is sent.

    The signature is checked first, so a forgery claims nothing. The preset
    keys by ``webhook-id`` and stores only a 2xx: a settlement for a payment
    the shop has not recorded yet is a 404, which the provider redelivers
    later and which then runs, instead of being replayed for days.
    """
    event = _json(request)
    if event.get("type") != "charge.settled":
        return HttpResponse(status=204)  # not ours to act on: done, never asked again
    data = event.get("data")
    charge = data.get("charge") if isinstance(data, dict) else None
    payment = Payment.objects.select_for_update().filter(charge_id=charge).first()
    if payment is None:
        return JsonResponse({"error": f"no payment for charge {charge!r} yet"}, status=404)
    payment.settlements += 1
    payment.save(update_fields=["settlements"])
    return JsonResponse({"payment": payment.pk, "settlements": payment.settlements})
