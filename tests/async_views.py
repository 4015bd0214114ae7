"""Async views the suite drives, in process and under uvicorn.

Each protected view writes its effect twice: an ``Order`` through the async
ORM (``acreate``) and, unless told not to, an audit ``Order`` through
``sync_to_async``, so that tests prove both join the request's transaction.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from asgiref.sync import sync_to_async
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.decorators import method_decorator
from django.views import View

from django_idempotency import idempotency_exempt, idempotent
from tests.drf_views import CONTROL_DIR_ENV, HOLD_LIMIT
from tests.models import Order
from tests.views import calls


def _in_transaction() -> bool:
    return connection.in_atomic_block


async def _create_order(request: HttpRequest) -> HttpResponse:
    """Write the effect, then answer as the body and query string ask.

    Body: ``item``, ``raise`` (fail after writing). Query string: ``hold``
    (seconds to keep the handler busy, without blocking the event loop),
    ``wait_for_go`` (report the PID to the control directory and wait for
    the test's go-ahead, for the crash tests).
    """
    calls.increment()
    data = json.loads(request.body or b"{}")
    order = await Order.objects.acreate(item=data.get("item", "widget"))
    await sync_to_async(Order.objects.create)(item=f"audit:{order.item}")
    hold = float(request.GET.get("hold", 0))
    if hold:
        await asyncio.sleep(hold)
    info = getattr(request, "idempotency", None)
    payload: dict[str, Any] = {
        "id": order.pk,
        "item": order.item,
        "pid": os.getpid(),
        "in_transaction": await sync_to_async(_in_transaction)(),
    }
    if info is not None:
        payload.update(key=info.key, scope=info.scope, payment=info.derive("payment"))
    if request.GET.get("wait_for_go") and not await _wait_for_go(info.key, payload):
        return JsonResponse({"detail": "never released"}, status=503)
    if data.get("raise"):
        raise RuntimeError("handler failed after writing")
    response = JsonResponse(payload, status=201)
    response["Location"] = f"/orders/{order.pk}/"
    return response


async def _wait_for_go(name: str, report: dict[str, Any]) -> bool:
    """Report this worker's PID, then wait (on the event loop) for ``<name>.go``."""
    control = Path(os.environ[CONTROL_DIR_ENV])
    (control / f"{name}.tmp").write_text(json.dumps(report))
    (control / f"{name}.tmp").replace(control / f"{name}.pid")
    deadline = time.monotonic() + HOLD_LIMIT
    while not (control / f"{name}.go").exists():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


@idempotent
async def create_order(request: HttpRequest) -> HttpResponse:
    return await _create_order(request)


@idempotent(atomic=False)
async def create_order_lease(request: HttpRequest) -> HttpResponse:
    return await _create_order(request)


@idempotent(atomic=False, lease=2)
async def create_order_short_lease(request: HttpRequest) -> HttpResponse:
    return await _create_order(request)


@idempotent(required=True, wait=0.3)
async def create_order_required(request: HttpRequest) -> HttpResponse:
    return await _create_order(request)


async def create_order_plain(request: HttpRequest) -> HttpResponse:
    """Undecorated: protected only when IdempotencyMiddleware is installed."""
    return await _create_order(request)


@idempotency_exempt
async def create_order_exempt(request: HttpRequest) -> HttpResponse:
    return await _create_order(request)


class OrderView(View):
    @method_decorator(idempotent)
    async def post(self, request: HttpRequest) -> HttpResponse:
        return await _create_order(request)


async def ping(request: HttpRequest) -> JsonResponse:
    """An unrelated endpoint that touches no database: its latency is the event loop's."""
    return JsonResponse({"pid": os.getpid()})
