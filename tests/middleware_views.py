"""Sync views for the middleware tests: plain, exempt, one that looks at its own claim,
one with its own transactions, one that raises after writing, one that authenticates itself."""

from __future__ import annotations

import threading

from django.core.exceptions import PermissionDenied
from django.db import connection, transaction
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.utils.decorators import method_decorator
from django.views import View

from django_idempotency import idempotency_exempt, idempotent
from django_idempotency.models import IdempotencyKey
from tests.models import Order
from tests.views import _create_order, calls


def create_order(request: HttpRequest) -> HttpResponse:
    return _create_order(request)


@idempotency_exempt
def create_order_exempt(request: HttpRequest) -> HttpResponse:
    return _create_order(request)


class ExemptOrderView(View):
    @method_decorator(idempotency_exempt)
    def post(self, request: HttpRequest) -> HttpResponse:
        return _create_order(request)


def _without_wraps(view):  # type: ignore[no-untyped-def]
    # A third-party decorator that does not copy attributes: the middleware
    # cannot see that the view inside protects itself.
    def outer(request, *args, **kwargs):  # type: ignore[no-untyped-def]
        return view(request, *args, **kwargs)

    return outer


hidden_decorated = _without_wraps(idempotent(create_order))


def claim_seen_from_outside(request: HttpRequest) -> JsonResponse:
    """Whether another connection sees this request's claim: it does once committed."""
    seen: list[bool] = []

    def look() -> None:
        try:
            seen.append(IdempotencyKey.objects.filter(key=request.idempotency.key).exists())  # type: ignore[attr-defined]
        finally:
            connection.close()

    thread = threading.Thread(target=look)
    thread.start()
    thread.join()
    return JsonResponse(
        {"claim_committed": seen[0], "in_atomic_block": connection.in_atomic_block}, status=201
    )


@transaction.non_atomic_requests
def create_order_durable(request: HttpRequest) -> HttpResponse:
    """A view that manages its own transactions: a durable block cannot nest in another."""
    with transaction.atomic(durable=True):
        return _create_order(request)


def create_order_then_refuse(request: HttpRequest, refusal: str) -> HttpResponse:
    """Write, then raise an exception Django turns into a 403 or a 404."""
    _create_order(request)
    if refusal == "forbidden":
        raise PermissionDenied("not yours")
    raise Http404("gone")


def create_order_token_auth(request: HttpRequest) -> JsonResponse:
    """Authenticate by a bearer token inside the view, as non-DRF frameworks do."""
    calls.increment()
    caller = request.headers.get("Authorization", "").removeprefix("Bearer ")
    if not caller:
        return JsonResponse({"detail": "no credentials"}, status=401)
    order = Order.objects.create(item=f"for {caller}")
    return JsonResponse({"id": order.pk, "caller": caller}, status=201)
