"""A URLconf for the OpenAPI tests: protected and unprotected DRF operations side by side.

Every way the package protects a DRF operation has a view here, so that the
tests can compare what the schema documents with what the run time does, with
and without ``IdempotencyMiddleware``.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.urls import include, path
from django.utils.decorators import method_decorator
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import generics, serializers, viewsets
from rest_framework.decorators import api_view, permission_classes
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import SimpleRouter
from rest_framework.views import APIView

from django_idempotency import idempotency_exempt, idempotent
from django_idempotency.contrib.drf import IdempotentMixin
from tests import drf_views
from tests.models import Order


class UnprotectedOrderViewSet(viewsets.ModelViewSet):
    queryset = Order.objects.order_by("pk")
    serializer_class = drf_views.OrderSerializer


class UndocumentedOrderViewSet(IdempotentMixin, viewsets.ModelViewSet):
    queryset = Order.objects.order_by("pk")
    serializer_class = drf_views.OrderSerializer
    permission_classes = [AllowAny]


class DocumentedOrderViewSet(viewsets.ModelViewSet):
    """Orders, as the project documents them."""

    queryset = Order.objects.order_by("pk")
    serializer_class = drf_views.OrderSerializer
    permission_classes = [AllowAny]


class InheritedDocOrderViewSet(IdempotentMixin, DocumentedOrderViewSet):
    pass


class UndocumentedCreateView(IdempotentMixin, generics.CreateAPIView):
    serializer_class = drf_views.OrderSerializer
    permission_classes = [AllowAny]

    def post(self, request: Request, *args: object, **kwargs: object) -> Response:
        return super().post(request, *args, **kwargs)


class DocumentedActionView(IdempotentMixin, generics.CreateAPIView):
    serializer_class = drf_views.OrderSerializer
    permission_classes = [AllowAny]

    def post(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Create an order, as the handler documents it."""
        return super().post(request, *args, **kwargs)


@extend_schema(
    request=drf_views.OrderSerializer,
    responses={
        201: drf_views.OrderSerializer,
        400: OpenApiResponse(description="The item is not for sale."),
    },
)
@api_view(["POST"])
@permission_classes([AllowAny])
@idempotent(required=True, ttl=600)
def documented_create(request: Request) -> Response:
    return Response({}, status=201)


@extend_schema(request=drf_views.OrderSerializer, responses={200: drf_views.OrderSerializer})
@api_view(["GET", "POST"])
@permission_classes([AllowAny])
def unprotected_function(request: Request) -> Response:
    return Response({})


@extend_schema(request=drf_views.OrderSerializer, responses={201: drf_views.OrderSerializer})
@api_view(["POST"])
@permission_classes([AllowAny])
@idempotent(atomic=False)
def lease_function(request: Request) -> Response:
    return Response({}, status=201)


class OpenOrderViewSet(viewsets.ModelViewSet):
    """Orders, open to anyone: the base of the views below."""

    queryset = Order.objects.order_by("pk")
    serializer_class = drf_views.OrderSerializer
    permission_classes = [AllowAny]


@method_decorator(idempotent, name="create")
class ActionDecoratedOrderViewSet(OpenOrderViewSet):
    """``@idempotent`` on one action: POST is protected, PATCH is not."""


@method_decorator(idempotent(ttl=120), name="dispatch")
class DispatchDecoratedOrderViewSet(OpenOrderViewSet):
    """``@idempotent`` on ``dispatch``: every method in ``METHODS``."""


@method_decorator(idempotent(wait=0), name="update")
class UpdateDecoratedOrderViewSet(OpenOrderViewSet):
    """``@idempotent`` on ``update``, which DRF's ``partial_update`` (PATCH) calls."""


class PropertyOrderViewSet(IdempotentMixin, OpenOrderViewSet):
    """An option given as a property, read per request."""

    @property
    def idempotency_required(self) -> bool:
        return self.action == "create"


@method_decorator(idempotent(ttl=300), name="dispatch")
class LayeredOrderViewSet(IdempotentMixin, OpenOrderViewSet):
    """Two layers: ``dispatch`` claims a sent key, the mixin refuses a request without one."""

    idempotency_required = True


class ItemSerializer(serializers.Serializer):
    item = serializers.CharField()


class CreatingView(APIView):
    """A plain APIView that writes an Order on POST, PUT and PATCH."""

    permission_classes = [AllowAny]

    def _create(self, request: Request) -> Response:
        order = Order.objects.create(item=str(request.data.get("item", "")))
        return Response({"id": order.pk}, status=201)

    @extend_schema(request=ItemSerializer, responses={201: ItemSerializer})
    def post(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return self._create(request)

    @extend_schema(request=ItemSerializer, responses={201: ItemSerializer})
    def put(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return self._create(request)

    @extend_schema(request=ItemSerializer, responses={201: ItemSerializer})
    def patch(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return self._create(request)


class MethodDecoratedView(CreatingView):
    """``@idempotent`` on an APIView's method, through ``method_decorator``."""

    @extend_schema(request=ItemSerializer, responses={201: ItemSerializer})
    @method_decorator(idempotent(required=True))
    def post(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return self._create(request)


@method_decorator(idempotent(methods=("POST", "PUT")), name="dispatch")
class DispatchDecoratedView(CreatingView):
    """``@idempotent`` on an APIView's ``dispatch``, for POST and PUT only."""


@method_decorator(idempotent(atomic=False, ttl=45), name="create")
class GenericCreateView(generics.CreateAPIView):
    """``@idempotent`` on ``create``, which a generic view's ``post`` calls."""

    serializer_class = drf_views.OrderSerializer
    permission_classes = [AllowAny]


class MixinCreateView(IdempotentMixin, generics.CreateAPIView):
    serializer_class = drf_views.OrderSerializer
    permission_classes = [AllowAny]


@method_decorator(idempotency_exempt, name="dispatch")
class ExemptDispatchView(CreatingView):
    """Left out of ``IdempotencyMiddleware`` through its ``dispatch``."""


# Under IdempotencyMiddleware, URLs it leaves alone.
exempt_include = [path("orders/", CreatingView.as_view())]
admin_include = [path("orders/", CreatingView.as_view())]

router = SimpleRouter()
router.register("orders", drf_views.OrderViewSet, basename="orders")
router.register("required-orders", drf_views.RequiredOrderViewSet, basename="required")
router.register("options-orders", drf_views.OptionsOrderViewSet, basename="options")
router.register("put-orders", drf_views.PutOrderViewSet, basename="put")
router.register("unprotected-orders", UnprotectedOrderViewSet, basename="unprotected")
router.register("undocumented-orders", UndocumentedOrderViewSet, basename="undocumented")
router.register("inherited-doc-orders", InheritedDocOrderViewSet, basename="inherited-doc")
router.register("action-orders", ActionDecoratedOrderViewSet, basename="action")
router.register("dispatch-orders", DispatchDecoratedOrderViewSet, basename="dispatch")
router.register("update-orders", UpdateDecoratedOrderViewSet, basename="update")
router.register("property-orders", PropertyOrderViewSet, basename="property")
router.register("layered-orders", LayeredOrderViewSet, basename="layered")

urlpatterns = [
    path("generic/", drf_views.OrderCreateView.as_view()),
    path("documented/", documented_create),
    path("unprotected-function/", unprotected_function),
    path("lease-function/", lease_function),
    path("undocumented-create/", UndocumentedCreateView.as_view()),
    path("documented-action/", DocumentedActionView.as_view()),
    path("creating/", CreatingView.as_view()),
    path("method-decorated/", MethodDecoratedView.as_view()),
    path("dispatch-decorated/", DispatchDecoratedView.as_view()),
    path("generic-create/", GenericCreateView.as_view()),
    path(
        "as-view-options/",
        MixinCreateView.as_view(idempotency_ttl=30, idempotency_required=True),
    ),
    path("exempt-view/", idempotency_exempt(CreatingView.as_view())),
    path("exempt-dispatch/", ExemptDispatchView.as_view()),
    path("exempt-include/", idempotency_exempt(include(exempt_include))),
    path("admin-namespace/", include((admin_include, "admin"))),
    path("non-atomic/", transaction.non_atomic_requests(CreatingView.as_view())),
    *router.urls,
]
