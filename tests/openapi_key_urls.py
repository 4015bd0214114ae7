"""A URLconf for the OpenAPI tests: a view whose key comes from the request (``key=``)."""

from __future__ import annotations

from django.urls import path
from drf_spectacular.utils import extend_schema
from rest_framework.decorators import api_view, permission_classes
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response

from django_idempotency import idempotent
from tests import drf_views


@extend_schema(request=drf_views.OrderSerializer, responses={201: drf_views.OrderSerializer})
@api_view(["POST"])
@permission_classes([AllowAny])
@idempotent(key=lambda request: request.headers.get("X-Delivery-Id"))
def delivery(request: Request) -> Response:
    return Response({}, status=201)


urlpatterns = [path("deliveries/", delivery)]
