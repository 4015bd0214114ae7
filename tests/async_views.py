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
from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.decorators import method_decorator
from django.views import View

from django_idempotency import idempotency_exempt, idempotent
from tests.drf_views import CONTROL_DIR_ENV, HOLD_LIMIT
from tests.models import Order
from tests.tasks import TASK_DIR_ENV, receipts_seen, record_receipt
from tests.views import calls


def _in_transaction() -> bool:
    return connection.in_atomic_block


@idempotent(atomic=False)
async def checkpointing_order(request: HttpRequest) -> HttpResponse:
    """Lease mode: records its step with ``acheckpoint`` and renews with ``aheartbeat``."""
    info = request.idempotency  # type: ignore[attr-defined]
    if "order" not in info.checkpoints:
        order = await Order.objects.acreate(item="async-checkpointed")
        await info.acheckpoint("order", {"id": order.pk})
    await info.aheartbeat()
    return JsonResponse({"order": info.checkpoints["order"]["id"]}, status=201)


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


# Publishing a Celery task from a protected async view (docs/tasks.rst).


async def _publish(how: str, order_pk: int, label: str) -> None:
    if how == "naive":
        # What works in a sync view; from a coroutine Django refuses it.
        record_receipt.delay_on_commit(order_pk, label)
    elif how == "at_once":
        # Before the commit: what the tests must be able to tell apart.
        await sync_to_async(record_receipt.delay)(order_pk, label)
    elif how == "transaction":
        await sync_to_async(transaction.on_commit)(lambda: record_receipt.delay(order_pk, label))
    else:
        await sync_to_async(record_receipt.delay_on_commit)(order_pk, label)


async def _task_ran(label: str) -> None:
    """Wait (on the event loop) until the worker's ``record_receipt`` for ``label`` has run."""
    directory = Path(os.environ[TASK_DIR_ENV])
    deadline = time.monotonic() + HOLD_LIMIT
    while not receipts_seen(directory, label) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


@idempotent
async def create_order_and_publish(request: HttpRequest) -> HttpResponse:
    """Write an order and publish ``record_receipt`` for it, as the query string says.

    ``publish``: ``on_commit`` (``delay_on_commit`` through ``sync_to_async``,
    the default), ``transaction`` (``transaction.on_commit`` through
    ``sync_to_async``), ``naive`` (``delay_on_commit`` called from the
    coroutine) or ``at_once`` (``delay``, before the commit). ``hold``:
    seconds to go on before answering, or ``task`` to go on until the
    worker ran the task. Body ``raise``: fail after publishing.
    """
    data = json.loads(request.body or b"{}")
    label = request.idempotency.key  # type: ignore[attr-defined]
    order = await Order.objects.acreate(item=data.get("item", "receipt"))
    await _publish(request.GET.get("publish", "on_commit"), order.pk, label)
    hold = request.GET.get("hold")
    if hold == "task":
        await _task_ran(label)
    elif hold:
        await asyncio.sleep(float(hold))
    if data.get("raise"):
        raise RuntimeError("handler failed after publishing")
    payload = {"id": order.pk, "in_transaction": await sync_to_async(_in_transaction)()}
    return JsonResponse(payload, status=201)
