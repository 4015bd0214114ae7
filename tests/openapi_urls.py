"""A URLconf for the OpenAPI tests: protected and unprotected DRF operations side by side."""

from __future__ import annotations

from django.urls import path
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import generics, viewsets
from rest_framework.decorators import api_view, permission_classes
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import SimpleRouter

from django_idempotency import idempotent
from django_idempotency.drf import IdempotentMixin
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


router = SimpleRouter()
router.register("orders", drf_views.OrderViewSet, basename="orders")
router.register("required-orders", drf_views.RequiredOrderViewSet, basename="required")
router.register("options-orders", drf_views.OptionsOrderViewSet, basename="options")
router.register("put-orders", drf_views.PutOrderViewSet, basename="put")
router.register("unprotected-orders", UnprotectedOrderViewSet, basename="unprotected")
router.register("undocumented-orders", UndocumentedOrderViewSet, basename="undocumented")
router.register("inherited-doc-orders", InheritedDocOrderViewSet, basename="inherited-doc")

urlpatterns = [
    path("generic/", drf_views.OrderCreateView.as_view()),
    path("documented/", documented_create),
    path("unprotected-function/", unprotected_function),
    path("lease-function/", lease_function),
    path("undocumented-create/", UndocumentedCreateView.as_view()),
    path("documented-action/", DocumentedActionView.as_view()),
    *router.urls,
]
