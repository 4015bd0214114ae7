"""The views the Galera tests race across nodes, and their URLs (``ROOT_URLCONF``).

Each run of a handler appends ``<key> <node>`` to the file named by
``IDEMPOTENCY_GALERA_RUNS``, so a test sees a run that rolled back as well
as one that committed; the committed effect is an ``Order`` named after
the key. Besides the plain decorator and the middleware, each adapter has
a view here: DRF's mixin and ``@api_view``, an ``async def`` view, a view
calling an ``idempotent_function``, a webhook receiver and a browser form.
"""

from __future__ import annotations

import json
import os
import threading
import time
import zlib
from typing import Any

from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import idempotency_exempt, idempotent, idempotent_function, webhooks
from django_idempotency.drf import IdempotentMixin
from django_idempotency.exceptions import CallInFlight
from tests.galera import FORM_FIELD, NODE_ENV, RUNS_ENV, WEBHOOK_SECRET
from tests.models import Order

#: How long the slow handler takes.
SLOW_SECONDS = 1.0


def _ran(key: str) -> None:
    """Count one run of a handler for ``key``, whether its transaction commits or not."""
    # One write() of one short line on an O_APPEND file: lines never interleave.
    fd = os.open(os.environ[RUNS_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, f"{key} {os.environ[NODE_ENV]}\n".encode())
    finally:
        os.close(fd)


def _effect(request: HttpRequest, *, seconds: float = 0.0) -> JsonResponse:
    return JsonResponse(_created(request, request.headers["Idempotency-Key"], seconds), status=201)


def _created(request: HttpRequest, key: str, seconds: float = 0.0) -> dict[str, Any]:
    """The handler's work for ``key``: the run counted, the ``Order`` written, what it answers."""
    node = os.environ[NODE_ENV]
    _ran(key)
    order = Order.objects.create(item=key)
    rows = int(request.GET.get("ballast", 0))
    if rows:
        # A write set the other nodes are slow to apply: the ballast table
        # has no primary key, so applying each updated row scans the table
        # there, while this node updated them all in one scan.
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE galera_ballast SET v = v + 1 WHERE part = %s",
                [zlib.crc32(key.encode()) % 20],
            )
    if seconds:
        time.sleep(seconds)  # the handler's own work, still inside its transaction
    return {"id": order.pk, "node": node}


@idempotent
def atomic_effect(request: HttpRequest) -> JsonResponse:
    return _effect(request)


@idempotent(atomic=False)
def lease_effect(request: HttpRequest) -> JsonResponse:
    return _effect(request)


@idempotent
def slow_effect(request: HttpRequest) -> JsonResponse:
    return _effect(request, seconds=SLOW_SECONDS)


def middleware_effect(request: HttpRequest) -> JsonResponse:
    """Protected by ``IdempotencyMiddleware`` alone, in atomic mode."""
    return _effect(request)


class DrfMixinEffect(IdempotentMixin, APIView):
    def post(self, request: Request) -> Response:
        return Response(_created(request, request.headers["Idempotency-Key"]), status=201)


@api_view(["POST"])
@idempotent
def drf_function_effect(request: Request) -> Response:
    return Response(_created(request, request.headers["Idempotency-Key"]), status=201)


@idempotent
async def async_effect(request: HttpRequest) -> JsonResponse:
    key = request.headers["Idempotency-Key"]
    _ran(key)
    # The async ORM runs in the thread that holds the claim's transaction.
    order = await Order.objects.acreate(item=key)
    return JsonResponse({"id": order.pk, "node": os.environ[NODE_ENV]}, status=201)


#: The orders this thread's function bodies created, to tell a fresh value from a stored one.
_placed = threading.local()


@idempotent_function(key=lambda key, step: f"{key}:{step}")
def place_order(key: str, step: str) -> dict[str, Any]:
    """A step of the request with ``key``, once per (key, step): its ``Order`` is named ``key``."""
    _ran(key)
    order = Order.objects.create(item=key)
    getattr(_placed, "ids", set()).add(order.pk)
    return {"id": order.pk, "node": os.environ[NODE_ENV]}


@idempotency_exempt
def function_effect(request: HttpRequest) -> JsonResponse:
    """Not a protected view: it calls a function protected by a key derived from the request's."""
    _placed.ids = set()
    try:
        value = place_order(request.headers["Idempotency-Key"], "order")
    except CallInFlight as exc:
        return JsonResponse({"detail": str(exc)}, status=409, headers=exc.headers())
    response = JsonResponse(value, status=201)
    if value["id"] not in _placed.ids:
        response["Idempotent-Replayed"] = "true"  # as a protected view says it
    return response


@idempotent
def function_in_view_effect(request: HttpRequest) -> JsonResponse:
    """A protected view calling a protected function: the function's claim is in the view's."""
    return JsonResponse(place_order(request.headers["Idempotency-Key"], "order"), status=201)


def function_in_middleware_effect(request: HttpRequest) -> JsonResponse:
    """As ``function_in_view_effect``, protected by ``IdempotencyMiddleware`` alone."""
    return JsonResponse(place_order(request.headers["Idempotency-Key"], "order"), status=201)


@csrf_exempt
@webhooks.stripe_signature(WEBHOOK_SECRET)
@idempotent(**webhooks.STRIPE)
def webhook_effect(request: HttpRequest) -> JsonResponse:
    """A Stripe event, keyed by its id; only a 2xx completes it."""
    return JsonResponse(_created(request, json.loads(request.body)["id"]), status=201)


@idempotent
def form_effect(request: HttpRequest) -> JsonResponse:
    """A browser's form POST: the key in the form's hidden field, no header."""
    return JsonResponse(_created(request, request.POST[FORM_FIELD]), status=201)


def ping(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"node": os.environ[NODE_ENV]})


urlpatterns = [
    path("atomic/", atomic_effect),
    path("lease/", lease_effect),
    path("slow/", slow_effect),
    path("middleware/", middleware_effect),
    path("drf-mixin/", DrfMixinEffect.as_view()),
    path("drf-function/", drf_function_effect),
    path("async/", async_effect),
    path("function/", function_effect),
    path("function-in-view/", function_in_view_effect),
    path("function-in-middleware/", function_in_middleware_effect),
    path("webhook/", webhook_effect),
    path("form/", form_effect),
    path("ping/", ping),
]
