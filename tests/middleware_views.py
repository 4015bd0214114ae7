"""Sync views for the middleware tests: plain, exempt, one that looks at its own claim,
one with its own transactions, one that raises after writing, one whose response fails to
render, one that authenticates itself."""

from __future__ import annotations

import json
import threading
from typing import Any

from asgiref.sync import sync_to_async
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied
from django.db import connection, transaction
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    HttpResponseRedirect,
    JsonResponse,
)
from django.template.response import TemplateResponse
from django.utils.decorators import method_decorator
from django.views import View
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import AllowAny, IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import idempotency_exempt, idempotent
from django_idempotency.contrib.drf import IdempotentMixin
from django_idempotency.models import IdempotencyKey
from tests.models import Order
from tests.views import _create_order, _unrenderable_order, calls


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


def api_client_scope(request: HttpRequest) -> str:
    """A scope of the project's own: the API client, from a header the view trusts."""
    return "client:" + request.headers.get("X-Api-Key", "none")


# Protected with options the middleware does not have, behind decorators
# that hide the mark: the middleware must not protect them with its own.
hidden_scoped = _without_wraps(idempotent(scope=api_client_scope)(create_order))
# The fix the refusal names: the middleware leaves it alone.
hidden_scoped_exempt = idempotency_exempt(
    _without_wraps(idempotent(scope=api_client_scope)(create_order))
)
hidden_lease = _without_wraps(idempotent(atomic=False)(create_order))
# A store option the middleware, which has none, would not apply.
hidden_store = _without_wraps(idempotent(store=lambda response: False)(create_order))
# The middleware protects this one in lease mode (it sees non_atomic_requests).
hidden_scoped_outer_lease = transaction.non_atomic_requests(
    _without_wraps(idempotent(scope=api_client_scope)(create_order))
)


class _HidingWrapper:
    """A project decorator written as a callable class, without update_wrapper."""

    def __init__(self, view):  # type: ignore[no-untyped-def]
        self.view = view

    def __call__(self, request, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self.view(request, *args, **kwargs)


hidden_scoped_by_class = _HidingWrapper(idempotent(scope=api_client_scope)(create_order))


@idempotent(scope=api_client_scope)
async def _create_order_async(request: HttpRequest) -> HttpResponse:
    return await sync_to_async(_create_order)(request)


async def hidden_scoped_async(request: HttpRequest) -> HttpResponse:
    """An async project decorator without functools.wraps."""
    return await _create_order_async(request)


class _Open:
    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]


class ApiClientOrderAPIView(IdempotentMixin, _Open, APIView):
    idempotency_scope = staticmethod(api_client_scope)

    def post(self, request: Request) -> HttpResponse:
        return _create_order(request)


class DefaultOrderAPIView(IdempotentMixin, _Open, APIView):
    def post(self, request: Request) -> HttpResponse:
        return _create_order(request)


hidden_drf_scoped = _without_wraps(ApiClientOrderAPIView.as_view())
hidden_drf_default = _without_wraps(DefaultOrderAPIView.as_view())


class ApiKeyAuthentication(BaseAuthentication):
    """Credentials only DRF reads: the caller named by its ``X-Api-Key`` header."""

    def authenticate(self, request: Request) -> tuple[Any, None] | None:
        name = request.headers.get("X-Api-Key")
        return None if name is None else (User(username=name), None)


class DjangoAnswersAPIView(APIView):
    """A DRF view without the mixin, answering with Django's own responses (or DRF's)."""

    authentication_classes = [ApiKeyAuthentication]
    permission_classes = [IsAuthenticated]

    def post(self, request: Request) -> HttpResponseBase:
        calls.increment()
        owner = request.user.username
        Order.objects.create(item=f"secret of {owner}")
        answer = request.query_params.get("answer")
        if answer == "redirect":
            return HttpResponseRedirect(f"/orders/private-{owner}/")
        if answer == "drf":
            return Response({"owner": owner}, status=201)
        return JsonResponse({"owner": owner}, status=201)


#: Hidden from the middleware; and, inside @idempotent, from the decorator too.
hidden_drf_plain = _without_wraps(DjangoAnswersAPIView.as_view())
decorated_hidden_drf_plain = idempotent(_without_wraps(DjangoAnswersAPIView.as_view()))


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


def create_order_unrenderable(request: HttpRequest) -> TemplateResponse:
    """Write, then return a template response that Django's handler fails to render."""
    return _unrenderable_order(request)


def create_order_token_auth(request: HttpRequest) -> JsonResponse:
    """Authenticate by a bearer token inside the view, as non-DRF frameworks do."""
    calls.increment()
    caller = request.headers.get("Authorization", "").removeprefix("Bearer ")
    if not caller:
        return JsonResponse({"detail": "no credentials"}, status=401)
    order = Order.objects.create(item=f"for {caller}")
    return JsonResponse({"id": order.pk, "caller": caller}, status=201)


class ExceptionAsBadRequestMiddleware:
    """Turns any exception a view raises into a 400, as an API's error middleware may."""

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> Any:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse:
        return JsonResponse({"error": str(exception)}, status=400)


class ParseJSONMiddleware:
    """Reads a JSON body off the stream, keeping only what it parsed, as ``request.data``."""

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> Any:
        if request.content_type == "application/json":
            request.data = json.loads(request.read())  # type: ignore[attr-defined]
        return self.get_response(request)


def create_order_from_data(request: HttpRequest) -> HttpResponse:
    """Orders from the body ``ParseJSONMiddleware`` parsed: the stream itself is spent."""
    calls.increment()
    data = request.data  # type: ignore[attr-defined]
    order = Order.objects.create(item=data["item"], quantity=data.get("quantity", 1))
    return JsonResponse({"id": order.pk, "quantity": order.quantity}, status=201)


create_order_from_data_decorated = idempotent(create_order_from_data)


class LowerCaseMethodMiddleware:
    """Sets the method in lower case, as a project's method-override middleware may.

    Django's views and DRF's dispatch on it whatever its case: ``post`` runs.
    """

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> Any:
        request.method = (request.method or "").lower()
        return self.get_response(request)
