"""Async DRF views (``adrf``) behind ``IdempotentMixin``; routed only when adrf is installed."""

from __future__ import annotations

from typing import Any

from adrf.views import APIView
from adrf.viewsets import ViewSet
from asgiref.sync import sync_to_async
from django.db import connection
from django.http import HttpResponseBase
from rest_framework import status
from rest_framework.authentication import TokenAuthentication
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request, clone_request
from rest_framework.response import Response

from django_idempotency.contrib.drf import IdempotentMixin
from tests.models import Order
from tests.views import calls


async def _create(request: Request) -> Response:
    calls.increment()
    order = await Order.objects.acreate(item=request.data.get("item", "widget"))
    if request.data.get("raise"):
        raise RuntimeError("handler failed after writing")
    in_transaction = await sync_to_async(lambda: connection.in_atomic_block)()
    return Response(
        {"id": order.pk, "item": order.item, "in_transaction": in_transaction},
        status=status.HTTP_201_CREATED,
    )


class OrderAPIView(IdempotentMixin, APIView):
    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated]

    async def post(self, request: Request) -> HttpResponseBase:
        return await _create(request)


class LowerCaseOverrideAPIView(OrderAPIView):
    """A method override set on DRF's request in lower case, which DRF dispatches on anyway."""

    idempotency_methods = ["POST", "PUT"]

    def initialize_request(self, request: Any, *args: Any, **kwargs: Any) -> Request:
        drf_request: Request = super().initialize_request(request, *args, **kwargs)
        override = request.headers.get("X-HTTP-Method-Override")
        if override:
            drf_request.method = override
        return drf_request

    async def put(self, request: Request) -> HttpResponseBase:
        return await _create(request)


class DelegatingAPIView(OrderAPIView):
    """An async PATCH handler that answers through the POST handler, with a cloned request."""

    idempotency_methods = ["POST", "PATCH"]

    async def post(self, request: Request) -> HttpResponseBase:
        # The claim's record, as a payment handler reads it, on the cloned request too.
        request.idempotency.derive("charge")
        return await _create(request)

    async def patch(self, request: Request) -> HttpResponseBase:
        return await self.post(clone_request(request, "POST"))


class OrderViewSet(IdempotentMixin, ViewSet):
    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated]

    async def create(self, request: Request, *args: Any, **kwargs: Any) -> HttpResponseBase:
        return await _create(request)
