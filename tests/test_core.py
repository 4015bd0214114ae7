"""The core's rule for layers: a claim is marked on Django's request while its call runs.

An inner layer given that request, a framework's copy of it or Django's under it, runs inside
the claim; the same request sent through again once the call ended is a retry, protected as
any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from typing import Any, ClassVar

import django
import pytest
from asgiref.sync import async_to_sync
from django.core.exceptions import ImproperlyConfigured
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.signals import request_finished
from django.db import close_old_connections
from django.http import HttpRequest, HttpResponseBase, JsonResponse
from django.test import Client, RequestFactory
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

from django_idempotency import idempotent
from django_idempotency.exceptions import RequestInFlight
from django_idempotency.models import IdempotencyKey
from tests import async_views, drf_views, views
from tests.body_views import open_temporary_files
from tests.models import Order

BODY = json.dumps({"item": "book"})
KEY_HEADER = {"Idempotency-Key": "key-1"}


def order_request(key: str = "key-1") -> HttpRequest:
    return RequestFactory().post(
        "/orders/", BODY, content_type="application/json", headers={"Idempotency-Key": key}
    )


@pytest.fixture(autouse=True)
def test_database_kept_open():
    """As Django's test client does: closing a response must not close the test's database."""
    request_finished.disconnect(close_old_connections)
    yield
    request_finished.connect(close_old_connections)


def answered(response: HttpResponseBase) -> HttpResponseBase:
    response.close()  # as a server does: the fingerprint's copy of the body closes with it
    return response


@pytest.mark.django_db
class SameRequestAgainTests:
    @pytest.mark.parametrize("view", [views.create_order, views.create_order_lease])
    def test_the_same_request_sent_through_again_is_replayed(self, view, reset_calls) -> None:
        request = order_request()
        first = answered(view(request))
        again = answered(view(request))

        assert first.status_code == again.status_code == 201
        assert again["Idempotent-Replayed"] == "true"
        assert again.content == first.content
        assert reset_calls.value == 1
        assert Order.objects.count() == 1

    def test_after_a_failure_the_same_request_claims_the_key_once_more(self, reset_calls) -> None:
        request = order_request()
        views.fail_next.set()
        with pytest.raises(RuntimeError, match="handler failed after writing"):
            views.create_order(request)
        retried = answered(views.create_order(request))
        again = answered(views.create_order(request))

        assert retried.status_code == 201 and "Idempotent-Replayed" not in retried
        assert again["Idempotent-Replayed"] == "true"
        assert reset_calls.value == 2  # the failed run, rolled back, and the retry
        assert Order.objects.count() == 1
        assert IdempotencyKey.objects.get().state == IdempotencyKey.State.COMPLETED


@pytest.mark.django_db(transaction=True)
def test_an_async_view_given_the_same_request_again_replays(reset_calls) -> None:
    request = order_request()
    first = answered(async_to_sync(async_views.create_order)(request))
    again = answered(async_to_sync(async_views.create_order)(request))

    assert first.status_code == again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert reset_calls.value == 1


@pytest.mark.django_db
def test_another_view_with_other_options_given_the_same_request_is_refused(reset_calls) -> None:
    # Same scope, key and fingerprint, so the same record: the lease-mode view would be
    # answered the atomic one's response, which options it does not share decided.
    request = order_request()
    answered(views.create_order(request))

    with pytest.raises(ImproperlyConfigured, match=r"with other options \(atomic\)"):
        views.create_order_lease(request)
    assert reset_calls.value == 1


@idempotent
def fails_inside(request: HttpRequest) -> JsonResponse:
    raise RuntimeError("the inner view failed")


@idempotent
def catches_and_reads_the_body(request: HttpRequest) -> JsonResponse:
    with contextlib.suppress(RuntimeError):
        fails_inside(request)
    return JsonResponse(json.loads(request.body), status=201)


@pytest.mark.django_db
def test_a_failed_inner_layer_leaves_the_body_to_its_caller() -> None:
    # The caller's layer copied the body for its fingerprint; the inner one must not close it.
    response = answered(catches_and_reads_the_body(order_request()))

    assert response.status_code == 201
    assert json.loads(response.content) == {"item": "book"}
    assert IdempotencyKey.objects.get().state == IdempotencyKey.State.COMPLETED


@idempotent
def reads_the_form_after_a_failed_call(request: HttpRequest) -> JsonResponse:
    with contextlib.suppress(RuntimeError):
        fails_inside(request)
    return JsonResponse({"item": request.POST["item"]}, status=201)


@pytest.mark.django_db
def test_a_failed_view_leaves_the_body_copy_its_caller_made_open() -> None:
    # A form without a key: the caller's layer copied the body looking for one and claimed
    # nothing; the failing view it calls must not close that copy, which the form reads.
    request = RequestFactory().post("/orders/", {"item": "book"})
    response = answered(reads_the_form_after_a_failed_call(request))

    assert json.loads(response.content) == {"item": "book"}
    assert not IdempotencyKey.objects.exists()


# The body's copy after an error: it stays the body until the request is closed.


def reads_the_body_after_a_failed_call(request: HttpRequest) -> JsonResponse:
    """Not protected itself: tries a protected view, and reads the body once it failed."""
    with contextlib.suppress(RuntimeError):
        fails_inside(request)
    return JsonResponse(json.loads(request.body))


@pytest.mark.django_db
def test_an_unprotected_caller_reads_the_body_after_a_protected_view_raised() -> None:
    request = order_request()
    response = reads_the_body_after_a_failed_call(request)
    request.close()

    assert json.loads(response.content) == {"item": "book"}
    assert not IdempotencyKey.objects.exists()


@pytest.mark.django_db
def test_the_body_of_a_request_refused_its_key_can_still_be_read() -> None:
    answered(views.create_order(order_request()))
    request = RequestFactory().post(
        "/orders/", '{"item": "pen"}', content_type="application/json", headers=KEY_HEADER
    )
    refused = views.create_order(request)

    assert refused.status_code == 422
    assert json.loads(request.body) == {"item": "pen"}
    request.close()


@pytest.mark.django_db
def test_a_copy_left_by_an_error_is_closed_with_the_request(settings, tmp_path) -> None:
    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = 1024
    settings.FILE_UPLOAD_TEMP_DIR = str(tmp_path)
    request = RequestFactory().post("/orders/", {"item": "x" * 4096}, headers=KEY_HEADER)
    with pytest.raises(RuntimeError):
        fails_inside(request)
    assert open_temporary_files(directory=str(tmp_path)) == 1
    assert request.POST["item"] == "x" * 4096

    request.close()
    assert open_temporary_files(directory=str(tmp_path)) == 0


@csrf_exempt
@idempotent
def form_view_that_raises(request: HttpRequest) -> JsonResponse:
    raise RuntimeError("the view failed before reading its form")


class LogsTheBodyOfAFailure:
    """A project's middleware that logs the body of a request answered 5xx."""

    logged: ClassVar[list[bytes]] = []

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        response = self.get_response(request)
        if response.status_code >= 500:
            self.logged.append(request.body)
        return response


urlpatterns = [path("form-raises/", form_view_that_raises)]


@pytest.mark.urls(__name__)
@pytest.mark.django_db
class ErrorReportsTests:
    """What Django does with a request whose view raised reads its body: the copy is the body."""

    def post(self) -> HttpResponseBase:
        client = Client(raise_request_exception=False)
        return client.post("/form-raises/", {"item": "book"}, headers=KEY_HEADER)

    def test_the_debug_page_shows_the_form(self, settings) -> None:
        settings.DEBUG = True
        response = self.post()

        assert response.status_code == 500
        assert b"RuntimeError" in response.content
        assert b"book" in response.content  # the page's POST section

    # Django 6.1 asks projects to configure MAILERS; the test's mail goes to the outbox.
    @pytest.mark.filterwarnings("ignore:Django 2028 will not have a default mailer")
    def test_the_error_report_is_mailed_with_the_form(self, settings, mailoutbox) -> None:
        # Django 6.0 takes addresses, and deprecates the (name, address) pairs 5.2 needs.
        admin = "admin@example.com"
        settings.ADMINS = [admin if django.VERSION >= (6, 0) else ("Admin", admin)]
        response = self.post()

        assert response.status_code == 500
        assert len(mailoutbox) == 1
        assert "book" in mailoutbox[0].body

    def test_a_middleware_reads_the_body_of_the_failure(self, settings) -> None:
        settings.MIDDLEWARE = [*settings.MIDDLEWARE, f"{__name__}.LogsTheBodyOfAFailure"]
        LogsTheBodyOfAFailure.logged.clear()
        response = self.post()

        assert response.status_code == 500
        [logged] = LogsTheBodyOfAFailure.logged
        assert b'name="item"\r\n\r\nbook\r\n' in logged  # the test client's multipart


@csrf_exempt
@idempotent
async def async_form_view(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"item": request.POST["item"]}, status=201)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("key", ["form-key-1", None])
def test_an_async_view_called_directly_closes_the_form_copy_with_its_response(
    settings, tmp_path, key
) -> None:
    # The form's key is read before the claim: that copy is the layer's own to close.
    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = 1024
    settings.FILE_UPLOAD_TEMP_DIR = str(tmp_path)
    form = {"item": "x" * 4096, **({"idempotency_key": key} if key else {})}
    request = RequestFactory().post("/orders/", form)
    response = async_to_sync(async_form_view)(request)
    assert response.status_code == 201
    assert open_temporary_files(directory=str(tmp_path)) == 1

    response.close()
    assert open_temporary_files(directory=str(tmp_path)) == 0


read_by_the_view: list[str] = []


@idempotent
def reads_a_little_then_fails_once(request: HttpRequest) -> JsonResponse:
    start = request.read(5).decode()
    if not read_by_the_view:
        read_by_the_view.append(start)
        raise RuntimeError("the view failed after reading a little")
    read_by_the_view.append(start + request.read().decode())
    return JsonResponse({"read": read_by_the_view[-1]}, status=201)


@pytest.mark.django_db
def test_the_same_request_sent_again_after_its_view_read_part_of_the_body_fails() -> None:
    # What is left of the body is not what the client sent: the copy is closed, so the view
    # sent it again fails on it rather than run on the rest, and nothing is stored.
    read_by_the_view.clear()
    request, retry = order_request(), order_request()
    with pytest.raises(RuntimeError, match="after reading a little"):
        reads_a_little_then_fails_once(request)
    with pytest.raises(ValueError, match="closed file"):
        reads_a_little_then_fails_once(request)
    request.close()
    assert not IdempotencyKey.objects.exists()

    from_the_client = answered(reads_a_little_then_fails_once(retry))
    retry.close()
    assert from_the_client.status_code == 201
    assert read_by_the_view == ['{"ite', BODY]


@csrf_exempt
@idempotent
def reads_an_upload_then_fails_once(request: HttpRequest) -> JsonResponse:
    data = request.FILES["scan"].read()
    if not read_by_the_view:
        read_by_the_view.append(data.decode())
        raise RuntimeError("the view failed after reading the upload")
    return JsonResponse({"size": len(data)}, status=201)


@pytest.mark.django_db
def test_the_same_upload_sent_again_after_its_view_read_the_files_runs_whole() -> None:
    # Django keeps the parsed form: its files are fingerprinted and read again from their start.
    read_by_the_view.clear()
    upload = SimpleUploadedFile("scan.txt", b"hello world")
    request = RequestFactory().post("/orders/", {"scan": upload}, headers=KEY_HEADER)
    with pytest.raises(RuntimeError, match="after reading the upload"):
        reads_an_upload_then_fails_once(request)
    again = answered(reads_an_upload_then_fails_once(request))
    request.close()
    upload = SimpleUploadedFile("scan.txt", b"hello world")
    retry = RequestFactory().post("/orders/", {"scan": upload}, headers=KEY_HEADER)
    from_the_client = answered(reads_an_upload_then_fails_once(retry))
    retry.close()

    assert json.loads(again.content) == {"size": 11}
    assert from_the_client["Idempotent-Replayed"] == "true"


@pytest.mark.django_db
@pytest.mark.parametrize(
    "view",
    [
        views.create_order,
        async_to_sync(async_views.create_order),
        drf_views.OrderAPIView.as_view(),
    ],
    ids=["decorator", "async_decorator", "drf_mixin"],
)
def test_the_copy_of_a_refused_requests_body_closes_with_the_request(settings, tmp_path, view):
    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = 16
    settings.FILE_UPLOAD_TEMP_DIR = str(tmp_path)
    answered(view(order_request()))
    other = json.dumps({"item": "a pen, not a book"})
    request = RequestFactory().post(
        "/orders/", other, content_type="application/json", headers=KEY_HEADER
    )
    refused = view(request)
    assert refused.status_code == 422
    refused.close()
    assert open_temporary_files(directory=str(tmp_path)) == 1  # the body, for a logger

    request.close()  # as Django's handlers do once the response is sent
    assert open_temporary_files(directory=str(tmp_path)) == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("view", [views.create_order, async_to_sync(async_form_view)])
def test_the_copy_of_a_form_whose_key_was_sent_twice_closes_with_the_request(
    settings, tmp_path, view
) -> None:
    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = 1024
    settings.FILE_UPLOAD_TEMP_DIR = str(tmp_path)
    form = {"item": "x" * 4096, "idempotency_key": ["form-key-1", "form-key-2"]}
    request = RequestFactory().post("/orders/", form)
    refused = view(request)
    assert refused.status_code == 400
    refused.close()
    assert open_temporary_files(directory=str(tmp_path)) == 1

    request.close()
    assert open_temporary_files(directory=str(tmp_path)) == 0


@idempotent
def reads_a_little_then_is_refused_once(request: HttpRequest) -> JsonResponse:
    start = request.read(5).decode()
    if not read_by_the_view:
        read_by_the_view.append(start)
        # A refusal of the view's own: an idempotent function's call in flight, a lost lease.
        raise RequestInFlight(retry_after=1)
    read_by_the_view.append(start + request.read().decode())
    return JsonResponse({"read": read_by_the_view[-1]}, status=201)


@pytest.mark.django_db
def test_a_view_refused_after_reading_part_of_the_body_is_not_run_on_the_rest() -> None:
    read_by_the_view.clear()
    request = order_request()
    refused = reads_a_little_then_is_refused_once(request)  # a caller that sends it again
    with pytest.raises(ValueError, match="closed file"):
        reads_a_little_then_is_refused_once(request)
    refused.close()
    request.close()

    assert refused.status_code == 409

    assert not IdempotencyKey.objects.exists()


@csrf_exempt
@idempotent
async def async_reads_a_little_then_fails(request: HttpRequest) -> JsonResponse:
    request.read(5)
    raise RuntimeError("failed after reading part of the body")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("key", [None, "form-key-1"], ids=["no_key", "form_key"])
def test_an_async_view_that_read_part_of_a_form_and_raised_closes_its_copy_at_once(key) -> None:
    # With no key nothing is claimed, and the view runs outside protect(): the same rule.
    form = {"item": "book", **({"idempotency_key": key} if key else {})}
    request = RequestFactory().post("/orders/", form)
    with pytest.raises(RuntimeError):
        async_to_sync(async_reads_a_little_then_fails)(request)
    closed = request._stream.closed
    request.close()

    assert closed, "the copy the view read part of stayed open"


def form_view_behind_the_middleware(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"item": request.POST["item"][:4]}, status=201)


def through_the_middleware(request: HttpRequest, asynchronous: bool) -> HttpResponseBase:
    """``request`` through ``IdempotencyMiddleware`` alone, called directly, to the form view."""
    from django_idempotency.middleware import IdempotencyMiddleware

    view = form_view_behind_the_middleware

    def get_response(request: HttpRequest) -> HttpResponseBase:
        return middleware.process_view(request, view, (), {}) or view(request)

    async def aget_response(request: HttpRequest) -> HttpResponseBase:
        return await middleware.process_view(request, view, (), {}) or view(request)

    middleware = IdempotencyMiddleware(aget_response if asynchronous else get_response)
    return async_to_sync(middleware)(request) if asynchronous else middleware(request)


def big_form(item: str, key: str) -> HttpRequest:
    """A form past ``FILE_UPLOAD_MAX_MEMORY_SIZE`` (set by ``behind_the_middleware``)."""
    return RequestFactory().post(
        "/behind-the-middleware/", {"item": item * 4096, "idempotency_key": key}
    )


@pytest.fixture
def behind_the_middleware(settings, tmp_path) -> Any:
    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = 1024
    settings.FILE_UPLOAD_TEMP_DIR = str(tmp_path)
    settings.ROOT_URLCONF = __name__
    return lambda: open_temporary_files(directory=str(tmp_path))


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
class MiddlewareCopiesTests:
    """The copies of the body behind ``IdempotencyMiddleware``, called directly."""

    def test_it_closes_the_copy_it_made_for_a_forms_key_with_its_response(
        self, behind_the_middleware, asynchronous
    ) -> None:
        open_files = behind_the_middleware
        request = big_form("x", "form-key-mw")
        response = through_the_middleware(request, asynchronous)
        assert response.status_code == 201
        assert open_files() == 1

        response.close()
        assert open_files() == 0
        request.close()

    def test_a_request_it_refuses_keeps_its_copy_until_the_request_closes(
        self, behind_the_middleware, asynchronous
    ) -> None:
        open_files = behind_the_middleware
        first = big_form("x", "form-key-refused")
        through_the_middleware(first, asynchronous).close()
        first.close()
        request = big_form("y", "form-key-refused")  # another body: 422
        refused = through_the_middleware(request, asynchronous)
        assert refused.status_code == 422
        refused.close()
        assert open_files() == 1  # the body, for a logger

        request.close()
        assert open_files() == 0

    def test_a_copy_made_before_it_is_left_to_the_request(
        self, behind_the_middleware, asynchronous
    ) -> None:
        from django_idempotency.body import body_stream

        open_files = behind_the_middleware
        request = big_form("x", "form-key-made-before")
        body_stream(request)  # a caller's layer copied the body first
        response = through_the_middleware(request, asynchronous)
        assert response.status_code == 201
        response.close()
        assert open_files() == 1

        request.close()
        assert open_files() == 0


urlpatterns += [path("behind-the-middleware/", form_view_behind_the_middleware)]


#: The events of the cancelled views below: each says it started, then waits to be let go.
cancelled_view_events: dict[str, asyncio.Event] = {}


@csrf_exempt
@idempotent
async def waits_to_be_let_go(request: HttpRequest) -> JsonResponse:
    cancelled_view_events["started"].set()
    await cancelled_view_events["let_go"].wait()
    return JsonResponse({"item": request.POST["item"][:4]}, status=201)


@csrf_exempt
@idempotent
async def fails_once_let_go(request: HttpRequest) -> JsonResponse:
    cancelled_view_events["started"].set()
    await cancelled_view_events["let_go"].wait()
    raise ValueError("the view failed after its client went away")


#: What the closer of the response below saw: the thread it ran in, and a query's answer.
closer_saw: dict[str, Any] = {}


@csrf_exempt
@idempotent
async def answers_with_a_closer_that_queries(request: HttpRequest) -> JsonResponse:
    cancelled_view_events["started"].set()
    await cancelled_view_events["let_go"].wait()
    response = JsonResponse({"item": "book"}, status=201)

    def closer() -> None:
        closer_saw["in_the_event_loop"] = in_an_event_loop()
        closer_saw["keys"] = IdempotencyKey.objects.count()  # sync-only: the ORM

    response._resource_closers.append(closer)
    return response


def in_an_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def cancel_while_it_runs(view: Any, request: HttpRequest) -> None:
    """Call ``view``, cancel it once it started, as Django's ASGI handler does when the client
    goes away, then let it go on."""

    async def cancel() -> None:
        cancelled_view_events.update(started=asyncio.Event(), let_go=asyncio.Event())
        running = asyncio.ensure_future(view(request))
        await cancelled_view_events["started"].wait()
        running.cancel()
        cancelled_view_events["let_go"].set()
        with pytest.raises(asyncio.CancelledError):
            await running

    async_to_sync(cancel)()


def big_form_to(settings: Any, tmp_path: Any, key: str, item: str = "x") -> HttpRequest:
    """A form whose copy of the body is a file in ``tmp_path``."""
    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = 1024
    settings.FILE_UPLOAD_TEMP_DIR = str(tmp_path)
    return RequestFactory().post("/orders/", {"item": item * 4096, "idempotency_key": key})


@pytest.mark.django_db(transaction=True)
def test_the_response_a_cancellation_drops_closes_the_copy_of_the_body(settings, tmp_path):
    request = big_form_to(settings, tmp_path, "form-key-cancelled")
    finished: list[object] = []

    async def a_projects_async_receiver(**kwargs: Any) -> None:
        finished.append(kwargs)

    # Django's ASGI handler sends request_finished for the cancelled request, not this.
    request_finished.connect(a_projects_async_receiver)
    try:
        cancel_while_it_runs(waits_to_be_let_go, request)
    finally:
        request_finished.disconnect(a_projects_async_receiver)
    open_after_the_cancellation = open_temporary_files(directory=str(tmp_path))
    request.close()

    # The view ran to its end and its response was stored, then dropped and released.
    assert IdempotencyKey.objects.get().state == IdempotencyKey.State.COMPLETED
    assert open_after_the_cancellation == 0
    assert finished == []


@pytest.mark.django_db(transaction=True)
def test_a_cancelled_view_that_then_fails_closes_the_copy_of_the_body(settings, tmp_path):
    # Django does not close a cancelled request: the copy an error leaves to it is closed.
    request = big_form_to(settings, tmp_path, "form-key-cancelled-fails")

    cancel_while_it_runs(fails_once_let_go, request)
    open_after_the_cancellation = open_temporary_files(directory=str(tmp_path))
    request.close()

    assert not IdempotencyKey.objects.exists()  # the failure gave the key back
    assert open_after_the_cancellation == 0


@pytest.mark.django_db(transaction=True)
def test_the_closers_of_a_dropped_response_run_in_the_requests_thread(settings, tmp_path):
    # As Django closes a response: out of the event loop, where the ORM may be used.
    closer_saw.clear()
    request = big_form_to(settings, tmp_path, "form-key-cancelled-closer")

    cancel_while_it_runs(answers_with_a_closer_that_queries, request)
    request.close()

    assert closer_saw == {"in_the_event_loop": False, "keys": 1}


#: The scope function below waits here, in the request's thread, before the claim.
in_the_scope, let_the_scope_go = threading.Event(), threading.Event()


def waits_in_the_scope(request: HttpRequest) -> str:
    in_the_scope.set()
    let_the_scope_go.wait(timeout=30)  # a bound should the test fail, not a synchronisation
    return "cancelled-before-its-claim"


@csrf_exempt
@idempotent(scope=waits_in_the_scope)
async def cancelled_before_its_claim(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"item": request.POST["item"][:4]}, status=201)


@pytest.mark.django_db(transaction=True)
def test_a_request_cancelled_then_refused_closes_the_copy_of_the_body(settings, tmp_path):
    let_the_scope_go.set()
    first = big_form_to(settings, tmp_path, "form-key-then-refused")
    async_to_sync(cancelled_before_its_claim)(first).close()
    first.close()
    in_the_scope.clear()
    let_the_scope_go.clear()
    # The same key with another body, cancelled before its claim refuses it (422).
    other = big_form_to(settings, tmp_path, "form-key-then-refused", item="y")

    async def cancel_in_the_scope() -> None:
        running = asyncio.ensure_future(cancelled_before_its_claim(other))
        await asyncio.get_running_loop().run_in_executor(None, in_the_scope.wait, 30)
        running.cancel()  # as asyncio.wait_for does on its timeout
        let_the_scope_go.set()
        with pytest.raises(asyncio.CancelledError):
            await running

    async_to_sync(cancel_in_the_scope)()
    open_after_the_cancellation = open_temporary_files(directory=str(tmp_path))
    other.close()

    assert IdempotencyKey.objects.count() == 1
    assert open_after_the_cancellation == 0
