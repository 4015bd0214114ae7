"""The views of the endings table (``tests/test_endings.py``): one handler under every adapter.

Every view runs the same handler. It counts its run outside the database (a
line in ``<key>.runs`` in the control directory) and inside it (an ``Order``
named after the key), then ends as the query string's ``ending`` says, on
its first run only: a retry is the same request (same fingerprint), and its
run answers a plain 201. The endings that need the test to act while the
handler is busy report ``<key>.held`` (the worker's PID and the handler's
database connection) and wait for ``<key>.go``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from adrf.views import APIView as AsyncAPIView
from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.db import transaction
from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.template import engines
from django.template.response import SimpleTemplateResponse
from django.utils.decorators import method_decorator
from django.views import View
from rest_framework.decorators import api_view, permission_classes
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView
from rest_framework.viewsets import ViewSet

from django_idempotency import idempotent
from django_idempotency.contrib.drf import IdempotentMixin
from tests.endings_effects import (
    HOLDING,
    ahold,
    count_run,
    hold,
    kill_own_connection,
    server_connection_id,
)
from tests.models import Order

NOT_RELEASED = {"detail": "the test never gave the go-ahead"}


def ending_of(request: HttpRequest) -> str:
    return request.GET.get("ending", "ok")


def key_of(request: HttpRequest) -> str:
    # A browser's form sends its key in a field (SPEC 9), anyone else in the header.
    return request.headers.get("Idempotency-Key") or request.POST["idempotency_key"]


def payload(key: str, run: int, order: Order) -> dict[str, Any]:
    return {"key": key, "run": run, "order": order.pk, "pid": os.getpid()}


def status_of(ending: str, run: int) -> int:
    """The status the handler answers with: the ending's on the first run, else 201."""
    if run > 1:
        return 201
    return {"stored_4xx": 400, "5xx": 503, "transient": 429, "store_refused": 202}.get(ending, 201)


def kept(response: HttpResponseBase) -> bool:
    """Every view's ``store`` option: a 202 (the ``store_refused`` ending) never completes a key."""
    return response.status_code != 202


# The handler, sync and async. ``respond`` builds the answer (a Django or a DRF
# response); ``slow`` builds one whose rendering holds (the window after the
# handler returned and before its response is stored).


def run_handler(request: HttpRequest, respond: Any, slow: Any) -> HttpResponseBase:
    key, ending = key_of(request), ending_of(request)
    run = count_run(key)
    order = Order.objects.create(item=key)
    data = payload(key, run, order)
    if run > 1:
        return respond(data, 201)
    if ending in HOLDING:
        server_id = server_connection_id() if ending == "db_kill_mid" else None
        if not hold(key, connection=server_id):
            return respond(NOT_RELEASED, 503)
        if ending == "db_kill_mid":
            # The connection was killed while the handler waited: this fails.
            data["orders"] = Order.objects.filter(item=key).count()
    if ending == "raises":
        raise RuntimeError("the handler failed after writing")
    if ending == "db_kill_after":
        kill_own_connection()
    if ending == "disconnect_after":
        return slow(key, data)
    return respond(data, status_of(ending, run))


async def arun_handler(request: HttpRequest, respond: Any, slow: Any) -> HttpResponseBase:
    key, ending = key_of(request), ending_of(request)
    run = count_run(key)
    order = await Order.objects.acreate(item=key)
    data = payload(key, run, order)
    if run > 1:
        return respond(data, 201)
    if ending in HOLDING:
        server_id = None
        if ending == "db_kill_mid":
            server_id = await sync_to_async(server_connection_id)()
        if not await ahold(key, connection=server_id):
            return respond(NOT_RELEASED, 503)
        if ending == "db_kill_mid":
            data["orders"] = await Order.objects.filter(item=key).acount()
    if ending == "raises":
        raise RuntimeError("the handler failed after writing")
    if ending == "db_kill_after":
        await sync_to_async(kill_own_connection)()
    if ending == "disconnect_after":
        return slow(key, data)
    return respond(data, status_of(ending, run))


def django_response(data: dict[str, Any], status: int) -> HttpResponse:
    return JsonResponse(data, status=status)


def drf_response(data: dict[str, Any], status: int) -> Response:
    return Response(data, status=status)


class SlowTemplateResponse(SimpleTemplateResponse):
    """A template response whose rendering (after the handler returned) holds."""

    def __init__(self, key: str, data: dict[str, Any]) -> None:
        template = engines["django"].from_string("{{ body|safe }}")
        context = {"body": json.dumps(data)}
        super().__init__(template, context, content_type="application/json", status=201)
        self.key = key

    @property
    def rendered_content(self) -> str:
        hold(self.key, what="rendering")
        return super().rendered_content


class SlowResponse(Response):
    """A DRF response whose rendering (after the handler returned) holds."""

    def __init__(self, key: str, data: dict[str, Any]) -> None:
        super().__init__(data, status=201)
        self.key = key

    @property
    def rendered_content(self) -> Any:
        hold(self.key, what="rendering")
        return super().rendered_content


def plain_handler(request: HttpRequest) -> HttpResponseBase:
    return run_handler(request, django_response, SlowTemplateResponse)


async def async_plain_handler(request: HttpRequest) -> HttpResponseBase:
    return await arun_handler(request, django_response, SlowTemplateResponse)


def drf_handler(request: Request) -> HttpResponseBase:
    return run_handler(request, drf_response, SlowResponse)


# The rows' views: one per adapter and mode, routed as /endings/<row>/<mode>/.

MODES = {"atomic": True, "lease": False}


def function_view(atomic: bool) -> Any:
    # No store option: the table runs every ending without one here too.
    @idempotent(atomic=atomic)
    def view(request: HttpRequest) -> HttpResponseBase:
        return plain_handler(request)

    return view


def class_based_view(atomic: bool) -> Any:
    class EndingsView(View):
        @method_decorator(idempotent(atomic=atomic, store=kept))
        def post(self, request: HttpRequest) -> HttpResponseBase:
            return plain_handler(request)

    return EndingsView.as_view()


def drf_api_view(atomic: bool) -> Any:
    @api_view(["POST"])
    @permission_classes([AllowAny])
    @idempotent(atomic=atomic, store=kept)
    def view(request: Request) -> HttpResponseBase:
        return drf_handler(request)

    return view


class _Open:
    authentication_classes: list[type] = []
    permission_classes = [AllowAny]


def mixin_api_view(atomic: bool) -> Any:
    class EndingsAPIView(IdempotentMixin, _Open, APIView):
        idempotency_atomic = atomic
        idempotency_store = staticmethod(kept)

        def post(self, request: Request) -> HttpResponseBase:
            return drf_handler(request)

    return EndingsAPIView.as_view()


def drf_dispatch_view(atomic: bool) -> Any:
    @method_decorator(idempotent(atomic=atomic, store=kept), name="dispatch")
    class EndingsDispatchAPIView(_Open, APIView):
        def post(self, request: Request) -> HttpResponseBase:
            return drf_handler(request)

    return EndingsDispatchAPIView.as_view()


def adrf_dispatch_view(atomic: bool) -> Any:
    @method_decorator(idempotent(atomic=atomic, store=kept), name="dispatch")
    class EndingsAsyncDispatchAPIView(_Open, AsyncAPIView):
        async def post(self, request: Request) -> HttpResponseBase:
            return await arun_handler(request, drf_response, SlowResponse)

    return EndingsAsyncDispatchAPIView.as_view()


def mixin_viewset(atomic: bool) -> Any:
    class EndingsViewSet(IdempotentMixin, _Open, ViewSet):
        idempotency_atomic = atomic
        idempotency_store = staticmethod(kept)

        def create(self, request: Request) -> HttpResponseBase:
            return drf_handler(request)

    return EndingsViewSet.as_view({"post": "create"})


def adrf_view(atomic: bool) -> Any:
    class EndingsAsyncAPIView(IdempotentMixin, _Open, AsyncAPIView):
        idempotency_atomic = atomic
        idempotency_store = staticmethod(kept)

        async def post(self, request: Request) -> HttpResponseBase:
            return await arun_handler(request, drf_response, SlowResponse)

    return EndingsAsyncAPIView.as_view()


def async_function_view(atomic: bool) -> Any:
    @idempotent(atomic=atomic, store=kept)
    async def view(request: HttpRequest) -> HttpResponseBase:
        return await async_plain_handler(request)

    return view


def async_class_based_view(atomic: bool) -> Any:
    class EndingsAsyncView(View):
        @method_decorator(idempotent(atomic=atomic, store=kept))
        async def post(self, request: HttpRequest) -> HttpResponseBase:
            return await async_plain_handler(request)

    return EndingsAsyncView.as_view()


def async_dispatch_view(atomic: bool) -> Any:
    @method_decorator(idempotent(atomic=atomic, store=kept), name="dispatch")
    class EndingsAsyncDispatchView(View):
        async def post(self, request: HttpRequest) -> HttpResponseBase:
            return await async_plain_handler(request)

    return EndingsAsyncDispatchView.as_view()


def middleware_view(atomic: bool) -> Any:
    """Undecorated: IdempotencyMiddleware protects it, in lease mode when non-atomic.

    The window after it returned is held by :class:`SlowResponseMiddleware`.
    """

    def view(request: HttpRequest) -> HttpResponseBase:
        return run_handler(request, django_response, middleware_slow_response)

    return view if atomic else transaction.non_atomic_requests(view)


def async_middleware_view(atomic: bool) -> Any:
    """:func:`middleware_view`, written ``async def``."""

    async def view(request: HttpRequest) -> HttpResponseBase:
        return await arun_handler(request, django_response, middleware_slow_response)

    return view if atomic else transaction.non_atomic_requests(view)


def middleware_drf_view(atomic: bool) -> Any:
    """A DRF view that protects nothing itself: the middleware calls its build instead."""

    class EndingsMiddlewareAPIView(_Open, APIView):
        def post(self, request: Request) -> HttpResponseBase:
            return drf_handler(request)

    view = EndingsMiddlewareAPIView.as_view()
    return view if atomic else transaction.non_atomic_requests(view)


def middleware_slow_response(key: str, data: dict[str, Any]) -> HttpResponse:
    response = JsonResponse(data, status=201)
    response.hold_key = key  # type: ignore[attr-defined]
    return response


class SlowResponseMiddleware:
    """Listed after IdempotencyMiddleware: holds a response the view marked, sync or async.

    So a middleware view's response is held after the view returned and
    before IdempotencyMiddleware stores it.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if self.async_mode:
            return self._acall(request)
        response = self.get_response(request)
        key = getattr(response, "hold_key", None)
        if key is not None:
            hold(key, what="rendering")
        return response

    async def _acall(self, request: HttpRequest) -> HttpResponseBase:
        response = await self.get_response(request)
        key = getattr(response, "hold_key", None)
        if key is not None:
            await ahold(key, what="rendering")
        return response


#: (row, builder of its view for one mode). The same middleware views serve
#: the middleware rows on both servers.
ROWS = {
    "function": function_view,
    "class_based": class_based_view,
    "api_view": drf_api_view,
    "mixin_apiview": mixin_api_view,
    "mixin_viewset": mixin_viewset,
    "drf_dispatch": drf_dispatch_view,
    "adrf": adrf_view,
    "adrf_dispatch": adrf_dispatch_view,
    "async_function": async_function_view,
    "async_class_based": async_class_based_view,
    "async_dispatch": async_dispatch_view,
    "middleware": middleware_view,
    "async_middleware": async_middleware_view,
    "middleware_drf": middleware_drf_view,
}
