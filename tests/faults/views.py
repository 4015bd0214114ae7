"""Views the fault suite drives over real HTTP; each leaves one countable effect.

Requests name their tenant in ``X-Tenant`` (the scope), so the suite can send
one key from several scopes. ``?hold=<seconds>`` keeps the handler busy after
its effect is written, widening the window in which a fault lands mid-handler.
"""

from __future__ import annotations

import json
import time
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse

from django_idempotency import idempotent
from tests.models import Order, RemoteCharge

#: Lease of the lease-mode view: short, so a retry takes over a killed worker's claim.
LEASE_SECONDS = 2
TENANT_HEADER = "X-Tenant"


def tenant_scope(request: HttpRequest) -> str:
    return "tenant:" + request.headers.get(TENANT_HEADER, "none")


def _parse(request: HttpRequest) -> dict[str, Any] | HttpResponse:
    """The body as a JSON object, or the 400 a careful handler answers to anything else."""
    try:
        data = json.loads(request.body)
    except (ValueError, RecursionError):
        return JsonResponse({"error": "body is not JSON"}, status=400)
    if not isinstance(data, dict) or not isinstance(data.get("item"), str):
        return JsonResponse({"error": "expected an object with an item"}, status=400)
    return data


def _created(request: HttpRequest, effect: Order | RemoteCharge) -> JsonResponse:
    """The handler's answer, once it has held as long as ``?hold`` asks."""
    hold = request.GET.get("hold")
    if hold:
        time.sleep(float(hold))
    return JsonResponse(
        {"effect": effect.pk, "item": effect.item, "scope": request.idempotency.scope},
        status=201,
    )


def _order(request: HttpRequest) -> HttpResponse:
    data = _parse(request)
    if isinstance(data, HttpResponse):
        return data
    return _created(request, Order.objects.create(item=data["item"][:100]))


@idempotent(scope=tenant_scope)
def create_order(request: HttpRequest) -> HttpResponse:
    """Atomic mode: the Order and the stored response commit together."""
    return _order(request)


@idempotent(scope=tenant_scope, wait=0.2)
def create_order_short_wait(request: HttpRequest) -> HttpResponse:
    """Atomic mode with a short wait, so a retry of a slow original soon gets its 409."""
    return _order(request)


@idempotent(scope=tenant_scope, atomic=False, lease=LEASE_SECONDS)
def create_charge(request: HttpRequest) -> HttpResponse:
    """Lease mode: a remote effect that cannot be rolled back, deduplicated by a derived key."""
    data = _parse(request)
    if isinstance(data, HttpResponse):
        return data
    charge, _ = RemoteCharge.objects.get_or_create(
        reference=request.idempotency.derive("charge"), defaults={"item": data["item"][:300]}
    )
    return _created(request, charge)


@idempotent(scope=tenant_scope)
def large_response(request: HttpRequest) -> HttpResponse:
    """A response over ``MAX_STORED_BODY``: stored without its body, never run twice."""
    data = _parse(request)
    if isinstance(data, HttpResponse):
        return data
    order = Order.objects.create(item=data["item"][:100])
    size = int(request.GET.get("size", 2_000_000))
    response = HttpResponse(b"x" * size, content_type="application/octet-stream", status=201)
    response["Location"] = f"/orders/{order.pk}/"
    return response
