"""``@idempotent`` on async views, in process through Django's ASGI test client.

The server tests (``test_uvicorn.py``) race real worker processes; these
pin down the contract row by row on every backend, SQLite included.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import django
import pytest
from asgiref.sync import async_to_sync, iscoroutinefunction
from django.http import HttpResponse, JsonResponse
from django.test import AsyncClient, AsyncRequestFactory, override_settings
from django.views import View

from django_idempotency import idempotent, signals
from django_idempotency.models import IdempotencyKey
from tests import async_views
from tests.clients import post
from tests.models import Order

pytestmark = pytest.mark.django_db(transaction=True)
ASYNC_METHOD_DECORATOR = pytest.mark.skipif(
    django.VERSION < (5, 0), reason="method_decorator supports async methods from Django 5.0"
)
State = IdempotencyKey.State
ORDERS = "/async/orders/"


@pytest.fixture
def aclient() -> AsyncClient:
    return AsyncClient(raise_request_exception=False)


@pytest.fixture
def sent() -> Iterator[list[str]]:
    names: list[str] = []
    receivers = {}
    for name in ("key_claimed", "response_replayed", "request_conflict", "fingerprint_mismatch"):

        def receiver(sender: Any, name: str = name, **kwargs: Any) -> None:
            names.append(name)

        receivers[name] = receiver
        getattr(signals, name).connect(receiver)
    yield names
    for name, receiver in receivers.items():
        getattr(signals, name).disconnect(receiver)


class AtomicModeTests:
    def test_first_request_runs_and_retry_replays(self, aclient, sent) -> None:
        first = post(aclient, ORDERS)
        retry = post(aclient, ORDERS)

        assert first.status_code == 201
        assert "Idempotent-Replayed" not in first
        assert retry.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert retry["Location"] == first["Location"]
        assert retry.content == first.content
        assert async_views.calls.value == 1
        assert sent == ["key_claimed", "response_replayed"]
        # The async ORM and sync_to_async both wrote, inside the claim's transaction.
        assert json.loads(first.content)["in_transaction"] is True
        assert Order.objects.count() == 2
        assert IdempotencyKey.objects.get().state == State.COMPLETED

    def test_handler_that_writes_then_raises_commits_nothing(self, aclient) -> None:
        failed = post(aclient, ORDERS, key="boom", **{"raise": True})
        assert failed.status_code == 500
        assert Order.objects.count() == 0
        assert IdempotencyKey.objects.count() == 0

        retry = post(aclient, ORDERS, key="boom")
        again = post(aclient, ORDERS, key="boom")
        assert retry.status_code == 201
        assert again["Idempotent-Replayed"] == "true"
        assert async_views.calls.value == 2
        assert Order.objects.count() == 2

    def test_request_idempotency_is_set_for_the_coroutine(self, aclient) -> None:
        body = json.loads(post(aclient, ORDERS, key="info").content)
        assert body["key"] == "info"
        assert body["scope"] == "anonymous"
        assert len(body["payment"]) == 64

    @ASYNC_METHOD_DECORATOR
    def test_class_based_async_view_through_method_decorator(self, aclient) -> None:
        assert iscoroutinefunction(async_views.OrderView.post)
        first = post(aclient, "/async/orders/class-based/")
        retry = post(aclient, "/async/orders/class-based/")
        assert first.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert async_views.calls.value == 1

    def test_different_body_same_key_is_422(self, aclient, sent) -> None:
        post(aclient, ORDERS, key="same")
        other = post(aclient, ORDERS, key="same", item="lamp")
        assert other.status_code == 422
        assert other["Content-Type"] == "application/problem+json"
        assert "fingerprint_mismatch" in sent
        assert async_views.calls.value == 1

    def test_bad_and_missing_keys_are_400(self, aclient) -> None:
        assert post(aclient, ORDERS, key="").status_code == 400
        missing = post(aclient, "/async/orders/required/", key=None)
        assert missing.status_code == 400
        assert missing["Content-Type"] == "application/problem+json"
        assert async_views.calls.value == 0
        assert Order.objects.count() == 0

    def test_without_a_key_the_view_runs_unprotected(self, aclient) -> None:
        post(aclient, ORDERS, key=None)
        second = post(aclient, ORDERS, key=None)
        assert second.status_code == 201
        assert json.loads(second.content)["in_transaction"] is False
        assert async_views.calls.value == 2
        assert IdempotencyKey.objects.count() == 0

    def test_other_methods_pass_through(self, aclient) -> None:
        response = async_to_sync(aclient.put)(
            "/async/orders/",
            b"{}",
            content_type="application/json",
            headers={"Idempotency-Key": "p"},
        )
        assert response.status_code == 201
        assert IdempotencyKey.objects.count() == 0

    @override_settings(IDEMPOTENCY={"ENABLED": False})
    def test_disabled_passes_through_required_included(self, aclient) -> None:
        assert post(aclient, "/async/orders/required/", key=None).status_code == 201
        assert post(aclient, ORDERS, key="off").status_code == 201
        assert post(aclient, ORDERS, key="off").status_code == 201
        assert IdempotencyKey.objects.count() == 0


class LeaseModeTests:
    def test_claim_commits_first_and_the_handler_runs_outside(self, aclient) -> None:
        first = post(aclient, "/async/orders/lease/", key="lease")
        retry = post(aclient, "/async/orders/lease/", key="lease")

        assert first.status_code == 201
        assert json.loads(first.content)["in_transaction"] is False
        assert retry["Idempotent-Replayed"] == "true"
        record = IdempotencyKey.objects.get()
        assert record.state == State.COMPLETED
        assert record.owner_token != ""
        assert async_views.calls.value == 1

    def test_checkpoint_and_heartbeat_are_awaited_in_an_async_view(self, aclient) -> None:
        first = post(aclient, "/async/orders/checkpointing/", key="steps")

        assert first.status_code == 201, first.content
        order = json.loads(first.content)["order"]
        assert Order.objects.filter(pk=order, item="async-checkpointed").exists()
        record = IdempotencyKey.objects.get()
        assert record.state == State.COMPLETED
        assert record.checkpoints == {"order": {"id": order}}

    def test_handler_that_raises_releases_the_key(self, aclient) -> None:
        failed = post(aclient, "/async/orders/lease/", key="lease", **{"raise": True})
        assert failed.status_code == 500
        # Lease mode: the effect is the handler's own; the key is given back.
        assert IdempotencyKey.objects.count() == 0
        assert post(aclient, "/async/orders/lease/", key="lease").status_code == 201
        assert async_views.calls.value == 2


class DecoratorTests:
    def test_async_wrapper_is_a_coroutine_function_and_keeps_the_name(self) -> None:
        assert iscoroutinefunction(async_views.create_order)
        assert async_views.create_order.__name__ == "create_order"

    def test_options_are_checked_when_an_async_view_is_decorated(self) -> None:
        with pytest.raises(TypeError, match="Unknown idempotency option"):

            @idempotent(atomic=True, tll=5)
            async def view(request: Any) -> HttpResponse:
                return HttpResponse()

    def test_async_lease_views_stay_out_of_atomic_requests(self) -> None:
        assert async_views.create_order_lease._non_atomic_requests  # type: ignore[attr-defined]
        assert "default" not in async_views.create_order._non_atomic_requests  # type: ignore[attr-defined]

    def test_as_view_of_an_async_class_based_view_gets_an_async_wrapper(self) -> None:
        class Whole(View):
            async def post(self, request: Any) -> HttpResponse:
                return HttpResponse(status=201)

        assert iscoroutinefunction(idempotent(Whole.as_view()))


class CancellationTests:
    """A request cancelled while its handler runs (the client went away): SPEC §4.6."""

    @pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "lease"])
    def test_the_handler_runs_to_its_end_and_its_response_is_stored(self, atomic: bool) -> None:
        # The handler may already have acted: it must finish and be stored,
        # and the key must never be given back for a retry to run it again.
        async def scenario() -> None:
            started, go = asyncio.Event(), asyncio.Event()

            @idempotent(atomic=atomic)
            async def view(request: Any) -> HttpResponse:
                started.set()
                await go.wait()
                order = await Order.objects.acreate(item="cancelled")
                return JsonResponse({"id": order.pk}, status=201)

            request = AsyncRequestFactory().post(
                "/", b"{}", content_type="application/json", headers={"Idempotency-Key": "k"}
            )
            task = asyncio.ensure_future(view(request))
            await started.wait()
            task.cancel()
            for _ in range(5):
                await asyncio.sleep(0.01)
            assert not task.done(), "the cancellation stopped the handler"
            go.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            request.close()  # as Django's handler does, whatever became of the view

        async_to_sync(scenario)()

        assert Order.objects.filter(item="cancelled").count() == 1
        record = IdempotencyKey.objects.get()
        assert record.state == State.COMPLETED
        assert record.status_code == 201
