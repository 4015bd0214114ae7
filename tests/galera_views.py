"""The views the Galera tests race across nodes, and their URLs (``ROOT_URLCONF``).

Each run of a handler appends ``<key> <node>`` to the file named by
``IDEMPOTENCY_GALERA_RUNS``, so a test sees a run that rolled back as well
as one that committed; the committed effect is an ``Order`` named after
the key.
"""

from __future__ import annotations

import os
import time
import zlib

from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.urls import path

from django_idempotency import idempotent
from tests.galera import NODE_ENV, RUNS_ENV
from tests.models import Order

#: How long the slow handler takes.
SLOW_SECONDS = 1.0


def _effect(request: HttpRequest, *, seconds: float = 0.0) -> JsonResponse:
    key = request.headers["Idempotency-Key"]
    node = os.environ[NODE_ENV]
    # One write() of one short line on an O_APPEND file: lines never interleave.
    fd = os.open(os.environ[RUNS_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, f"{key} {node}\n".encode())
    finally:
        os.close(fd)
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
    return JsonResponse({"id": order.pk, "node": node}, status=201)


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


def ping(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"node": os.environ[NODE_ENV]})


urlpatterns = [
    path("atomic/", atomic_effect),
    path("lease/", lease_effect),
    path("slow/", slow_effect),
    path("middleware/", middleware_effect),
    path("ping/", ping),
]
