"""The handler and our views around it; the peers' views are in :mod:`.peer_views`.

Every view runs :func:`write_order`: one ``INSERT`` and a small JSON answer.
Plain Django views are compared with ``plain``, DRF ``APIView`` classes
with ``drf``, so each package is measured against the framework it needs.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

from django.db import connection, transaction
from django.http import HttpRequest, JsonResponse
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from benchmarks.bench.models import BenchOrder
from django_idempotency import idempotent
from django_idempotency.contrib.drf import IdempotentMixin

#: The client's nonce for each request, stored with the row so that a storm
#: can tell which of many duplicates actually ran the handler.
NONCE_HEADER = "X-Bench-Nonce"


def write_order(request: HttpRequest | Request, variant: str) -> tuple[dict, int]:
    """The handler every variant shares: one row, and its id in the answer.

    ``?work_ms=N`` stands in for N ms of the handler's own work (a call to a
    payment provider), so that storms race duplicates against an original
    that is still running. It is never used to wait for another request.
    """
    work_ms = int(request.GET.get("work_ms", "0"))
    if work_ms:
        time.sleep(work_ms / 1000)
    order = BenchOrder.objects.create(
        variant=variant,
        key=request.headers.get("Idempotency-Key", ""),
        nonce=request.headers.get(NONCE_HEADER, ""),
    )
    return {"id": order.pk, "variant": variant}, 201


async def write_order_async(request: HttpRequest, variant: str) -> tuple[dict, int]:
    """:func:`write_order` for async views: ``acreate`` instead of ``create``."""
    work_ms = int(request.GET.get("work_ms", "0"))
    if work_ms:
        await asyncio.sleep(work_ms / 1000)
    order = await BenchOrder.objects.acreate(
        variant=variant,
        key=request.headers.get("Idempotency-Key", ""),
        nonce=request.headers.get(NONCE_HEADER, ""),
    )
    return {"id": order.pk, "variant": variant}, 201


def plain(request: HttpRequest) -> JsonResponse:
    return _json(write_order(request, "plain"))


@idempotent
def ours(request: HttpRequest) -> JsonResponse:
    return _json(write_order(request, "ours"))


@idempotent(atomic=False)
def ours_lease(request: HttpRequest) -> JsonResponse:
    return _json(write_order(request, "ours-lease"))


async def plain_async(request: HttpRequest) -> JsonResponse:
    return _json(await write_order_async(request, "plain-async"))


@idempotent
async def ours_async(request: HttpRequest) -> JsonResponse:
    return _json(await write_order_async(request, "ours-async"))


def statements_alone(request: HttpRequest) -> JsonResponse:
    """A protected first request's SQL on PostgreSQL, through Django, with none of our Python.

    The replay lookup in autocommit, then in ``transaction.atomic``: the
    claim of a new key, the handler, the store of its response: the
    statements ``ours`` sends for a new key, with the same SQL, through
    Django's cursors. Its time over ``plain`` is what the contract costs any
    Django implementation on this database; ``ours`` over it is the
    package's own Python. No key check, fingerprint or replay: it is a
    floor, not a protection.
    """
    from django_idempotency import clock
    from django_idempotency.backends import postgresql

    key = request.META["HTTP_IDEMPOTENCY_KEY"]
    lookup, claim, complete = _statements()
    with connection.cursor() as cursor:
        cursor.execute(lookup, ["anonymous", key])
        assert cursor.fetchone() is None, "statements_alone serves new keys only"
    with transaction.atomic():
        lock_timeout = postgresql.lock_timeout(5.0)
        # Its times are the database's clock plus these durations.
        ttl = timedelta(hours=24)
        expires_in = clock.seconds(connection, ttl)
        new = ["anonymous", key, "f" * 64, "in_progress", "", expires_in]
        with connection.cursor() as cursor:
            # Atomic mode: no lease, and nothing retained past one.
            cursor.execute(claim, [lock_timeout, *new, None, None])
            record_id = cursor.fetchone()[0]
        response = _json(write_order(request, "alone"))
        stored = ["completed", response.status_code, _HEADERS, response.content]
        grace = clock.seconds(connection, -ttl / 100)
        with connection.cursor() as cursor:
            cursor.execute(complete, [*stored, grace, expires_in, record_id])
    return response


_HEADERS = '[["Content-Type", "application/json"]]'


def _statements() -> tuple[str, str, str]:
    """The package's own SQL for the lookup, the claim of a new key and the store."""
    from django_idempotency.backends import base, postgresql

    return (
        base.cached_sql(connection, "read", base.record_select_sql),
        base.cached_sql(connection, "insert", postgresql.insert_sql),
        base.cached_sql(
            connection,
            ("complete", True, False),
            lambda c: base.complete_sql(c, base.OWN_TRANSACTION, with_grace=True),
        ),
    )


def _json(result: tuple[dict, int]) -> JsonResponse:
    data, status = result
    return JsonResponse(data, status=status)


class BenchAPIView(APIView):
    """An ``APIView`` independent of the host project's DRF settings.

    The test suite mounts these views under its own settings, which require
    authentication; the bench measures the packages, not an auth backend.
    """

    authentication_classes: list = []
    permission_classes = [AllowAny]
    variant = "drf"

    def post(self, request: Request) -> Response:
        data, status = write_order(request, self.variant)
        return Response(data, status=status)


class OursMixinView(IdempotentMixin, BenchAPIView):
    variant = "ours-mixin"
