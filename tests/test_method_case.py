"""The method a view dispatches on is protected whatever its case (``core.protected_method``).

A project's middleware may set ``request.method`` in lower case (a method
override read from a form field, say). Django's views and DRF's still run
the ``post`` handler, so the key must be claimed as for ``POST``, under
every way of protecting a view, sync and async.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.test import AsyncClient, Client, RequestFactory
from rest_framework.test import APIClient

from django_idempotency.adapters import reach
from django_idempotency.core import protected_method
from django_idempotency.models import IdempotencyKey
from tests.clients import drf_post, post, token_client
from tests.models import Order
from tests.views import calls

LOWER_CASE = "tests.middleware_views.LowerCaseMethodMiddleware"
MIDDLEWARE = "django_idempotency.middleware.IdempotencyMiddleware"


ALL = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def reached(request: Any) -> tuple[Any, Any]:
    http_request, own, _ = reach(request)
    return http_request, own


def test_the_method_is_given_in_capitals_whatever_its_case():
    request = RequestFactory().post("/")
    assert protected_method(*reached(request), ALL) == "POST"

    request.method = "post"
    assert protected_method(*reached(request), ALL) == "POST"

    request.method = "Put"
    assert protected_method(*reached(request), ALL) == "PUT"


def test_a_method_not_protected_or_none_is_not_protected():
    request = RequestFactory().get("/")
    assert protected_method(*reached(request), ALL) is None

    request.method = None
    assert protected_method(*reached(request), ALL) is None

    request.method = "post"
    assert protected_method(*reached(request), frozenset({"PUT"})) is None


def test_nothing_is_protected_when_disabled(settings):
    settings.IDEMPOTENCY = {"ENABLED": False}
    request = RequestFactory().post("/")

    assert protected_method(*reached(request), ALL) is None

    settings.IDEMPOTENCY = {"ENABLED": True}
    assert protected_method(*reached(request), ALL) == "POST"


def test_an_override_on_a_frameworks_request_comes_first_in_capitals():
    from rest_framework.request import Request

    drf_request = Request(RequestFactory().post("/"))
    drf_request.method = "put"

    assert protected_method(*reached(drf_request), ALL) == "PUT"


@pytest.fixture
def lower_case(settings: Any) -> None:
    settings.MIDDLEWARE = [LOWER_CASE, *settings.MIDDLEWARE]


@pytest.fixture(params=["wsgi", "asgi"])
def any_client(request: pytest.FixtureRequest) -> Client | AsyncClient:
    return Client() if request.param == "wsgi" else AsyncClient()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("lower_case")
class LowerCaseMethodTests:
    @pytest.mark.parametrize(
        "url",
        [
            "/orders/",  # @idempotent on a function
            "/orders/class-based/",  # @idempotent on a View's post
            "/async/orders/",  # @idempotent on a coroutine
        ],
    )
    def test_a_decorated_view_runs_once(self, any_client, url: str) -> None:
        first = post(any_client, url)
        retry = post(any_client, url)

        assert first.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert calls.value == 1
        assert Order.objects.exclude(item__startswith="audit:").count() == 1

    @pytest.mark.parametrize("url", ["/async/sync/plain/", "/async/orders/plain/"])
    def test_a_view_the_middleware_protects_runs_once(self, settings, any_client, url) -> None:
        settings.MIDDLEWARE = [*settings.MIDDLEWARE, MIDDLEWARE]

        first = post(any_client, url)
        retry = post(any_client, url)

        assert first.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert calls.value == 1

    def test_a_drf_views_handler_runs_once(self) -> None:
        client, _ = token_client()

        first = drf_post(client, "/drf/orders/")
        retry = drf_post(client, "/drf/orders/")

        assert first.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert Order.objects.count() == 1

    def test_a_retry_in_another_case_is_another_request(self, settings) -> None:
        # A view may tell "post" from "POST" (request.method == "POST",
        # @require_POST): the answer to one is no answer to the other.
        first = post(Client(), "/orders/")
        settings.MIDDLEWARE = [m for m in settings.MIDDLEWARE if m != LOWER_CASE]

        # A new client: a client's handler keeps the middleware it loaded first.
        retry = post(Client(), "/orders/")

        assert first.status_code == 201
        assert retry.status_code == 422
        assert calls.value == 1
        assert IdempotencyKey.objects.count() == 1

    def test_a_drf_retry_in_another_case_is_another_request(self, settings) -> None:
        client, _ = token_client()
        first = drf_post(client, "/drf/orders/")
        settings.MIDDLEWARE = [m for m in settings.MIDDLEWARE if m != LOWER_CASE]
        # A new client: a client's handler keeps the middleware it loaded first.
        retry_client = APIClient()
        retry_client.credentials(**client._credentials)

        retry = drf_post(retry_client, "/drf/orders/")

        assert first.status_code == 201
        assert retry.status_code == 422
        assert Order.objects.count() == 1
