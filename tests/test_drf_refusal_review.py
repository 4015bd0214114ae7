"""DRF views the middleware refuses as decorated: views no decorator changes are not refused."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.conf import settings
from django.test import AsyncClient, Client, override_settings
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.generators import SchemaGenerator
from rest_framework.authentication import BaseAuthentication
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


# Lease mode inside the request's transaction (ATOMIC_REQUESTS), through the middleware's build.

failing: dict[str, Any] = {}


class ReadsTheDatabase(BaseAuthentication):
    """Reads before the key is claimed, as a token lookup does (a snapshot on MariaDB)."""

    def authenticate(self, request: Any) -> None:
        from django.contrib.auth.models import User

        list(User.objects.all()[:1])


class LeaseInRequestTransaction(APIView):
    """Writes an order; ``failing`` steers how the request ends."""

    authentication_classes: list[Any] = [ReadsTheDatabase]
    permission_classes: list[Any] = []

    def post(self, request: Any) -> Response:
        from django.db import connection

        Order.objects.create(item="in the request transaction")
        started = failing.pop("started", None)
        if started is not None:
            started.set()
            assert failing["release"].wait(timeout=30)
        if failing.pop("at_commit", False):
            with connection.cursor() as cursor:
                # Checked at COMMIT on PostgreSQL, after the view returned.
                cursor.execute(
                    "INSERT INTO auth_user_groups (user_id, group_id) VALUES (%s, %s)",
                    [999999, 999999],
                )
        if failing.pop("unavailable", False):
            return Response({"detail": "down"}, status=503)
        return Response({"orders": Order.objects.count()}, status=201)


urlpatterns.append(path("lease-in-request/", LeaseInRequestTransaction.as_view()))


@pytest.fixture(params=["wsgi", "asgi"])
def client(request: pytest.FixtureRequest) -> Any:
    if request.param == "wsgi":
        return Client(raise_request_exception=False)
    return AsyncClient(raise_request_exception=False)


@pytest.fixture
def lease_in_atomic_requests(settings: Any) -> Any:
    from django.db import connection

    settings.IDEMPOTENCY = {"ATOMIC": False}
    connection.settings_dict["ATOMIC_REQUESTS"] = True
    failing.clear()
    yield
    connection.settings_dict["ATOMIC_REQUESTS"] = False
    failing.clear()


@pytest.mark.urls("tests.test_drf_refusal_review")
@pytest.mark.usefixtures("installed", "lease_in_atomic_requests")
def test_lease_mode_in_the_request_transaction_completes_and_replays(client: Any) -> None:
    from django_idempotency.models import IdempotencyKey

    first = post(client, "/lease-in-request/", "ok")
    again = post(client, "/lease-in-request/", "ok")

    assert first.status_code == 201, first.content[:300]
    assert again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert Order.objects.count() == 1
    assert IdempotencyKey.objects.count() == 1


@pytest.mark.urls("tests.test_drf_refusal_review")
@pytest.mark.usefixtures("installed", "lease_in_atomic_requests")
def test_lease_mode_a_5xx_is_released_and_the_retry_runs(client: Any) -> None:
    failing["unavailable"] = True
    first = post(client, "/lease-in-request/", "down")
    again = post(client, "/lease-in-request/", "down")

    assert first.status_code == 503, first.content[:300]
    assert again.status_code == 201, again.content[:300]
    assert "Idempotent-Replayed" not in again


@pytest.mark.skipif(
    __import__("django.db").db.connection.vendor != "postgresql",
    reason="foreign keys checked at COMMIT",
)
@pytest.mark.urls("tests.test_drf_refusal_review")
@pytest.mark.usefixtures("installed", "lease_in_atomic_requests")
def test_lease_mode_a_request_transaction_failing_at_commit_releases_the_key(client: Any) -> None:
    failing["at_commit"] = True
    first = post(client, "/lease-in-request/", "commit")
    again = post(client, "/lease-in-request/", "commit")

    assert first.status_code == 500
    assert again.status_code == 201, again.content[:300]
    assert "Idempotent-Replayed" not in again
    assert Order.objects.count() == 1


@pytest.mark.skipif(
    __import__("django.db").db.connection.vendor == "sqlite",
    reason="SQLite: the claim is in the request's transaction",
)
@pytest.mark.urls("tests.test_drf_refusal_review")
@pytest.mark.usefixtures("installed", "lease_in_atomic_requests")
def test_lease_mode_a_duplicate_while_the_first_runs_gets_409() -> None:
    import threading

    from django.db import connection

    started, release = threading.Event(), threading.Event()
    failing.update(started=started, release=release)
    answers: list[Any] = []

    def first() -> None:
        try:
            answers.append(
                post(Client(raise_request_exception=False), "/lease-in-request/", "busy")
            )
        finally:
            connection.close()

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert started.wait(timeout=30)
        duplicate = post(Client(raise_request_exception=False), "/lease-in-request/", "busy")
    finally:
        release.set()
        thread.join(timeout=60)

    assert duplicate.status_code == 409, duplicate.content[:300]
    assert "Retry-After" in duplicate
    assert answers[0].status_code == 201


@pytest.mark.urls("tests.test_drf_refusal_review")
@pytest.mark.usefixtures("installed")
def test_required_a_request_without_a_key_to_a_refused_view(settings: Any) -> None:
    # docs/middleware.rst: "A request without a key runs the decorated view as before."
    settings.IDEMPOTENCY = {"REQUIRED": True}

    response = post(Client(raise_request_exception=False), "/csrf-exempt-again/", None)

    assert response.status_code in (201, 400), response.status_code


@pytest.mark.urls("tests.test_drf_refusal_review")
@pytest.mark.usefixtures("installed", "lease_in_atomic_requests")
def test_lease_mode_in_the_request_transaction_another_body_gets_422(client: Any) -> None:
    first = post(client, "/lease-in-request/", "same")
    other = post(client, "/lease-in-request/", "same", item="other")

    assert first.status_code == 201, first.content[:300]
    assert other.status_code == 422, other.content[:300]
    assert Order.objects.count() == 1
