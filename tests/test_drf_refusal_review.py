"""DRF views the middleware refuses as decorated: views no decorator changes are not refused."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.conf import settings
from django.test import Client, override_settings
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.generators import SchemaGenerator
from rest_framework.response import Response
from rest_framework.views import APIView

from tests.clients import post
from tests.models import Order

pytestmark = pytest.mark.django_db(transaction=True)
MIDDLEWARE = "django_idempotency.middleware.IdempotencyMiddleware"


class CreatesOrder(APIView):
    """A DRF view that protects nothing itself."""

    authentication_classes: list[Any] = []
    permission_classes: list[Any] = []

    def post(self, request: Any) -> Response:
        order = Order.objects.create(item=request.data.get("item", "widget"))
        return Response({"id": order.pk}, status=201)


urlpatterns = [
    # DRF's as_view() is csrf_exempt already: the decorator changes nothing.
    path("csrf-exempt-again/", csrf_exempt(CreatesOrder.as_view())),
]


@pytest.fixture
def installed() -> Any:
    with override_settings(MIDDLEWARE=[*settings.MIDDLEWARE, MIDDLEWARE]):
        yield


@pytest.mark.urls("tests.test_drf_refusal_review")
@pytest.mark.usefixtures("installed")
def test_csrf_exempt_around_a_drf_view_is_not_refused() -> None:
    client = Client()

    first = post(client, "/csrf-exempt-again/", "k1")
    again = post(client, "/csrf-exempt-again/", "k1")

    assert first.status_code == 201, first.content[:300]
    assert again.content == first.content
    assert again["Idempotent-Replayed"] == "true"
    assert Order.objects.count() == 1


@pytest.mark.usefixtures("installed")
@override_settings(ROOT_URLCONF="tests.test_drf_refusal_review")
def test_the_schema_of_a_project_with_a_refused_view_is_generated() -> None:
    # The refusal is for requests with a key; documenting the project must not raise.
    schema = SchemaGenerator(urlconf="tests.test_drf_refusal_review").get_schema(
        request=None, public=True
    )

    assert "/csrf-exempt-again/" in json.loads(json.dumps(schema, default=str))["paths"]
