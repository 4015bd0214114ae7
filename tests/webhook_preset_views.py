"""Webhook receivers built from the presets (``django_idempotency.webhooks``), as the docs show.

Each checks its provider's signature above ``@idempotent(**preset)``. The
event asks to mark an order paid: an unknown order is a 404 (the provider
will redeliver), a known one has its ``quantity`` raised by one (the
effect, so a count of effects survives in the database) and the work is
handed off when the transaction commits (a ``Publication`` row standing for
``task.delay_on_commit(...)``). The query string may ask the handler to
``hold`` for that many seconds, so that deliveries meet an original still
in flight.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

from django.db import transaction
from django.db.models import F
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.decorators import method_decorator
from django.views.decorators.csrf import csrf_exempt
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import idempotent, webhooks
from django_idempotency.contrib.drf import IdempotentMixin
from tests.models import Order, Publication

STRIPE_SECRET = "whsec_stripe-tests-only"
GITHUB_SECRET = "github-tests-only"
STANDARD_SECRET = "whsec_" + base64.b64encode(b"standard-webhooks-tests-only-key").decode()

stripe = webhooks.stripe_signature(STRIPE_SECRET)
github = webhooks.github_signature(GITHUB_SECRET)
standard = webhooks.standard_signature(STANDARD_SECRET)


def pay(request: HttpRequest, event_id: str, order: str) -> HttpResponse:
    """Mark ``order`` paid once, hand the work off on commit; 404 for an order not yet known."""
    if not Order.objects.filter(item=order).update(quantity=F("quantity") + 1):
        return JsonResponse({"error": f"no order {order}"}, status=404)
    transaction.on_commit(lambda: Publication.objects.create(event=event_id))
    hold = float(request.GET.get("hold", 0))
    if hold:
        time.sleep(hold)
    return JsonResponse({"paid": order, "event": event_id})


def order_of(request: HttpRequest) -> str:
    return str(json.loads(request.body)["data"]["order"])


@csrf_exempt
@stripe
@idempotent(**webhooks.STRIPE)
def stripe_view(request: HttpRequest) -> HttpResponse:
    return pay(request, json.loads(request.body)["id"], order_of(request))


@csrf_exempt
@stripe
@idempotent(**{**webhooks.STRIPE, "atomic": False})
def stripe_lease_view(request: HttpRequest) -> HttpResponse:
    return pay(request, json.loads(request.body)["id"], order_of(request))


@csrf_exempt
@github
@idempotent(**webhooks.GITHUB)
def github_view(request: HttpRequest) -> HttpResponse:
    return pay(request, request.headers["X-GitHub-Delivery"], order_of(request))


@csrf_exempt
@standard
@idempotent(**webhooks.STANDARD)
def standard_view(request: HttpRequest) -> HttpResponse:
    return pay(request, request.headers["webhook-id"], order_of(request))


@csrf_exempt
@standard
@idempotent(**webhooks.STANDARD)
async def standard_async_view(request: HttpRequest) -> HttpResponse:
    order = str(json.loads(request.body)["data"]["order"])
    updated = await Order.objects.filter(item=order).aupdate(quantity=F("quantity") + 1)
    if not updated:
        return JsonResponse({"error": f"no order {order}"}, status=404)
    # In the claim's transaction, which the async ORM joins: one row per kept effect.
    await Publication.objects.acreate(event=request.headers["webhook-id"])
    return JsonResponse({"paid": order, "event": request.headers["webhook-id"]})


@method_decorator(github, name="dispatch")
class GitHubDeliveryView(IdempotentMixin, APIView):
    """The GitHub preset on the DRF mixin, each option as its ``idempotency_*`` attribute.

    The signature is checked on ``dispatch``, before DRF's ``initial`` claims the key.
    """

    permission_classes = [AllowAny]
    authentication_classes: list[Any] = []
    idempotency_key = staticmethod(webhooks.GITHUB["key"])
    idempotency_fingerprint = staticmethod(webhooks.GITHUB["fingerprint"])
    idempotency_scope = staticmethod(webhooks.GITHUB["scope"])
    idempotency_required = True
    idempotency_ttl = webhooks.GITHUB["ttl"]
    idempotency_store = staticmethod(webhooks.success_only)

    def post(self, request: Request) -> Response:
        order = str(request.data["data"]["order"])
        if not Order.objects.filter(item=order).update(quantity=F("quantity") + 1):
            return Response({"error": f"no order {order}"}, status=404)
        Publication.objects.create(event=request.headers["X-GitHub-Delivery"])
        return Response({"paid": order}, status=200)


#: What the ``verdict`` view's store option answers, set by a test.
verdict: dict[str, Any] = {"value": True}


@csrf_exempt
@idempotent(store=lambda response: verdict["value"])
def verdict_view(request: HttpRequest) -> HttpResponse:
    Order.objects.create(item="verdict")
    return JsonResponse({"ok": True}, status=int(request.GET.get("status", 201)))


@csrf_exempt
@idempotent(atomic=False, store=lambda response: verdict["value"])
def verdict_lease_view(request: HttpRequest) -> HttpResponse:
    Order.objects.create(item="verdict-lease")
    return JsonResponse({"ok": True}, status=201)


@csrf_exempt
@idempotent(store="django_idempotency.webhooks.success_only")
def dotted_store_view(request: HttpRequest) -> HttpResponse:
    Order.objects.create(item="dotted")
    return JsonResponse({"ok": True}, status=int(request.GET.get("status", 201)))
