"""A server-rendered checkout, as a shop writes it: the views of ``tests/test_browsers.py``.

``GET`` renders the form (with ``{% idempotency_key_field %}``, or without
it for the control); a valid ``POST`` creates an ``Order`` and redirects to
its page; an empty item re-renders the form with an error (and a new key).
Every variant runs the same code under another adapter or option.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from django.contrib.auth import login
from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse, HttpResponseBase, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.utils.decorators import method_decorator
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import idempotent
from django_idempotency.contrib.drf import IdempotentMixin
from tests.models import Order

#: The payment step's deliberate slowness, in seconds: what makes a double click two POSTs.
SLOW_SECONDS = 1.0
#: Where the browser servers append one line per POST they receive (``CountPosts``).
POST_LOG_ENV = "IDEMPOTENCY_TEST_POST_LOG"
#: A file the gated view waits for before it finishes: the test creates it
#: once the duplicate has been answered, so the two always overlap.
GATE_ENV = "IDEMPOTENCY_TEST_GATE"
#: The longest the gated view waits for its gate (a test that failed first).
GATE_TIMEOUT = 20.0


def wait_for_gate() -> None:
    gate = os.environ[GATE_ENV]
    deadline = time.monotonic() + GATE_TIMEOUT
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)


def _form(request: HttpRequest, *, tagged: bool = True, **context: Any) -> HttpResponse:
    # A session from the first render on, as a shop's cart has: the scope of a
    # guest's POSTs (SPEC 9).
    request.session.setdefault("cart", "book")
    context = {"tagged": tagged, "action": request.path, "item": "", **context}
    return render(request, "browser/checkout.html", context)


def checkout(
    request: HttpRequest, *, tagged: bool = True, slow: bool = False, gated: bool = False
) -> HttpResponse:
    if request.method != "POST":
        return _form(request, tagged=tagged, upload="upload" in request.GET)
    item = request.POST.get("item", "").strip()
    if not item:
        return _form(request, tagged=tagged, error="Choose an item.")
    receipt = request.FILES.get("receipt")
    if receipt is not None:
        item = f"{item}|{receipt.name}|{len(receipt.read())}"
    if gated:
        wait_for_gate()  # until the test has seen the duplicate answered
    elif slow:
        time.sleep(SLOW_SECONDS)  # the payment provider's round trip
    order = Order.objects.create(item=item)
    return HttpResponseRedirect(reverse("browser-order", args=[order.pk]))


def order(request: HttpRequest, pk: int) -> HttpResponse:
    return render(request, "browser/order.html", {"order": get_object_or_404(Order, pk=pk)})


def ping(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


def signing_up(request: HttpRequest) -> HttpResponse:
    """The checkout that signs the guest up and logs them in first, as a shop's may.

    ``login()`` rotates the session: the cookie the guest's browser sent names a session
    the store no longer has, before the first request has even answered.
    """
    if request.method == "POST":
        login(request, User.objects.create_user(f"guest-{uuid.uuid4().hex}"))
    return checkout(request)


decorated = idempotent(checkout)
required = idempotent(required=True)(checkout)
lease = idempotent(atomic=False)(checkout)
signing_up_atomic = idempotent(signing_up)
signing_up_lease = idempotent(atomic=False)(signing_up)


@idempotent
def slow(request: HttpRequest) -> HttpResponse:
    return checkout(request, slow=True)


@idempotent(atomic=False)
def slow_lease(request: HttpRequest) -> HttpResponse:
    """The slow checkout in lease mode: a duplicate gets 409 while the first runs.

    It runs until the test opens its gate, so that the duplicate always
    meets it running, however loaded the machine.
    """
    return checkout(request, gated=True)


@idempotent
def slow_untagged(request: HttpRequest) -> HttpResponse:
    """The same slow checkout, its form rendered without the tag: the control."""
    return checkout(request, tagged=False, slow=True)


@idempotent
async def async_checkout(request: HttpRequest) -> HttpResponse:
    from asgiref.sync import sync_to_async

    response: HttpResponse = await sync_to_async(checkout)(request)
    return response


class ApiCheckout(IdempotentMixin, APIView):
    """A DRF view behind a plain form: its form and multipart parsers."""

    parser_classes = [FormParser, MultiPartParser]
    permission_classes = [AllowAny]
    authentication_classes: list[Any] = []

    def post(self, request: Request) -> Response:
        receipt = request.data.get("receipt")
        item = str(request.data.get("item", ""))
        if receipt is not None:
            item = f"{item}|{receipt.name}|{len(receipt.read())}"
        created = Order.objects.create(item=item)
        return Response({"order": created.pk}, status=201)


@method_decorator(idempotent, name="dispatch")
class ClosedApiCheckout(APIView):
    """A DRF view whose own dispatch answers before DRF runs: the shop is closed."""

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        return HttpResponse("closed", status=503)


class CountPosts:
    """Middleware of the browser servers: one line per POST, as it arrives, before any view."""

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        path = os.environ.get(POST_LOG_ENV)
        if path and request.method == "POST":
            with open(path, "a") as log:
                log.write(f"{request.path}\n")
        return self.get_response(request)
