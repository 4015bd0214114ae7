"""Protected views the suite drives; each writes one Order as its effect."""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from pathlib import Path

from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.template import engines
from django.template.response import TemplateResponse
from django.utils.decorators import method_decorator
from django.views import View
from rest_framework.decorators import api_view, permission_classes
from rest_framework.permissions import AllowAny
from rest_framework.response import Response

from django_idempotency import idempotent, idempotent_function
from tests.models import Order


class CallCounter:
    """How many times handlers ran, across threads: replays must not add to it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def increment(self) -> None:
        with self._lock:
            self.value += 1

    def reset(self) -> None:
        with self._lock:
            self.value = 0


calls = CallCounter()
# Set by a test to make the next handler run fail after writing, once.
fail_next = threading.Event()


def _create_order(request: HttpRequest) -> HttpResponse:
    """Write the effect, optionally hold the transaction open, then answer.

    The JSON body may ask for ``status`` (the answer's status code) and
    ``raise`` (fail after writing); the query string may ask to ``hold``
    the transaction open for that many seconds.
    """
    calls.increment()
    data = json.loads(request.body or b"{}")
    order = Order.objects.create(item=data.get("item", "widget"), quantity=data.get("quantity", 1))
    hold = float(request.GET.get("hold", 0))
    if hold:
        time.sleep(hold)
    if data.get("raise") or _consume(fail_next):
        raise RuntimeError("handler failed after writing")
    response = JsonResponse({"id": order.pk, "item": order.item}, status=data.get("status", 201))
    response["Location"] = f"/orders/{order.pk}/"
    response["X-Request-Secret"] = "not-in-the-allowlist"
    response.set_cookie("handler_cookie", "handler-cookie")
    return response


def _consume(flag: threading.Event) -> bool:
    if flag.is_set():
        flag.clear()
        return True
    return False


def create_order_unprotected(request: HttpRequest) -> HttpResponse:
    return _create_order(request)


@idempotent
def create_order(request: HttpRequest) -> HttpResponse:
    return _create_order(request)


@idempotent(required=True)
def create_order_required(request: HttpRequest) -> HttpResponse:
    return _create_order(request)


@idempotent(atomic=False)
def create_order_lease(request: HttpRequest) -> HttpResponse:
    return _create_order(request)


@idempotent(wait=0.2)
def create_order_short_wait(request: HttpRequest) -> HttpResponse:
    return _create_order(request)


@idempotent
def binary_response(request: HttpRequest) -> HttpResponse:
    calls.increment()
    Order.objects.create(item="binary")
    return HttpResponse(bytes(range(256)) * 4, content_type="application/octet-stream")


@idempotent
def large_response(request: HttpRequest) -> HttpResponse:
    calls.increment()
    Order.objects.create(item="large")
    size = int(request.GET.get("size", 2_000_000))
    response = HttpResponse(b"x" * size, content_type="application/octet-stream", status=201)
    response["Location"] = "/exports/1/"
    # Headers that describe the body: a replay without the body must drop them.
    response["Content-Encoding"] = "gzip"
    response["Content-Disposition"] = 'attachment; filename="export.csv.gz"'
    response["Content-Language"] = "en"
    response["ETag"] = '"export-1"'
    response["Last-Modified"] = "Tue, 01 Dec 2026 00:00:00 GMT"
    return response


@idempotent
def streaming_response(request: HttpRequest) -> StreamingHttpResponse:
    calls.increment()
    Order.objects.create(item="stream")
    return StreamingHttpResponse(iter([b"chunk-1,", b"chunk-2"]), content_type="text/csv")


@idempotent
def idempotency_info(request: HttpRequest) -> JsonResponse:
    calls.increment()
    info = request.idempotency  # type: ignore[attr-defined]
    return JsonResponse(
        {
            "key": info.key,
            "scope": info.scope,
            "fingerprint": info.fingerprint,
            "payment": info.derive("payment"),
        }
    )


@idempotent
def create_order_token_auth(request: HttpRequest) -> JsonResponse:
    """Authenticate the caller by a bearer token in the view, as non-DRF API frameworks do."""
    calls.increment()
    caller = request.headers.get("Authorization", "").removeprefix("Bearer ")
    if not caller:
        return JsonResponse({"detail": "no credentials"}, status=401)
    order = Order.objects.create(item=f"for {caller}")
    return JsonResponse({"id": order.pk, "caller": caller}, status=201)


class OrderView(View):
    @method_decorator(idempotent)
    def post(self, request: HttpRequest) -> HttpResponse:
        return _create_order(request)


@api_view(["POST"])
@permission_classes([AllowAny])
@idempotent
def api_create_order(request):  # type: ignore[no-untyped-def]
    calls.increment()
    order = Order.objects.create(item=request.data.get("item", "widget"))
    return Response({"id": order.pk, "item": order.item}, status=201)


@method_decorator(idempotent(atomic=False), name="post")
class LeaseOrderView(View):
    """The class-based lease view the docs show, which ATOMIC_REQUESTS cannot see is excluded."""

    def post(self, request: HttpRequest) -> HttpResponse:
        return _create_order(request)


# Set by a test to make the next request fail after its lease view returned,
# once: at its transaction's COMMIT, or later in the view's dispatch.
fail_at_commit = threading.Event()
fail_after_view = threading.Event()


class LeaseThenFailView(View):
    """A lease view whose request can still fail after the protected handler returned."""

    def dispatch(self, request: HttpRequest, *args: object, **kwargs: object) -> HttpResponse:
        response = super().dispatch(request, *args, **kwargs)
        if _consume(fail_after_view):
            raise RuntimeError("the request failed after the view")
        return response

    @method_decorator(idempotent(atomic=False))
    def post(self, request: HttpRequest) -> HttpResponse:
        response = _create_order(request)
        if _consume(fail_at_commit):
            # PostgreSQL checks Django's foreign keys (DEFERRABLE INITIALLY
            # DEFERRED) only at COMMIT, after the view has returned.
            with connection.cursor() as cursor:
                cursor.execute(
                    "INSERT INTO auth_user_groups (user_id, group_id) VALUES (%s, %s)",
                    [999999, 999999],
                )
        return response


@idempotent_function(key=lambda label: f"function-{label}", atomic=False)
def charge_in_a_request(label: str) -> dict:
    """A lease-mode function a view calls: its value is stored in the request's transaction."""
    calls.increment()
    return {"order": Order.objects.create(item=label).pk}


def function_then_fail(request: HttpRequest) -> JsonResponse:
    """An unprotected view that calls :func:`charge_in_a_request`, then may fail."""
    value = charge_in_a_request(request.GET["label"])
    if _consume(fail_after_view):
        raise RuntimeError("the request failed after the function")
    return JsonResponse(value)


class LeaseThenFailOnceView(LeaseThenFailView):
    """:class:`LeaseThenFailView` in a server's process: a key's first request fails.

    After the protected handler returned, as Django's ``ATOMIC_REQUESTS``
    transaction is about to commit; the servers' control directory
    remembers which keys failed once.
    """

    def dispatch(self, request: HttpRequest, *args: object, **kwargs: object) -> HttpResponse:
        from tests.drf_views import CONTROL_DIR_ENV  # which imports this module

        response = super().dispatch(request, *args, **kwargs)
        control = Path(os.environ[CONTROL_DIR_ENV])
        try:
            (control / f"{request.headers['Idempotency-Key']}.failed").touch(exist_ok=False)
        except FileExistsError:
            return response
        raise RuntimeError("the request failed after the view")


#: Keys whose first request :class:`LeaseCheckpointThenFailOnceView` failed, in
#: this process (a server's workers use the control directory instead).
failed_once: set[str] = set()


def _first_failure(key: str) -> bool:
    """Whether this is the key's first request, remembered across a server's workers."""
    from tests.drf_views import CONTROL_DIR_ENV  # which imports this module

    control = os.environ.get(CONTROL_DIR_ENV)
    if control is None:
        first = key not in failed_once
        failed_once.add(key)
        return first
    try:
        (Path(control) / f"{key}.checkpoint-failed").touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


class LeaseCheckpointThenFailOnceView(View):
    """Creates an order, checkpoints its id, and fails the key's first request.

    Under ``ATOMIC_REQUESTS`` the order rolls back with the failed request;
    a retry that skipped the step by its checkpoint would name an order that
    does not exist.
    """

    @method_decorator(idempotent(atomic=False))
    def post(self, request: HttpRequest) -> HttpResponse:
        info = request.idempotency  # type: ignore[attr-defined]
        if "order" not in info.checkpoints:
            order = Order.objects.create(item="checkpointed")
            info.checkpoint("order", {"id": order.pk})
        if _first_failure(info.key):
            raise RuntimeError("failed after its checkpoint")
        return JsonResponse({"order": info.checkpoints["order"]["id"]}, status=201)


class LeaseCheckpointBlocksView(View):
    """Records step ``a`` in an atomic block that commits, then step ``b`` in one that rolls back.

    Each step creates an order and checkpoints its id inside its block. On
    a key's first request step ``b``'s block raises after its checkpoint
    and rolls back; the view then answers 503, or, with ``?raise=1``,
    raises. A retry that resumed from ``b``'s checkpoint would name an
    order that does not exist.
    """

    @method_decorator(idempotent(atomic=False))
    def post(self, request: HttpRequest) -> HttpResponse:
        info = request.idempotency  # type: ignore[attr-defined]
        for step in ("a", "b"):
            if step in info.checkpoints:
                continue
            try:
                with transaction.atomic():
                    order = Order.objects.create(item=step)
                    info.checkpoint(step, {"id": order.pk})
                    if step == "b" and _first_failure(info.key):
                        raise RuntimeError("step b failed after its checkpoint")
            except RuntimeError:
                if request.GET.get("raise"):
                    raise
                return JsonResponse({"detail": "step b failed"}, status=503)
        return JsonResponse({step: info.checkpoints[step]["id"] for step in "ab"}, status=201)


# A test reads the server-side id of the handler's connection here, kills that
# connection from its own, then sets ``resume``.
handler_connection_ids: queue.Queue[int] = queue.Queue()
resume = threading.Event()


def _outlive_connection(request: HttpRequest) -> HttpResponse:
    """Write the effect, wait while the test kills this connection, then answer or raise."""
    calls.increment()
    Order.objects.create(item="lost")
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_backend_pid()")
        else:
            cursor.execute("SELECT CONNECTION_ID()")
        handler_connection_ids.put(cursor.fetchone()[0])
    if not resume.wait(timeout=20):
        raise RuntimeError("the test never resumed the handler")
    resume.clear()
    if request.GET.get("raise"):
        raise RuntimeError("handler failed after losing its connection")
    return HttpResponse(b"created", status=201, content_type="text/plain")


@idempotent(atomic=False)
def lease_outliving_connection(request: HttpRequest) -> HttpResponse:
    return _outlive_connection(request)


class LeaseOutlivingConnectionView(View):
    @method_decorator(idempotent(atomic=False))
    def post(self, request: HttpRequest) -> HttpResponse:
        return _outlive_connection(request)


@idempotent(atomic=False)
def lease_large_response(request: HttpRequest) -> HttpResponse:
    calls.increment()
    Order.objects.create(item="large")
    size = int(request.GET["size"])
    response = HttpResponse(b"x" * size, content_type="application/octet-stream", status=201)
    response["Location"] = "/exports/1/"
    return response


def _unrenderable_order(request: HttpRequest) -> TemplateResponse:
    """Write the effect, then answer with a template whose rendering fails (NoReverseMatch)."""
    calls.increment()
    Order.objects.create(item="unrenderable")
    template = engines["django"].from_string("{% url 'no-such-view' %}")
    return TemplateResponse(request, template, status=201)


@idempotent(atomic=False)
def lease_unrenderable(request: HttpRequest) -> TemplateResponse:
    return _unrenderable_order(request)


@idempotent(atomic=False)
def lease_unwritable(request: HttpRequest) -> HttpResponse:
    """Creates an order, then answers with a header PostgreSQL's jsonb cannot hold (a NUL)."""
    calls.increment()
    order = Order.objects.create(item="unwritable")
    response = HttpResponse(status=201)
    response["Location"] = f"/orders/{order.pk}\x00"
    return response


@idempotent
def atomic_unrenderable(request: HttpRequest) -> TemplateResponse:
    return _unrenderable_order(request)


@idempotent(atomic=False)
def lease_unrenderable_until_resumed(request: HttpRequest) -> TemplateResponse:
    """Charges once (checkpointed), then answers with a template that fails to render.

    A run that resumes from the charge's checkpoint (after an operator
    released the refusal) renders: it answers with the charge and its attempt.
    """
    return _unrenderable_until_resumed(request)


class LeaseUnrenderableUntilResumedView(View):
    """:func:`lease_unrenderable_until_resumed` as a class-based view: ATOMIC_REQUESTS wraps it."""

    @method_decorator(idempotent(atomic=False))
    def post(self, request: HttpRequest) -> TemplateResponse:
        return _unrenderable_until_resumed(request)


def _unrenderable_until_resumed(request: HttpRequest) -> TemplateResponse:
    calls.increment()
    info = request.idempotency  # type: ignore[attr-defined]
    resumed = "charged" in info.checkpoints
    if not resumed:
        order = Order.objects.create(item="charged")
        info.checkpoint("charged", {"id": order.pk})
    text = '{"order": {{ order }}, "attempt": {{ attempt }}}' if resumed else "{% url 'none' %}"
    context = {"order": info.checkpoints["charged"]["id"], "attempt": info.attempt}
    template = engines["django"].from_string(text)
    return TemplateResponse(request, template, context, status=201)


class LeaseUnrenderableView(View):
    """:func:`lease_unrenderable` as a class-based view, which ATOMIC_REQUESTS still wraps."""

    @method_decorator(idempotent(atomic=False))
    def post(self, request: HttpRequest) -> TemplateResponse:
        return _unrenderable_order(request)
