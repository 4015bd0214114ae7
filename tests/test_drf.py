"""``IdempotentMixin`` and ``@idempotent`` on DRF views: the HTTP contract, DRF-shaped.

The contract rows run through a ``ModelViewSet`` behind ``TokenAuthentication``
so that the scope is the DRF-authenticated user, errors go through DRF's
exception handling and stored bodies are the bytes DRF rendered.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.http import JsonResponse
from django.test import RequestFactory, override_settings
from django.urls import path
from django.utils import timezone
from django.utils.decorators import method_decorator
from django.views import View
from rest_framework import viewsets
from rest_framework.permissions import AllowAny, IsAuthenticated
from rest_framework.request import Request, clone_request
from rest_framework.response import Response
from rest_framework.test import APIClient
from rest_framework.views import APIView, exception_handler

from django_idempotency import idempotent
from django_idempotency.contrib import drf
from django_idempotency.contrib.drf import IdempotentMixin
from django_idempotency.exceptions import DatabaseBusy
from django_idempotency.info import IdempotencyInfo, derive
from django_idempotency.models import IdempotencyKey
from tests import drf_views
from tests.clients import PAYLOAD, token_client
from tests.clients import drf_post as post
from tests.factories import IdempotencyKeyFactory
from tests.isolation_views import HEADER_API_KEYS, HeaderApiKeyAuthentication
from tests.models import Order
from tests.polling import wait_until
from tests.views import calls, idempotency_info

ORDERS = "/drf/orders/"


def enveloping_exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """A project's own error shape: ``{"error": {"code", "message"}}``."""
    response = exception_handler(exc, context)
    if response is not None:
        response.data = {"error": {"code": exc.get_codes(), "message": str(exc.detail)}}
    return response


def send_twice(send: Callable[..., Any], url: str, data: Any, key: str) -> list[Any]:
    """Send one DRF request twice with the same key, e.g. through ``client.patch``."""
    return [send(url, data, format="json", headers={"Idempotency-Key": key}) for _ in range(2)]


@pytest.fixture
def alice() -> tuple[APIClient, User]:
    return token_client("alice")


@pytest.mark.django_db
class ModelViewSetContractTests:
    """Every row of the HTTP table (docs/http.rst) through a token-authenticated ModelViewSet."""

    def test_method_not_in_methods_runs_untouched(self, alice: Any) -> None:
        client, _ = alice
        order = Order.objects.create(item="old")
        for _ in range(2):
            response = client.put(
                f"{ORDERS}{order.pk}/", PAYLOAD, format="json", headers={"Idempotency-Key": "k"}
            )
            assert response.status_code == 200
            assert "Idempotent-Replayed" not in response
            assert client.get(
                f"{ORDERS}summary/", headers={"Idempotency-Key": "k"}
            ).status_code == (200)
        assert calls.value == 4
        assert IdempotencyKey.objects.count() == 0

    def test_no_key_not_required_runs_unprotected(self, alice: Any) -> None:
        client, _ = alice
        assert post(client, ORDERS, key=None).status_code == 201
        assert post(client, ORDERS, key=None).status_code == 201
        assert Order.objects.count() == 2
        assert IdempotencyKey.objects.count() == 0

    def test_no_key_required_is_400(self, alice: Any) -> None:
        client, _ = alice
        response = post(client, "/drf/required-orders/", key=None)
        assert response.status_code == 400
        assert response.json() == {"detail": "This endpoint requires an Idempotency-Key header."}
        assert calls.value == 0
        assert Order.objects.count() == 0

    @pytest.mark.parametrize(
        "raw_key",
        ["", "x" * 256, "has space", "tab\tinside", '"unterminated', '""', '"x"y"'],
        ids=["empty", "too-long", "space", "control", "bad-quote", "empty-quoted", "junk"],
    )
    def test_invalid_key_is_400(self, alice: Any, raw_key: str) -> None:
        client, _ = alice
        response = post(client, ORDERS, key=raw_key)
        assert response.status_code == 400
        assert response["Content-Type"] == "application/json"
        assert set(response.json()) == {"detail"}
        assert calls.value == 0
        assert IdempotencyKey.objects.count() == 0
        assert Order.objects.count() == 0

    def test_non_ascii_key_is_400(self, alice: Any) -> None:
        client, _ = alice
        # Headers arrive as latin-1 decoded text in WSGI.
        response = client.post(
            ORDERS, PAYLOAD, format="json", HTTP_IDEMPOTENCY_KEY="cl\xe9".encode().decode("latin-1")
        )
        assert response.status_code == 400
        assert IdempotencyKey.objects.count() == 0

    def test_bare_and_quoted_key_are_the_same_key(self, alice: Any) -> None:
        client, _ = alice
        first = post(client, ORDERS, key="abc-123")
        retry = post(client, ORDERS, key='"abc-123"')
        assert first.status_code == retry.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert IdempotencyKey.objects.get().key == "abc-123"

    def test_first_request_runs_and_is_stored(self, alice: Any) -> None:
        client, user = alice
        response = post(client, ORDERS)
        assert response.status_code == 201
        assert "Idempotent-Replayed" not in response
        order = Order.objects.get()
        assert response.json() == {"id": order.pk, "item": "book", "quantity": 2}
        record = IdempotencyKey.objects.get()
        assert record.scope == f"user:{user.pk}"
        assert record.state == IdempotencyKey.State.COMPLETED
        assert record.status_code == 201
        assert bytes(record.response_body) == response.content

    def test_retry_replays_the_rendered_bytes(self, alice: Any) -> None:
        client, _ = alice
        first = post(client, ORDERS)
        retry = post(client, ORDERS, data={"quantity": 2.0, "item": "book"})
        assert calls.value == 1
        assert Order.objects.count() == 1
        assert retry.status_code == 201
        assert retry.content == first.content
        assert retry["Content-Type"] == first["Content-Type"] == "application/json"
        assert retry["Location"] == first["Location"]
        assert retry["Idempotent-Replayed"] == "true"
        assert "X-Request-Secret" not in retry
        assert "sessionid" in first.cookies
        assert "sessionid" not in retry.cookies

    def test_retry_asking_for_another_format_is_422_not_the_first_format(self, alice: Any) -> None:
        client, _ = alice
        first = post(client, ORDERS)
        retry = post(client, ORDERS, HTTP_ACCEPT="text/html")
        assert first["Content-Type"] == "application/json"
        assert retry.status_code == 422
        assert retry.content != first.content
        assert "Idempotent-Replayed" not in retry
        assert calls.value == 1

    def test_retry_whose_accept_negotiates_the_same_format_replays(self, alice: Any) -> None:
        client, _ = alice
        first = post(client, ORDERS, HTTP_ACCEPT="*/*")
        retry = post(client, ORDERS, HTTP_ACCEPT="application/json")
        assert retry.status_code == 201
        assert retry.content == first.content
        assert retry["Idempotent-Replayed"] == "true"

    def test_different_fingerprint_is_422(self, alice: Any) -> None:
        client, _ = alice
        first = post(client, ORDERS)
        record = IdempotencyKey.objects.get()
        response = post(client, ORDERS, data={"item": "book", "quantity": 3})
        assert response.status_code == 422
        assert response.json() == {"detail": drf.FingerprintMismatch.default_detail}
        assert calls.value == 1
        after = IdempotencyKey.objects.get()
        assert (after.fingerprint, bytes(after.response_body), after.expires_at) == (
            record.fingerprint,
            first.content,
            record.expires_at,
        )

    @pytest.mark.parametrize("query", ["raise=1", "status=500", "status=503"])
    def test_failure_stores_nothing_and_retry_runs(self, alice: Any, query: str) -> None:
        client, _ = alice
        response = post(client, f"{ORDERS}?{query}")
        assert response.status_code in (500, 503)
        assert IdempotencyKey.objects.count() == 0
        assert Order.objects.count() == 0  # rolled back with the claim
        retry = post(client, ORDERS)
        assert retry.status_code == 201
        assert "Idempotent-Replayed" not in retry
        assert calls.value == 2
        assert Order.objects.count() == 1

    def test_validation_error_is_not_stored(self, alice: Any) -> None:
        client, _ = alice
        response = post(client, ORDERS, data={"quantity": 1})
        assert response.status_code == 400
        assert "item" in response.json()
        assert IdempotencyKey.objects.count() == 0

    @pytest.mark.parametrize("code", [408, 409, 425, 429])
    def test_transient_status_is_not_stored(self, alice: Any, code: int) -> None:
        client, _ = alice
        assert post(client, f"{ORDERS}?status={code}").status_code == code
        assert IdempotencyKey.objects.count() == 0
        assert Order.objects.count() == 0
        assert post(client, f"{ORDERS}?status={code}").status_code == code
        assert calls.value == 2

    def test_non_transient_4xx_is_stored(self, alice: Any) -> None:
        client, _ = alice
        first = post(client, f"{ORDERS}?status=404")
        retry = post(client, f"{ORDERS}?status=404")
        assert first.status_code == retry.status_code == 404
        assert retry["Idempotent-Replayed"] == "true"
        assert calls.value == 1

    def test_expired_record_is_treated_as_absent(self, alice: Any) -> None:
        client, user = alice
        old = IdempotencyKeyFactory(scope=f"user:{user.pk}", key="k-1", expired=True)
        response = post(client, ORDERS)
        assert response.status_code == 201
        assert "Idempotent-Replayed" not in response
        record = IdempotencyKey.objects.get()
        assert record.pk == old.pk
        assert record.expires_at > timezone.now() + timedelta(hours=23)
        assert bytes(record.response_body) == response.content

    def test_streaming_response_runs_once_and_replays_without_body(self, alice: Any) -> None:
        client, _ = alice
        first = post(client, f"{ORDERS}?stream=1")
        assert first.status_code == 200
        assert b"".join(first.streaming_content) == b"chunk-1,chunk-2"
        retry = post(client, f"{ORDERS}?stream=1")
        assert retry.status_code == 200
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == b""
        assert "Content-Type" not in retry
        assert calls.value == 1
        assert Order.objects.count() == 1

    @override_settings(IDEMPOTENCY={"MAX_STORED_BODY": 100})
    def test_body_over_max_stored_runs_once_and_replays_without_body(self, alice: Any) -> None:
        client, _ = alice
        first = post(client, f"{ORDERS}?size=500")
        assert first.status_code == 201
        assert len(first.content) > 500
        retry = post(client, f"{ORDERS}?size=500")
        assert retry.status_code == 201
        assert retry["Location"] == first["Location"]
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == b""
        assert calls.value == 1

    @override_settings(IDEMPOTENCY={"ENABLED": False})
    def test_disabled_passes_through(self, alice: Any) -> None:
        client, _ = alice
        assert post(client, "/drf/required-orders/", key=None).status_code == 201
        assert post(client, ORDERS).status_code == 201
        assert post(client, ORDERS).status_code == 201
        assert calls.value == 3
        assert IdempotencyKey.objects.count() == 0


@pytest.mark.django_db
class AuthenticationTests:
    """Scope comes from DRF authentication; refused requests claim nothing."""

    def test_token_user_is_the_scope(self, alice: Any) -> None:
        client, user = alice
        assert post(client, ORDERS).status_code == 201
        assert IdempotencyKey.objects.get().scope == f"user:{user.pk}"

    def test_two_token_users_with_one_key_are_isolated(self, alice: Any) -> None:
        alice_client, alice_user = alice
        bob_client, bob_user = token_client("bob")
        alice_first = post(alice_client, ORDERS, data={"item": "alice-secret", "quantity": 1})
        bob_first = post(bob_client, ORDERS, data={"item": "bob-secret", "quantity": 1})
        assert alice_first.status_code == bob_first.status_code == 201
        assert "Idempotent-Replayed" not in bob_first
        assert b"alice-secret" not in bob_first.content
        bob_retry = post(bob_client, ORDERS, data={"item": "bob-secret", "quantity": 1})
        alice_retry = post(alice_client, ORDERS, data={"item": "alice-secret", "quantity": 1})
        assert bob_retry.content == bob_first.content
        assert alice_retry.content == alice_first.content
        assert b"bob-secret" not in alice_retry.content
        scopes = sorted(IdempotencyKey.objects.values_list("scope", "key"))
        assert scopes == sorted([(f"user:{alice_user.pk}", "k-1"), (f"user:{bob_user.pk}", "k-1")])
        assert calls.value == 2

    def test_same_key_same_body_in_two_scopes_runs_twice(self, alice: Any) -> None:
        alice_client, _ = alice
        bob_client, _ = token_client("bob")
        first = post(alice_client, ORDERS)
        second = post(bob_client, ORDERS)
        assert "Idempotent-Replayed" not in second
        assert first.json()["id"] != second.json()["id"]
        assert IdempotencyKey.objects.count() == 2

    @pytest.mark.parametrize(
        "authorization", [None, "Token not-a-real-token"], ids=["missing", "bad-token"]
    )
    def test_unauthenticated_is_401_and_leaves_nothing(self, authorization: str | None) -> None:
        client = APIClient()
        if authorization:
            client.credentials(HTTP_AUTHORIZATION=authorization)
        response = post(client, ORDERS)
        assert response.status_code == 401
        assert response["WWW-Authenticate"] == "Token"
        assert IdempotencyKey.objects.count() == 0
        assert Order.objects.count() == 0
        assert calls.value == 0

    def test_forbidden_is_403_and_leaves_nothing(self) -> None:
        client, _ = token_client("blocked-carol")
        response = post(client, ORDERS)
        assert response.status_code == 403
        assert IdempotencyKey.objects.count() == 0
        assert calls.value == 0

    def test_401_then_authenticated_retry_runs(self, alice: Any) -> None:
        client, _ = alice
        assert post(APIClient(), ORDERS).status_code == 401
        assert post(client, ORDERS).status_code == 201
        assert calls.value == 1

    def test_permission_reading_the_body_still_fingerprints(self) -> None:
        client = APIClient(raise_request_exception=False)
        first = post(client, "/drf/reads-data/")
        # Sent as the first was: not with the cookie its answer set (another scope).
        client.cookies.clear()
        retry = post(client, "/drf/reads-data/")
        assert first.status_code == retry.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert post(client, "/drf/reads-data/", data={"item": "other"}).status_code == 422
        assert post(client, "/drf/reads-data/", data={"item": "forbidden"}).status_code == 403
        assert calls.value == 1


@pytest.mark.django_db
class ViewKindsTests:
    """The mixin on each kind of DRF view, and ``@idempotent`` under ``@api_view``."""

    @pytest.mark.parametrize("url", ["/drf/apiview/", "/drf/generic/", "/drf/plain/"])
    def test_view_kind_replays(self, url: str) -> None:
        client = APIClient(raise_request_exception=False)
        first = post(client, url)
        retry = post(client, url)
        assert first.status_code == retry.status_code == 201
        assert "Idempotent-Replayed" not in first
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert calls.value == 1
        assert Order.objects.count() == 1
        assert IdempotencyKey.objects.get().scope == "anonymous"

    def test_apiview_put_not_in_methods_is_untouched(self) -> None:
        client = APIClient()
        for _ in range(2):
            response = client.put(
                "/drf/apiview/", {}, format="json", headers={"Idempotency-Key": "k"}
            )
            assert response.status_code == 200
        assert calls.value == 2
        assert IdempotencyKey.objects.count() == 0

    def test_model_viewset_partial_update_replays(self, alice: Any) -> None:
        client, _ = alice
        order = Order.objects.create(item="old")
        first, retry = send_twice(client.patch, f"{ORDERS}{order.pk}/", {"quantity": 7}, "patch-1")
        assert first.status_code == retry.status_code == 200
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert calls.value == 1
        assert Order.objects.count() == 2

    def test_model_viewset_update_with_put_in_methods_replays(self, alice: Any) -> None:
        client, _ = alice
        order = Order.objects.create(item="old")
        first, retry = send_twice(client.put, f"/drf/put-orders/{order.pk}/", PAYLOAD, "put-1")
        assert first.status_code == retry.status_code == 200
        assert retry["Idempotent-Replayed"] == "true"
        assert calls.value == 1

    def test_custom_action_replays(self, alice: Any) -> None:
        client, _ = alice
        order = Order.objects.create(item="parcel")
        url = f"{ORDERS}{order.pk}/ship/"
        first = post(client, url, data={})
        retry = post(client, url, data={})
        assert first.status_code == retry.status_code == 201
        assert retry.content == first.content
        assert retry["Idempotent-Replayed"] == "true"
        assert calls.value == 1
        assert Order.objects.count() == 2

    def test_custom_get_action_is_untouched(self, alice: Any) -> None:
        client, _ = alice
        for _ in range(2):
            response = client.get(f"{ORDERS}summary/", headers={"Idempotency-Key": "k"})
            assert "Idempotent-Replayed" not in response
        assert calls.value == 2

    def test_template_response_is_stored_rendered(self) -> None:
        client = APIClient(raise_request_exception=False)
        first = post(client, "/drf/template/")
        retry = post(client, "/drf/template/")
        assert first.status_code == retry.status_code == 201
        assert first.content == f"order {Order.objects.get().pk}".encode()
        assert retry.content == first.content
        assert calls.value == 1

    def test_api_view_with_decorator_replays(self) -> None:
        client = APIClient(raise_request_exception=False)
        first = post(client, "/api/orders/")
        retry = post(client, "/api/orders/")
        assert first.status_code == retry.status_code == 201
        assert retry.content == first.content
        assert retry["Idempotent-Replayed"] == "true"
        assert calls.value == 1

    def test_api_view_with_decorator_raises_api_exceptions(self) -> None:
        client = APIClient(raise_request_exception=False)
        assert post(client, "/api/orders/", key="bad key").json() == {
            "detail": (
                "The idempotency key may only contain visible ASCII characters "
                "(no spaces, control characters or non-ASCII text)."
            )
        }
        post(client, "/api/orders/")
        mismatch = post(client, "/api/orders/", data={"item": "other"})
        assert mismatch.status_code == 422
        assert mismatch["Content-Type"] == "application/json"


@pytest.mark.django_db
class OptionTests:
    """``idempotency_<option>`` class attributes."""

    def test_scope_and_fingerprint_as_plain_functions(self) -> None:
        client = APIClient(raise_request_exception=False)
        url = "/drf/options-orders/"
        acme = post(client, url, HTTP_X_TENANT="Acme")
        assert acme.status_code == 201
        other = post(client, url, HTTP_X_TENANT="acme")
        assert "Idempotent-Replayed" not in other
        assert post(client, url, HTTP_X_TENANT="Acme")["Idempotent-Replayed"] == "true"
        record = IdempotencyKey.objects.get(scope="tenant:Acme")
        assert record.fingerprint == json.dumps(PAYLOAD, separators=(",", ":"))
        assert calls.value == 2

    def test_ttl_attribute_sets_expiry(self) -> None:
        client = APIClient(raise_request_exception=False)
        before = timezone.now()
        post(client, "/drf/options-orders/", HTTP_X_TENANT="Acme")
        expires_at = IdempotencyKey.objects.get().expires_at
        assert before + timedelta(seconds=59) < expires_at < timezone.now() + timedelta(seconds=61)

    def test_scope_as_dotted_path(self) -> None:
        client = APIClient(raise_request_exception=False)
        assert post(client, "/drf/dotted-orders/", HTTP_X_TENANT="Acme").status_code == 201
        assert IdempotencyKey.objects.get().scope == "tenant:Acme"

    def test_required_attribute(self, alice: Any) -> None:
        client, _ = alice
        assert post(client, "/drf/required-orders/", key=None).status_code == 400
        assert post(client, "/drf/required-orders/").status_code == 201

    @override_settings(
        REST_FRAMEWORK={
            "DEFAULT_AUTHENTICATION_CLASSES": ["rest_framework.authentication.TokenAuthentication"],
            "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
            "EXCEPTION_HANDLER": "tests.test_drf.enveloping_exception_handler",
        }
    )
    def test_errors_go_through_the_project_exception_handler(self, alice: Any) -> None:
        client, _ = alice
        required = post(client, "/drf/required-orders/", key=None)
        assert required.status_code == 400
        assert required.json()["error"]["code"] == "idempotency_key_required"
        invalid = post(client, ORDERS, key="")
        assert invalid.status_code == 400
        assert invalid.json()["error"]["code"] == "invalid_idempotency_key"
        post(client, ORDERS)
        mismatch = post(client, ORDERS, data={"item": "other"})
        assert mismatch.status_code == 422
        assert mismatch.json()["error"]["code"] == "idempotency_key_reused"


@pytest.mark.django_db(transaction=True)
@pytest.mark.concurrency
class InFlightTests:
    """A duplicate arriving while the original still runs, with real threads."""

    def _start(self, client: APIClient, url: str, **extra: Any) -> Callable[[], Any]:
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["response"] = post(client, url, **extra)
            finally:
                connection.close()

        thread = threading.Thread(target=run)
        thread.start()
        wait_until(lambda: calls.value > 0, "the original to start", 5)

        def join() -> Any:
            thread.join(timeout=15)
            assert not thread.is_alive()
            return result["response"]

        return join

    def test_duplicate_waits_then_replays(self, alice: Any) -> None:
        client, _ = alice
        join = self._start(client, f"{ORDERS}?hold=1")
        duplicate = post(client, f"{ORDERS}?hold=1")
        original = join()
        assert original.status_code == duplicate.status_code == 201
        assert duplicate["Idempotent-Replayed"] == "true"
        assert duplicate.content == original.content
        assert calls.value == 1
        assert Order.objects.count() == 1

    def test_duplicate_past_wait_is_409_with_retry_after(self) -> None:
        client = APIClient(raise_request_exception=False)
        url = "/drf/options-orders/?hold=2"
        join = self._start(client, url, HTTP_X_TENANT="Acme")
        started = time.monotonic()
        duplicate = post(client, url, HTTP_X_TENANT="Acme")
        assert time.monotonic() - started < 1.5
        original = join()
        assert original.status_code == 201
        assert duplicate.status_code == 409
        assert duplicate["Retry-After"] == "1"
        # SQLite cannot tell this key's original from any other holder of its
        # one write lock, so it says the database was busy.
        detail = (
            DatabaseBusy.default_detail
            if connection.vendor == "sqlite"
            else drf.RequestInFlight.default_detail
        )
        assert duplicate.json() == {"detail": detail}
        assert calls.value == 1

    def test_simultaneous_duplicates_run_once(self, alice: Any) -> None:
        client, _ = alice
        racers = 6
        barrier = threading.Barrier(racers)
        responses: list[Any] = []
        lock = threading.Lock()

        def send() -> None:
            try:
                barrier.wait(timeout=10)
                response = post(client, f"{ORDERS}?hold=0.3")
                with lock:
                    responses.append(response)
            finally:
                connection.close()

        threads = [threading.Thread(target=send) for _ in range(racers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
            assert not thread.is_alive()
        assert [response.status_code for response in responses] == [201] * racers
        assert sum("Idempotent-Replayed" not in response for response in responses) == 1
        assert len({response.content for response in responses}) == 1
        assert calls.value == 1
        assert Order.objects.count() == 1


def test_error_mapping_covers_every_core_error() -> None:
    from django_idempotency import exceptions as core

    for error in (
        core.IdempotencyKeyRequired(),
        core.InvalidIdempotencyKey("too long"),
        core.FingerprintMismatch(),
        core.RequestInFlight(retry_after=2.2),
    ):
        api_error = drf.to_api_exception(error)
        assert api_error.status_code == error.status
        assert api_error.get_codes() == error.code
        assert str(api_error.detail) == error.detail
    assert drf.to_api_exception(core.RequestInFlight(retry_after=2.2)).wait == 3


def test_derive_is_stable_and_scoped() -> None:
    info = IdempotencyInfo(key="k", scope="user:1", fingerprint="f")
    assert info.derive("payment") == IdempotencyInfo("k", "user:1", "other").derive("payment")
    assert info.derive("payment") != IdempotencyInfo("k", "user:2", "f").derive("payment")
    assert info.derive("payment") != info.derive("email")


class TenantIdempotent(IdempotentMixin):
    """An abstract intermediate mixin: project-wide options, no DRF class yet."""

    idempotency_scope = "tests.drf_views.tenant_scope"


class CountingView(TenantIdempotent, APIView):
    authentication_classes: list[type] = []
    permission_classes = [AllowAny]

    def post(self, request: Request) -> Response:
        calls.increment()
        return Response({"call": calls.value}, status=201)


class SubclassedCountingView(CountingView):
    """A subclass of a correctly ordered view keeps its protection."""


class RequiredByPropertyView(CountingView):
    @property
    def idempotency_required(self) -> bool:
        return self.request.query_params.get("strict") == "1"


class CountsItsFinalizing(APIView):
    """A base class whose ``finalize_response`` does not repeat itself: it counts."""

    def finalize_response(self, request: Any, response: Any, *args: Any, **kwargs: Any) -> Any:
        response = super().finalize_response(request, response, *args, **kwargs)
        response["X-Finalized"] = str(int(response.get("X-Finalized", "0")) + 1)
        return response


class OpenAndCounting(IdempotentMixin):
    """Protected, open to every caller, and counting its handler's runs."""

    authentication_classes: list[type] = []
    permission_classes = [AllowAny]

    def counted(self) -> Response:
        calls.increment()
        return Response({"call": calls.value}, status=201)


class FinalizingView(OpenAndCounting, CountsItsFinalizing):
    def post(self, request: Request) -> Response:
        return self.counted()


class OverriddenMethodView(OpenAndCounting, APIView):
    """A method override set on DRF's request, which DRF dispatches on (``clone_request`` too)."""

    idempotency_methods = ["POST", "PUT"]

    def initialize_request(self, request: Any, *args: Any, **kwargs: Any) -> Request:
        drf_request = super().initialize_request(request, *args, **kwargs)
        override = request.headers.get("X-HTTP-Method-Override")
        if override:
            drf_request.method = override
        return drf_request

    def post(self, request: Request) -> Response:
        return self.counted()

    def put(self, request: Request) -> Response:
        return self.counted()


class LateOverrideView(OpenAndCounting, APIView):
    """A method override set after the mixin's ``initial()``, which DRF then dispatches on."""

    idempotency_methods = ["POST", "PUT"]

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        override = request.META.get("HTTP_X_HTTP_METHOD_OVERRIDE")
        if override:
            request.method = override

    def post(self, request: Request) -> Response:
        return self.counted()

    def put(self, request: Request) -> Response:
        return self.counted()


class DelegatingView(OpenAndCounting, APIView):
    """A PATCH handler that answers through the POST handler, with a request cloned as a POST."""

    idempotency_methods = ["POST", "PATCH"]

    def post(self, request: Request) -> Response:
        # The claim's record, as a payment handler reads it, on the cloned request too.
        charge = request.idempotency.derive("charge")
        calls.increment()
        return Response({"call": calls.value, "charge": charge}, status=201)

    def patch(self, request: Request) -> Response:
        return self.post(clone_request(request, "POST"))


@method_decorator(idempotent(methods=["POST", "PATCH"]), name="post")
class DelegatingToDecoratedView(DelegatingView):
    """The POST handler it answers PATCH through is also protected by ``@idempotent``."""


class DecoratedDelegatingView(APIView):
    """No mixin: PATCH's and POST's handlers each protected by ``@idempotent``."""

    authentication_classes: list[type] = []
    permission_classes = [AllowAny]

    @method_decorator(idempotent(methods=["POST", "PATCH"]))
    def post(self, request: Request) -> Response:
        return DelegatingView.post(self, request)  # type: ignore[arg-type]

    @method_decorator(idempotent(methods=["POST", "PATCH"]))
    def patch(self, request: Request) -> Response:
        return self.post(clone_request(request, "POST"))


@idempotent(scope=lambda request: "other-scope")
def other_scope_order(request: Any) -> JsonResponse:
    calls.increment()
    return JsonResponse({"other": calls.value}, status=201)


class DelegatingToPlainView(OpenAndCounting, APIView):
    """A POST handler that calls plain ``@idempotent`` views with Django's request.

    The first has a scope of its own, so a record of its own; the second has the same options
    as the mixin, so it runs inside the mixin's claim.
    """

    def post(self, request: Request) -> Any:
        other = json.loads(other_scope_order(request._request).content)
        # The other view's claim ended: its record is no longer what Django's request says.
        restored = "idempotency" not in vars(request._request)
        inside = json.loads(idempotency_info(request._request).content)
        return Response({**other, **inside, "restored": restored}, status=201)


@idempotent(atomic=False)
def lease_order(request: Any) -> JsonResponse:
    calls.increment()
    return JsonResponse({"view": "lease", "call": calls.value}, status=201)


@idempotent
def first_order(request: Any) -> JsonResponse:
    calls.increment()
    return JsonResponse({"view": "first", "call": calls.value}, status=201)


@idempotent
def second_order(request: Any) -> JsonResponse:
    calls.increment()
    return JsonResponse({"view": "second", "call": calls.value}, status=201)


class CallingForItsOwnRecordView(OpenAndCounting, APIView):
    """Calls a plain view whose options differ from the mixin's only in ``atomic``."""

    def post(self, request: Request) -> Any:
        return Response(json.loads(lease_order(request._request).content), status=201)


@idempotent(scope=lambda request: "caller-scope")
def caller_scoped_order(request: Any) -> JsonResponse:
    calls.increment()
    return JsonResponse({"view": "caller-scoped", "call": calls.value}, status=201)


@method_decorator(idempotent, name="dispatch")
class OrderView(View):
    def post(self, request: Any) -> JsonResponse:
        return first_order.__wrapped__(request)  # type: ignore[attr-defined,no-any-return]


@method_decorator(idempotent, name="dispatch")
class PaymentView(View):
    def post(self, request: Any) -> JsonResponse:
        return second_order.__wrapped__(request)  # type: ignore[attr-defined,no-any-return]


class NestedCallerView(OpenAndCounting, APIView):
    """A scope of its own; calls the plain view its query string names as ``inner``."""

    idempotency_scope = staticmethod(lambda request: "nested-scope")

    def post(self, request: Request) -> Any:
        inner = INNER_VIEWS[request.GET["inner"]](request._request)
        return Response(json.loads(inner.content), status=201)


INNER_VIEWS: dict[str, Any] = {
    "first": first_order,
    "second": second_order,
    "caller_scoped": caller_scoped_order,
    "other": other_scope_order,
    "order_view": OrderView.as_view(),
    "payment_view": PaymentView.as_view(),
}


class CallingTwoViewsView(OpenAndCounting, APIView):
    """A scope of its own; calls the views its query string names, with one request."""

    idempotency_scope = staticmethod(lambda request: "caller-scope")

    def post(self, request: Request) -> Any:
        views = {**INNER_VIEWS, "nested": NestedCallerView.as_view()}
        answers = [views[name](request._request) for name in request.GET["views"].split(",")]
        replayed = [answer.get("Idempotent-Replayed") == "true" for answer in answers]
        return Response({"replayed": replayed}, status=201)


class PropertyMethodRequest(Request):
    """A request whose class gives the override as a property: never in its ``__dict__``."""

    @property
    def method(self) -> str:
        return self._request.META.get("HTTP_X_HTTP_METHOD_OVERRIDE") or self._request.method


class PropertyOverrideView(OpenAndCounting, APIView):
    """The override given by DRF's request's class, which the mixin's ``initial()`` does not see."""

    idempotency_methods = ["POST", "PUT"]

    def post(self, request: Request) -> Response:
        return self.counted()

    def put(self, request: Request) -> Response:
        return self.counted()

    def initialize_request(self, request: Any, *args: Any, **kwargs: Any) -> Request:
        drf_request = super().initialize_request(request, *args, **kwargs)
        drf_request.__class__ = PropertyMethodRequest
        return drf_request


class SessionOnTheDrfRequestView(OpenAndCounting, APIView):
    """A session of the project's own, set on DRF's request for anonymous callers."""

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        from django.contrib.sessions.backends.db import SessionStore

        request.session = SessionStore(session_key=request.META.get("HTTP_X_SID"))
        super().initial(request, *args, **kwargs)

    def post(self, request: Request) -> Response:
        calls.increment()
        return Response({"caller": request.META["HTTP_X_SID"], "call": calls.value}, status=201)


urlpatterns = [
    path("counting/", CountingView.as_view()),
    path("overridden-method/", OverriddenMethodView.as_view()),
    path("late-override/", LateOverrideView.as_view()),
    path("delegating/", DelegatingView.as_view()),
    path("delegating-to-decorated/", DelegatingToDecoratedView.as_view()),
    path("decorated-delegating/", DecoratedDelegatingView.as_view()),
    path("delegating-to-plain/", DelegatingToPlainView.as_view()),
    path("for-its-own-record/", CallingForItsOwnRecordView.as_view()),
    path("two-views/", CallingTwoViewsView.as_view()),
    path("property-override/", PropertyOverrideView.as_view()),
    path("own-session/", SessionOnTheDrfRequestView.as_view()),
    path("finalizing/", FinalizingView.as_view()),
    path("subclassed/", SubclassedCountingView.as_view()),
    path("by-property/", RequiredByPropertyView.as_view()),
    path("as-view-ttl/", CountingView.as_view(idempotency_ttl=60)),
]


class MixinDefinitionTests:
    """Mistakes in a class using ``IdempotentMixin`` fail when the class is created."""

    def test_mixin_after_the_drf_class_is_refused_with_the_fix(self) -> None:
        with pytest.raises(ImproperlyConfigured) as raised:

            class Wrong(viewsets.ModelViewSet, IdempotentMixin):  # type: ignore[misc]
                pass

        assert "class Wrong(IdempotentMixin, ModelViewSet)" in str(raised.value)

    def test_intermediate_mixin_after_the_drf_class_is_refused(self) -> None:
        with pytest.raises(ImproperlyConfigured, match=r"class Wrong\(TenantIdempotent, APIView\)"):

            class Wrong(APIView, TenantIdempotent):  # type: ignore[misc]
                pass

    def test_subclasses_of_a_correct_class_are_accepted(self) -> None:
        class Audited:
            pass

        class Sub(Audited, drf_views.OrderViewSet):
            idempotency_ttl = 30

        assert Sub._idempotency_options.resolve().ttl == timedelta(seconds=30)

    @pytest.mark.parametrize("name", ["idempotency_requird", "idempotncy_required"])
    def test_misspelt_attribute_is_refused_with_a_suggestion(self, name: str) -> None:
        with pytest.raises(ImproperlyConfigured, match="Did you mean 'idempotency_required'"):
            type("Misspelt", (IdempotentMixin, APIView), {name: True})

    def test_unknown_idempotency_attribute_is_refused(self) -> None:
        with pytest.raises(ImproperlyConfigured, match=r"idempotency_retries is not an"):
            type("Unknown", (IdempotentMixin, APIView), {"idempotency_retries": 3})

    @pytest.mark.parametrize(
        ("name", "value"),
        [
            ("idempotency_methods", "POST"),
            ("idempotency_ttl", "1h"),
            ("idempotency_wait", -1),
            ("idempotency_atomic", "no"),
            ("idempotency_scope", 42),
        ],
    )
    def test_wrong_attribute_value_is_refused_naming_it(self, name: str, value: Any) -> None:
        with pytest.raises(ImproperlyConfigured, match=rf"^BadValue\.{name} has an invalid value"):
            type("BadValue", (IdempotentMixin, APIView), {name: value})

    def test_wrong_value_in_an_intermediate_mixin_is_refused_there(self) -> None:
        with pytest.raises(ImproperlyConfigured, match=r"Defaults\.idempotency_lease"):
            type("Defaults", (IdempotentMixin,), {"idempotency_lease": timedelta(0)})

    def test_django_view_is_refused(self) -> None:
        with pytest.raises(ImproperlyConfigured, match="method_decorator"):
            type("PlainView", (IdempotentMixin, View), {})

    def test_wrong_as_view_argument_is_refused(self) -> None:
        with pytest.raises(ImproperlyConfigured, match=r"CountingView\.idempotency_ttl"):
            CountingView.as_view(idempotency_ttl="1h")


@pytest.mark.django_db
@pytest.mark.urls("tests.test_drf")
class MixinInheritanceTests:
    def test_intermediate_mixin_protects_and_applies_its_options(self) -> None:
        client = APIClient()
        first = post(client, "/counting/", HTTP_X_TENANT="Acme")
        retry = post(client, "/counting/", HTTP_X_TENANT="Acme")
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.json() == first.json() == {"call": 1}
        assert IdempotencyKey.objects.get().scope == "tenant:Acme"

    def test_subclass_of_a_protected_view_is_protected(self) -> None:
        client = APIClient()
        post(client, "/subclassed/")
        assert post(client, "/subclassed/")["Idempotent-Replayed"] == "true"
        assert calls.value == 1

    def test_option_given_as_a_property_is_read_per_request(self) -> None:
        client = APIClient()
        assert post(client, "/by-property/?strict=1", key=None).status_code == 400
        assert post(client, "/by-property/", key=None).status_code == 201

    @pytest.mark.parametrize("patched", [SubclassedCountingView, CountingView])
    def test_a_property_patched_in_after_the_first_request_is_read_per_request(
        self, patched: type, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # On the class itself or on a base, until the patch is undone.
        client = APIClient()
        assert post(client, "/subclassed/?strict=1", key=None).status_code == 201
        strict = property(lambda view: view.request.query_params.get("strict") == "1")
        monkeypatch.setattr(patched, "idempotency_required", strict, raising=False)

        assert post(client, "/subclassed/?strict=1", key=None).status_code == 400
        assert post(client, "/subclassed/", key=None).status_code == 201
        monkeypatch.undo()
        assert post(client, "/subclassed/?strict=1", key=None).status_code == 201

    @override_settings(IDEMPOTENCY={"STORED_HEADERS": ["Content-Type", "X-Finalized"]})
    def test_a_base_class_finalizes_as_drf_asks_it_to_sent_and_replayed_alike(self) -> None:
        # Once to store the response, once more when DRF's dispatch asks (a
        # replay: once, over the stored header), whatever the mixin skips of
        # DRF's own finalising, which only repeats itself.
        client = APIClient()
        first = post(client, "/finalizing/")
        retry = post(client, "/finalizing/")

        assert retry["Idempotent-Replayed"] == "true" and retry.json() == first.json()
        assert first["X-Finalized"] == retry["X-Finalized"] == "2"
        assert first["Allow"] == retry["Allow"] and first["Vary"] == retry["Vary"]

    def test_a_method_set_on_drfs_request_is_the_one_protected(self) -> None:
        client = APIClient()
        override = {"HTTP_X_HTTP_METHOD_OVERRIDE": "PUT"}
        first = post(client, "/overridden-method/", **override)
        retry = post(client, "/overridden-method/", **override)

        assert first.status_code == 201
        assert retry["Idempotent-Replayed"] == "true" and retry.json() == first.json()
        assert calls.value == 1

    @pytest.mark.parametrize("url", ["/late-override/", "/property-override/"])
    @pytest.mark.parametrize("sent", ["PUT", "put"])
    def test_a_method_dispatched_on_that_the_mixin_did_not_see_is_protected_too(
        self, url, sent
    ) -> None:
        # DRF dispatches on PUT, though the mixin's initial() saw a POST: an
        # override set after it, or given by the request's class, in either
        # case. PUT's handler is protected as well, so the retry is replayed.
        client = APIClient()
        override = {"HTTP_X_HTTP_METHOD_OVERRIDE": sent}
        first = post(client, url, **override)
        retry = post(client, url, **override)

        assert first.status_code == 201
        assert retry["Idempotent-Replayed"] == "true" and retry.json() == first.json()
        assert calls.value == 1

    @pytest.mark.parametrize("url", ["/late-override/", "/property-override/"])
    def test_a_key_sent_again_under_a_late_override_is_another_request(self, url) -> None:
        # The claim and the fingerprint take the method DRF dispatches on, even
        # one the mixin's initial() did not see: PUT does not get POST's answer.
        client = APIClient()
        first = post(client, url)
        other = post(client, url, HTTP_X_HTTP_METHOD_OVERRIDE="PUT")

        assert first.status_code == 201
        assert other.status_code == 422
        assert calls.value == 1

    def test_a_get_a_request_class_overrides_to_a_protected_method_is_protected(self) -> None:
        # The request's class makes a GET a PUT: PUT's handler runs once per key.
        client = APIClient()
        sent = {"headers": {"Idempotency-Key": "k-get"}, "HTTP_X_HTTP_METHOD_OVERRIDE": "PUT"}
        first = client.get("/property-override/", **sent)
        retry = client.get("/property-override/", **sent)

        assert first.status_code == 201
        assert retry["Idempotent-Replayed"] == "true" and retry.json() == first.json()
        assert calls.value == 1

    def test_a_handler_called_by_the_protected_one_runs_inside_its_claim(self) -> None:
        # PATCH's handler calls POST's, also protected, with a cloned request: the
        # key is claimed once, by the handler DRF called, and its answer replayed.
        client = APIClient()
        first = client.patch("/delegating/", {}, format="json", headers={"Idempotency-Key": "k-d"})
        retry = client.patch("/delegating/", {}, format="json", headers={"Idempotency-Key": "k-d"})

        assert first.status_code == 201, first.content
        assert retry["Idempotent-Replayed"] == "true" and retry.json() == first.json()
        assert calls.value == 1
        record = IdempotencyKey.objects.get()
        assert record.state == IdempotencyKey.State.COMPLETED
        assert first.json()["charge"] == derive(record.scope, "k-d", "charge")

    @pytest.mark.parametrize("url", ["/delegating-to-decorated/", "/decorated-delegating/"])
    def test_a_decorated_handler_called_by_the_protected_one_runs_inside_its_claim(
        self, url: str
    ) -> None:
        # PATCH's claim is marked on Django's request under DRF's, so the decorator on the
        # POST handler it calls with a cloned request sees it, and reads its record.
        client = APIClient()
        first = client.patch(url, {}, format="json", headers={"Idempotency-Key": "k-d"})
        retry = client.patch(url, {}, format="json", headers={"Idempotency-Key": "k-d"})

        assert first.status_code == 201, first.content
        assert retry["Idempotent-Replayed"] == "true" and retry.json() == first.json()
        assert calls.value == 1
        record = IdempotencyKey.objects.get()
        assert first.json()["charge"] == derive(record.scope, "k-d", "charge")

    def test_plain_views_given_djangos_request_claim_or_run_inside_by_their_options(
        self,
    ) -> None:
        client = APIClient()
        first = post(client, "/delegating-to-plain/")
        retry = post(client, "/delegating-to-plain/")

        assert first.status_code == 201, first.content
        assert retry["Idempotent-Replayed"] == "true" and retry.json() == first.json()
        assert calls.value == 2  # each plain view's handler once
        records = {record.scope: record for record in IdempotencyKey.objects.all()}
        assert len(records) == 2 and "other-scope" in records
        assert {r.state for r in records.values()} == {IdempotencyKey.State.COMPLETED}
        # The second ran inside the mixin's claim, not in the other scope's claim before it.
        assert first.json()["restored"] is True
        assert first.json()["scope"] != "other-scope"
        assert records[first.json()["scope"]].key == first.json()["key"]

    def test_a_view_called_for_a_record_of_its_own_that_is_its_callers_is_refused(self) -> None:
        # Its options differ (lease mode), but its scope and key are the caller's: it would
        # wait for the caller's claim, or be answered 422. Refused before it runs.
        with pytest.raises(ImproperlyConfigured, match=r"CallingForItsOwnRecordView claimed"):
            post(APIClient(), "/for-its-own-record/")
        assert calls.value == 0
        assert not IdempotencyKey.objects.exists()

    @pytest.mark.parametrize(
        ("views", "holder"),
        [
            ("first,second", r"tests\.test_drf\.first_order"),
            ("first,first", r"tests\.test_drf\.first_order"),
            # method_decorator names every such view View.dispatch: one record, one claim.
            ("order_view,payment_view", r"View\.dispatch"),
            # Two deep: the outermost caller's record, and a record its first call holds.
            ("nested&inner=caller_scoped", r"CallingTwoViewsView"),
            ("first,nested&inner=second", r"tests\.test_drf\.first_order"),
        ],
    )
    def test_a_record_claimed_once_in_a_request_is_not_claimed_again(
        self, views: str, holder: str
    ) -> None:
        with pytest.raises(ImproperlyConfigured, match=holder + " claimed already"):
            post(APIClient(), f"/two-views/?views={views}")
        assert not IdempotencyKey.objects.exists()  # rolled back with the caller's claim

    def test_views_with_records_of_their_own_nest_two_deep(self) -> None:
        client = APIClient()
        first = post(client, "/two-views/?views=first,nested&inner=other")
        retry = post(client, "/two-views/?views=first,nested&inner=other")

        assert first.json() == {"replayed": [False, False]}
        assert retry["Idempotent-Replayed"] == "true" and retry.json() == first.json()
        assert calls.value == 2  # first_order's and other_scope_order's handlers, once
        records = list(IdempotencyKey.objects.all())
        assert len(records) == 4  # the caller's, first_order's, the nested view's, and its call's
        assert {"caller-scope", "nested-scope", "other-scope"} < {r.scope for r in records}
        assert {r.state for r in records} == {IdempotencyKey.State.COMPLETED}

    def test_a_key_sent_again_under_an_overridden_method_is_another_request(self) -> None:
        # The fingerprint covers the method the claim protects: a POST's key
        # reused by a request overridden to PUT is not replayed the POST's answer.
        client = APIClient()
        first = post(client, "/overridden-method/")
        other = post(client, "/overridden-method/", HTTP_X_HTTP_METHOD_OVERRIDE="PUT")

        assert first.status_code == 201
        assert other.status_code == 422
        assert calls.value == 1

    def test_a_session_set_on_drfs_request_scopes_each_caller(self) -> None:
        from django.contrib.sessions.backends.db import SessionStore

        alice, bob = SessionStore(), SessionStore()
        alice.create()
        bob.create()
        client = APIClient()
        first = post(client, "/own-session/", HTTP_X_SID=alice.session_key)
        other = post(client, "/own-session/", HTTP_X_SID=bob.session_key)

        assert "Idempotent-Replayed" not in other
        assert other.json() == {"caller": bob.session_key, "call": 2}
        assert first.json() == {"caller": alice.session_key, "call": 1}
        assert IdempotencyKey.objects.count() == 2

    def test_as_view_argument_applies(self) -> None:
        before = timezone.now()
        post(APIClient(), "/as-view-ttl/")
        expires_at = IdempotencyKey.objects.get().expires_at
        assert before + timedelta(seconds=59) < expires_at < timezone.now() + timedelta(seconds=61)


class DecoratorPlacementTests:
    """``@idempotent`` where it would see the request before DRF authenticates it is refused."""

    def test_above_api_view_is_refused_with_the_right_order(self) -> None:
        from rest_framework.decorators import api_view

        def charge(request: Request) -> Response:
            return Response({})

        with pytest.raises(ImproperlyConfigured) as raised:
            idempotent(api_view(["POST"])(charge))

        message = str(raised.value)
        assert "before DRF authenticates it" in message
        assert "@api_view([...])\n    @idempotent\n    def charge(request)" in message

    def test_on_a_drf_class_based_view_points_to_the_mixin(self) -> None:
        with pytest.raises(ImproperlyConfigured, match=r"IdempotentMixin"):
            idempotent(atomic=False)(drf_views.UnprotectedOrderAPIView.as_view())

    def test_below_api_view_is_accepted(self) -> None:
        from rest_framework.decorators import api_view

        def charge(request: Request) -> Response:
            return Response({})

        view = api_view(["POST"])(idempotent(charge))
        assert view.cls.post  # type: ignore[attr-defined]

    def test_on_a_plain_class_based_view_is_accepted(self) -> None:
        from django.views import View

        class Plain(View):
            def post(self, request: Any) -> Any: ...

        assert getattr(idempotent(Plain.as_view()), "_idempotency_protected", False)


# @idempotent on a DRF view's dispatch: the handler is protected, after DRF's authentication.


class _HeaderKeyOnly:
    authentication_classes = [HeaderApiKeyAuthentication]
    permission_classes = [IsAuthenticated]

    def post(self, request: Request) -> Response:
        calls.value += 1
        return Response({"user": request.user.username, "call": calls.value}, status=201)


def without_wraps(method: Any) -> Any:
    """A project's decorator that hides the method it wraps (its name included)."""

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        return method(self, *args, **kwargs)

    return wrapper


@method_decorator(idempotent, name="dispatch")
class DispatchOfAHiddenDispatch(_HeaderKeyOnly, APIView):
    @without_wraps
    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        return super().dispatch(request, *args, **kwargs)


class DispatchOfItsOwn(_HeaderKeyOnly, APIView):
    @method_decorator(idempotent)
    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        if request.headers.get("X-Early"):
            calls.value += 1
            return JsonResponse({"early": calls.value}, status=201)
        return super().dispatch(request, *args, **kwargs)


@method_decorator([idempotent, idempotent(ttl=60)], name="dispatch")
class DispatchProtectedTwice(_HeaderKeyOnly, APIView):
    pass


class HelperCalledByDispatch(APIView):
    """A helper method, decorated, that the view's own ``dispatch`` calls with Django's request."""

    def dispatch(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        if request.headers.get("X-Legacy"):
            return self.legacy(request)
        return super().dispatch(request, *args, **kwargs)

    @method_decorator(idempotent)
    def legacy(self, request: Any) -> JsonResponse:
        calls.value += 1
        return JsonResponse({"legacy": calls.value}, status=201)


@method_decorator(idempotent(required=False, methods=("POST",)), name="dispatch")
class DispatchWithItsOwnOptions(_HeaderKeyOnly, APIView):
    def patch(self, request: Request) -> Response:
        return self.post(request)


urlpatterns += [
    path("hidden-dispatch/", DispatchOfAHiddenDispatch.as_view()),
    path("own-dispatch/", DispatchOfItsOwn.as_view()),
    path("dispatch-twice/", DispatchProtectedTwice.as_view()),
    path("helper/", HelperCalledByDispatch.as_view()),
    path("dispatch-options/", DispatchWithItsOwnOptions.as_view()),
]


def key_holder(name: str) -> APIClient:
    User.objects.get_or_create(username=name)
    client = APIClient()
    key = next(key for key, owner in HEADER_API_KEYS.items() if owner == name)
    client.credentials(HTTP_X_API_KEY=key)
    return client


@pytest.mark.django_db
@pytest.mark.urls("tests.test_drf")
class DispatchPlacementTests:
    @pytest.mark.parametrize("url", ["/hidden-dispatch/", "/own-dispatch/", "/dispatch-twice/"])
    def test_each_caller_drf_authenticates_has_a_scope_of_its_own(self, url: str) -> None:
        first = post(key_holder("alice"), url)
        other = post(key_holder("bob"), url)
        nobody = post(APIClient(), url)
        retry = post(key_holder("alice"), url)

        assert first.status_code == other.status_code == 201
        assert "Idempotent-Replayed" not in other
        assert other.json()["user"] == "bob"
        assert nobody.status_code == 403  # DRF refused it: nothing replayed past permissions
        assert retry["Idempotent-Replayed"] == "true" and retry.json() == first.json()
        alice, bob = (User.objects.get(username=name).pk for name in ("alice", "bob"))
        scopes = set(IdempotencyKey.objects.values_list("scope", flat=True))
        assert scopes == {f"user:{alice}", f"user:{bob}"}
        assert calls.value == 2

    def test_a_decorated_helper_that_dispatch_calls_is_protected_where_it_is(self) -> None:
        first = post(APIClient(), "/helper/", HTTP_X_LEGACY="1")
        retry = post(APIClient(), "/helper/", HTTP_X_LEGACY="1")

        assert first.json() == {"legacy": 1}
        assert retry["Idempotent-Replayed"] == "true" and retry.json() == first.json()
        assert calls.value == 1

    def test_a_dispatch_that_answers_before_drf_is_not_protected_and_says_so(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        client = key_holder("alice")
        key = "early-key-4f2a9c"
        with caplog.at_level("WARNING", logger="django_idempotency.drf"):
            first = post(client, "/own-dispatch/", key=key, HTTP_X_EARLY="1")
            again = post(client, "/own-dispatch/", key=key, HTTP_X_EARLY="1")

        assert first.json() == {"early": 1} and again.json() == {"early": 2}
        assert not IdempotencyKey.objects.exists()
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 2
        assert "DispatchOfItsOwn.dispatch answered a request with an idempotency key" in warnings[0]
        assert key not in warnings[0]

    @override_settings(
        MIDDLEWARE=[
            "django.contrib.sessions.middleware.SessionMiddleware",
            "django.contrib.auth.middleware.AuthenticationMiddleware",
            "django_idempotency.middleware.IdempotencyMiddleware",
        ],
        IDEMPOTENCY={"REQUIRED": True},
    )
    def test_under_the_middleware_it_is_protected_once_with_its_own_options(self) -> None:
        client = key_holder("alice")
        first = post(client, "/dispatch-options/")
        retry = post(client, "/dispatch-options/")
        without_key = post(client, "/dispatch-options/", key=None)
        patched = client.patch(
            "/dispatch-options/", PAYLOAD, format="json", HTTP_IDEMPOTENCY_KEY="k-patch"
        )

        assert retry["Idempotent-Replayed"] == "true" and retry.json() == first.json()
        assert without_key.status_code == 201  # its own required=False, not the setting's
        assert patched.status_code == 201  # PATCH is not in its own methods
        assert IdempotencyKey.objects.count() == 1


class _ReplacesDjangosRequest(IdempotentMixin, APIView):
    """Replaces Django's request inside DRF's once DRF has authenticated the caller."""

    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        request._request = RequestFactory().post(
            "/",
            data="{}",
            content_type="application/json",
            HTTP_IDEMPOTENCY_KEY="key-of-the-replacement",
        )

    def post(self, request: Request) -> Response:
        return Response({"key": request.idempotency.key}, status=201)


urlpatterns += [path("replaces-djangos-request/", _ReplacesDjangosRequest.as_view())]


@pytest.mark.django_db
@pytest.mark.urls("tests.test_drf")
def test_the_key_is_read_from_the_request_the_handler_is_called_with(client):
    # What the key, the scope and the body are read from is one request: the
    # Django request inside DRF's when the handler runs, as the scope's is.
    response = client.post(
        "/replaces-djangos-request/",
        data="{}",
        content_type="application/json",
        headers={"Idempotency-Key": "key-sent"},
    )

    assert response.status_code == 201
    assert response.json() == {"key": "key-of-the-replacement"}
    assert list(IdempotencyKey.objects.values_list("key", flat=True)) == ["key-of-the-replacement"]
