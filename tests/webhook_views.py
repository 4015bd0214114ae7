"""Webhook receivers keyed by the request itself (the ``key`` option), as the docs' recipes.

A Stripe-style receiver takes the event id from the JSON body, after its
signature has been checked by a decorator outside ``@idempotent``; a
GitHub-style one takes the ``X-GitHub-Delivery`` header. Each writes one
``Order`` named after the event as its effect. The query string may ask
the handler to ``hold`` for that many seconds, so that duplicates meet an
original still in flight.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import idempotent
from django_idempotency.contrib.drf import IdempotentMixin
from tests.models import Order
from tests.views import calls

#: The endpoint secret the provider signs deliveries with.
SIGNING_SECRET = b"whsec_tests-only"
#: How old a signed timestamp may be, as Stripe's libraries allow by default.
TOLERANCE_SECONDS = 300


def sign(body: bytes, timestamp: int | None = None) -> str:
    """A ``Stripe-Signature`` header value for ``body``: ``t=<time>,v1=<HMAC-SHA256>``."""
    timestamp = int(time.time()) if timestamp is None else timestamp
    signed = f"{timestamp}.".encode() + body
    digest = hmac.new(SIGNING_SECRET, signed, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


def _signature_is_valid(request: HttpRequest) -> bool:
    fields = dict(
        item.split("=", 1)
        for item in request.headers.get("Stripe-Signature", "").split(",")
        if "=" in item
    )
    try:
        timestamp = int(fields["t"])
    except (KeyError, ValueError):
        return False
    if abs(time.time() - timestamp) > TOLERANCE_SECONDS:
        return False
    expected = sign(request.body, timestamp).split("v1=", 1)[1]
    return hmac.compare_digest(expected, fields.get("v1", ""))


def signature_required(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Answer 400 to a delivery whose signature does not check out, before any key is claimed."""

    @wraps(view)
    def checked(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not _signature_is_valid(request):
            return HttpResponse("Bad signature.", status=400)
        return view(request, *args, **kwargs)

    return checked


def event_id(request: HttpRequest) -> str | None:
    return json.loads(request.body)["id"]


def _record(request: HttpRequest, name: str) -> HttpResponse:
    calls.increment()
    order = Order.objects.create(item=name)
    hold = float(request.GET.get("hold", 0))
    if hold:
        time.sleep(hold)
    return JsonResponse({"received": name, "order": order.pk})


def webhook_scope(request: HttpRequest) -> str:
    return "webhooks:stripe"


@csrf_exempt
@signature_required
@idempotent(key=lambda request: json.loads(request.body)["id"], scope=webhook_scope)
def stripe_webhook(request: HttpRequest) -> HttpResponse:
    event = json.loads(request.body)
    return _record(request, event["id"])


@csrf_exempt
@signature_required
@idempotent(key=event_id, scope=webhook_scope, atomic=False)
def stripe_webhook_lease(request: HttpRequest) -> HttpResponse:
    event = json.loads(request.body)
    return _record(request, event["id"])


@csrf_exempt
@idempotent(
    key=lambda request: request.headers.get("X-GitHub-Delivery"),
    scope=lambda request: "webhooks:github",
    required=True,
)
def github_webhook(request: HttpRequest) -> HttpResponse:
    return _record(request, request.headers["X-GitHub-Delivery"])


@csrf_exempt
@idempotent(key="tests.webhook_views.delivery_header")
def dotted_key(request: HttpRequest) -> HttpResponse:
    return _record(request, request.headers.get("X-Delivery", "none"))


def delivery_header(request: HttpRequest) -> str | None:
    return request.headers.get("X-Delivery")


#: What the ``returned`` view's key function returns, set by a test.
returned: dict[str, Any] = {"key": None}


@csrf_exempt
@idempotent(key=lambda request: returned["key"])
def returned_key(request: HttpRequest) -> HttpResponse:
    return _record(request, "returned")


@csrf_exempt
@idempotent(key=delivery_header)
async def async_webhook(request: HttpRequest) -> HttpResponse:
    calls.increment()
    order = await Order.objects.acreate(item=request.headers.get("X-Delivery", "none"))
    return JsonResponse({"received": order.item, "order": order.pk})


class DeliveryView(IdempotentMixin, APIView):
    """The GitHub-style receiver as a DRF view: the key from the mixin's attribute."""

    permission_classes = [AllowAny]
    authentication_classes: list[Any] = []
    idempotency_key = staticmethod(lambda request: request.headers.get("X-GitHub-Delivery"))
    idempotency_required = True

    def post(self, request: Request) -> Response:
        calls.increment()
        order = Order.objects.create(item=request.headers["X-GitHub-Delivery"])
        return Response({"received": order.item, "order": order.pk}, status=201)
