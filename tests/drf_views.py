"""DRF views the suite drives through ``IdempotentMixin``; each writes Orders as its effect."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from django.db import connection, transaction
from django.http import HttpRequest, HttpResponseBase, StreamingHttpResponse
from django.template import engines
from django.template.response import SimpleTemplateResponse
from django.utils.decorators import method_decorator
from rest_framework import generics, serializers, status, viewsets
from rest_framework.authentication import TokenAuthentication
from rest_framework.decorators import action, api_view, authentication_classes, permission_classes
from rest_framework.permissions import AllowAny, BasePermission, IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import idempotency_exempt, idempotent
from django_idempotency.contrib.drf import IdempotentMixin
from tests.models import Order
from tests.views import calls

#: Where the server-side hold views report their PID and wait for the go-ahead.
CONTROL_DIR_ENV = "IDEMPOTENCY_TEST_CONTROL_DIR"
#: How long a hold view waits for the go-ahead before giving up on its own.
HOLD_LIMIT = 20.0


class OrderSerializer(serializers.ModelSerializer):
    class Meta:
        model = Order
        fields = ["id", "item", "quantity"]


def _respond(request: Request, data: dict[str, Any], created: Order) -> HttpResponseBase:
    """Answer as the query string asks, so one view covers every row of the contract.

    ``hold`` keeps the handler (and in atomic mode its transaction) busy
    for that many seconds, ``raise`` fails after the effect is written,
    ``status`` picks the status code, ``stream`` answers with a streaming
    body, ``size`` pads the body and ``unrenderable`` adds a value JSON
    cannot render.
    """
    params = request.query_params
    if params.get("hold"):
        time.sleep(float(params["hold"]))
    if params.get("raise"):
        raise RuntimeError("handler failed after writing")
    if params.get("stream"):
        return StreamingHttpResponse(iter([b"chunk-1,", b"chunk-2"]), content_type="text/csv")
    if params.get("size"):
        data = {**data, "padding": "x" * int(params["size"])}
    if params.get("unrenderable"):
        data = {**data, "at": object()}  # JSONRenderer raises TypeError when DRF renders
    code = int(params.get("status", status.HTTP_201_CREATED))
    response = Response(data, status=code)
    response["Location"] = f"/drf/orders/{created.pk}/"
    response["X-Request-Secret"] = "not-in-the-allowlist"
    response.set_cookie("sessionid", "handler-cookie")
    return response


class NotBlocked(BasePermission):
    """Denies (403) authenticated users whose username starts with ``blocked``."""

    def has_permission(self, request: Request, view: APIView) -> bool:
        return not request.user.username.startswith("blocked")


class OrderViewSet(IdempotentMixin, viewsets.ModelViewSet):
    """A ModelViewSet behind token authentication, as most APIs deploy it."""

    queryset = Order.objects.order_by("pk")
    serializer_class = OrderSerializer
    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated, NotBlocked]

    def create(self, request: Request, *args: Any, **kwargs: Any) -> HttpResponseBase:
        calls.increment()
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        order = serializer.save()
        return _respond(request, serializer.data, order)

    def perform_update(self, serializer: serializers.BaseSerializer) -> None:
        calls.increment()
        serializer.save()
        # An update is an effect too: count it as one more Order row.
        Order.objects.create(item=f"update-of-{serializer.instance.pk}")

    @action(detail=True, methods=["post"])
    def ship(self, request: Request, pk: str | None = None) -> Response:
        calls.increment()
        order = self.get_object()
        shipment = Order.objects.create(item=f"shipment-of-{order.pk}")
        return Response({"shipment": shipment.pk}, status=status.HTTP_201_CREATED)

    @action(detail=False, methods=["get"])
    def summary(self, request: Request) -> Response:
        calls.increment()
        return Response({"count": Order.objects.count()})


class LeaseOrderViewSet(OrderViewSet):
    """The same API in lease mode, for handlers with effects outside the database."""

    idempotency_atomic = False

    @action(detail=False, methods=["post"])
    def info(self, request: Request) -> Response:
        calls.increment()
        return Response(_info(request))


class PutOrderViewSet(OrderViewSet):
    """Protects PUT as well, so ``update`` runs under a key."""

    idempotency_methods = ("POST", "PUT", "PATCH")


class RequiredOrderViewSet(OrderViewSet):
    idempotency_required = True


def tenant_scope(request: HttpRequest) -> str:
    """Scope by a tenant header, as a multi-tenant API would."""
    return "tenant:" + request.headers.get("X-Tenant", "none")


def body_only_fingerprint(request: HttpRequest) -> str:
    http_request = getattr(request, "_request", request)
    return http_request.body.decode()


class OptionsOrderViewSet(OrderViewSet):
    """Every option given as a class attribute, callables as plain functions."""

    authentication_classes: list[type] = []
    permission_classes = [AllowAny]
    idempotency_scope = tenant_scope
    idempotency_fingerprint = body_only_fingerprint
    idempotency_ttl = 60
    idempotency_wait = 0
    idempotency_lease = 30


class DottedOptionsOrderViewSet(OrderViewSet):
    authentication_classes: list[type] = []
    permission_classes = [AllowAny]
    idempotency_scope = "tests.drf_views.tenant_scope"


class ReadsDataPermission(BasePermission):
    """A permission that looks at the body, as object-level rules often do."""

    def has_permission(self, request: Request, view: APIView) -> bool:
        return request.data.get("item") != "forbidden"


class ReadsDataOrderViewSet(OrderViewSet):
    permission_classes = [ReadsDataPermission]
    authentication_classes: list[type] = []


class OrderAPIView(IdempotentMixin, APIView):
    permission_classes = [AllowAny]
    authentication_classes: list[type] = []

    def post(self, request: Request) -> Response:
        calls.increment()
        order = Order.objects.create(item=request.data.get("item", "widget"))
        return Response({"id": order.pk, "via": "APIView"}, status=status.HTTP_201_CREATED)

    def put(self, request: Request) -> Response:
        calls.increment()
        order = Order.objects.create(item="put")
        return Response({"id": order.pk}, status=status.HTTP_200_OK)


class OrderCreateView(IdempotentMixin, generics.CreateAPIView):
    """A GenericAPIView: DRF's CreateModelMixin does the work."""

    permission_classes = [AllowAny]
    authentication_classes: list[type] = []
    serializer_class = OrderSerializer

    def perform_create(self, serializer: serializers.BaseSerializer) -> None:
        calls.increment()
        serializer.save()


class PlainOrderViewSet(IdempotentMixin, viewsets.ViewSet):
    permission_classes = [AllowAny]
    authentication_classes: list[type] = []

    def create(self, request: Request) -> Response:
        calls.increment()
        order = Order.objects.create(item=request.data.get("item", "widget"))
        return Response({"id": order.pk, "via": "ViewSet"}, status=status.HTTP_201_CREATED)


class TemplateOrderView(IdempotentMixin, APIView):
    """Returns a Django template response, which DRF passes through unrendered."""

    permission_classes = [AllowAny]
    authentication_classes: list[type] = []

    def post(self, request: Request) -> HttpResponseBase:
        calls.increment()
        order = Order.objects.create(item="template")
        template = engines["django"].from_string("order {{ pk }}")
        return SimpleTemplateResponse(template, {"pk": order.pk}, status=201)


@api_view(["POST"])
@permission_classes([AllowAny])
@idempotent(atomic=False)
def api_create_order_lease(request: Request) -> Response:
    calls.increment()
    order = Order.objects.create(item=request.data.get("item", "widget"))
    return Response({"id": order.pk, "item": order.item}, status=status.HTTP_201_CREATED)


@transaction.non_atomic_requests
@api_view(["POST"])
@permission_classes([AllowAny])
@idempotent(atomic=False)
def api_create_order_lease_non_atomic(request: Request) -> Response:
    """The stacking that keeps an ``@api_view`` lease view out of ATOMIC_REQUESTS."""
    calls.increment()
    order = Order.objects.create(item=request.data.get("item", "widget"))
    return Response({"id": order.pk, "item": order.item}, status=status.HTTP_201_CREATED)


def _info(request: Request) -> dict[str, Any]:
    info = request.idempotency  # type: ignore[attr-defined]
    return {
        "key": info.key,
        "scope": info.scope,
        "fingerprint": info.fingerprint,
        "payment": info.derive("payment"),
        "in_atomic_block": connection.in_atomic_block,
    }


class HoldView(IdempotentMixin, APIView):
    """Writes its effect, reports its PID, then waits until the test says go.

    The gunicorn tests kill the worker while it waits, to prove what a crash
    in the middle of a handler leaves behind. The files live in the directory
    named by ``IDEMPOTENCY_TEST_CONTROL_DIR``: ``<key>.pid`` is written, and
    ``<key>.go`` is waited for.
    """

    permission_classes = [AllowAny]
    authentication_classes: list[type] = []

    def post(self, request: Request) -> Response:
        calls.increment()
        order = Order.objects.create(item=request.data.get("item", "held"))
        info = _info(request)
        control = Path(os.environ[CONTROL_DIR_ENV])
        name = info["key"]
        report = {"pid": os.getpid(), **info}
        pid_file = control / f"{name}.pid"
        (control / f"{name}.tmp").write_text(json.dumps(report))
        (control / f"{name}.tmp").replace(pid_file)
        deadline = time.monotonic() + HOLD_LIMIT
        while not (control / f"{name}.go").exists():
            if time.monotonic() > deadline:
                return Response({"detail": "never released"}, status=503)
            time.sleep(0.05)
        return Response({"id": order.pk, **info}, status=status.HTTP_201_CREATED)


class LeaseHoldView(HoldView):
    idempotency_atomic = False
    idempotency_lease = 2


class LongLeaseHoldView(HoldView):
    """Lease mode with the default lease (5 minutes): live for as long as a test holds it."""

    idempotency_atomic = False


# DRF views that protect nothing themselves: what IdempotencyMiddleware
# protects through the mixin's path, after DRF's token authentication.


class UnprotectedOrderAPIView(APIView):
    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated]

    def post(self, request: Request) -> Response:
        calls.increment()
        order = Order.objects.create(item=request.data.get("item", "widget"))
        body = {"id": order.pk, "user": request.user.username, "via": "APIView"}
        return Response(body, status=status.HTTP_201_CREATED)


class UnprotectedOrderViewSet(viewsets.ViewSet):
    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated]

    def create(self, request: Request) -> Response:
        calls.increment()
        order = Order.objects.create(item=request.data.get("item", "widget"))
        body = {"id": order.pk, "user": request.user.username, "via": "ViewSet"}
        return Response(body, status=status.HTTP_201_CREATED)


@api_view(["POST"])
@authentication_classes([TokenAuthentication])
@permission_classes([IsAuthenticated])
def unprotected_api_view(request: Request) -> Response:
    calls.increment()
    order = Order.objects.create(item=request.data.get("item", "widget"))
    body = {"id": order.pk, "user": request.user.username, "via": "api_view"}
    return Response(body, status=status.HTTP_201_CREATED)


@method_decorator(idempotency_exempt, name="create")
class ExemptCreateViewSet(UnprotectedOrderViewSet):
    """Its ``create`` action left out of the middleware, as a ViewSet marks an action."""


class DecoratedCreateView(generics.CreateAPIView):
    """``create`` decorated, reached through the ``post`` DRF's generic view hands on."""

    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated]

    @method_decorator(idempotent(scope=lambda request: "decorated-create"))
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        calls.increment()
        order = Order.objects.create(item=request.data.get("item", "widget"))
        body = {"id": order.pk, "user": request.user.username, "via": "create"}
        return Response(body, status=status.HTTP_201_CREATED)
