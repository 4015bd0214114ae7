"""A client that goes away while a lease-mode view runs under ``ATOMIC_REQUESTS`` and ASGI.

Django's ASGI handler cancels the view's task. A sync view runs on to its end in the
request's thread; Django 5.2's handler then sends ``request_finished`` in that thread and
never closes the request, Django 6's closes the response the view went on to give. What
the request's end must do (give back a claim whose request rolled back, drop a checkpoint
whose writes rolled back) happens either way. The requests go through Django's own
``ASGIHandler``, the client's ``http.disconnect`` sent once the view started; the view
goes on once the handler has cancelled its task.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.core.handlers.asgi import ASGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections, connection, connections
from django.db.backends.signals import connection_created
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path
from django.utils.decorators import method_decorator
from django.views import View

from django_idempotency import idempotent, store
from django_idempotency.models import IdempotencyKey
from tests.models import Order
from tests.views import calls

State = IdempotencyKey.State

#: The view says it started, then waits until the client has gone (or is not going).
started, client_gone = threading.Event(), threading.Event()
#: How the next request fails: in the view after its checkpoint, after the view, at COMMIT.
failing: dict[str, bool] = {}


class ChecksOutThenWaits(View):
    """Creates an order and checkpoints it, waits for the client to go, then fails as told."""

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        response = super().dispatch(request, *args, **kwargs)
        if failing.pop("after_the_view", False):
            raise RuntimeError("the request failed after the view")
        return response

    @method_decorator(idempotent(atomic=False))
    def post(self, request: HttpRequest) -> HttpResponse:
        calls.increment()
        info = request.idempotency  # type: ignore[attr-defined]
        if "order" not in info.checkpoints:
            order = Order.objects.create(item="checked out")
            info.checkpoint("order", {"id": order.pk})
        if failing.pop("closes_a_response", False):
            HttpResponse("another view's").close()  # sends request_finished, from no handler
        started.set()
        # A bound should the test fail, not a synchronisation.
        assert client_gone.wait(timeout=30), "the client never went"
        if failing.pop("in_the_view", False):
            raise RuntimeError("the view failed after its checkpoint")
        if failing.pop("at_commit", False):
            with connection.cursor() as cursor:
                # PostgreSQL checks Django's foreign keys at COMMIT, after the view returned.
                cursor.execute(
                    "INSERT INTO auth_user_groups (user_id, group_id) VALUES (%s, %s)",
                    [999999, 999999],
                )
        return JsonResponse({"order": info.checkpoints["order"]["id"]}, status=201)


urlpatterns = [path("checks-out/", ChecksOutThenWaits.as_view())]


def a_task_is_being_cancelled() -> bool:
    return any(task.cancelling() for task in asyncio.all_tasks())


async def let_the_view_go_once_cancelled() -> None:
    # The handler cancels the view's task on the event loop, once the disconnect is read.
    while not a_task_is_being_cancelled():
        await asyncio.sleep(0)  # the next turn of the loop, not a time
    client_gone.set()


def post(*, goes_away: bool, on_a_server: bool = False) -> tuple[int | None, dict[str, str], bytes]:
    """POST through Django's ASGI handler: status (``None`` if nothing sent), headers, body.

    A client that ``goes_away`` sends ``http.disconnect`` once the view started. Called from
    sync code, as Django's tests do, the request's sync work runs in this thread; ``on_a_server``
    it runs in a thread of its own, as a server runs it, which ends with the request.
    """
    body = json.dumps({"item": "book"}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/checks-out/",
        "raw_path": b"/checks-out/",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"testserver"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"idempotency-key", b"client-gone"),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }
    sent: list[dict[str, Any]] = []
    started.clear()
    if goes_away:
        client_gone.clear()
    else:
        client_gone.set()

    async def exchange() -> None:
        messages = 0
        staying = asyncio.Event()

        async def receive() -> dict[str, Any]:
            nonlocal messages
            messages += 1
            if messages == 1:
                return {"type": "http.request", "body": body, "more_body": False}
            if not goes_away:
                await staying.wait()  # cancelled once the response is sent
            view_started = await asyncio.get_running_loop().run_in_executor(None, started.wait, 30)
            assert view_started, "the view never started"
            watchers.append(asyncio.ensure_future(let_the_view_go_once_cancelled()))
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        watchers: list[asyncio.Future[None]] = []
        await ASGIHandler()(scope, receive, send)
        assert all(watcher.done() for watcher in watchers), "the view was never cancelled"

    if on_a_server:
        asyncio.run(exchange())
    else:
        async_to_sync(exchange)()
    start = next((m for m in sent if m["type"] == "http.response.start"), None)
    if start is None:
        return None, {}, b""
    headers = {name.decode().lower(): value.decode() for name, value in start["headers"]}
    content = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], headers, content


def left_open_by_a_failure_on_a_server() -> list[str]:
    """Send a request whose view fails once its client went away, on a thread of its own.

    The aliases of the connections opened outside this thread that are still open after it.
    """
    opened: list[Any] = []

    def note(sender: Any, connection: Any, **kwargs: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            opened.append(connection)

    connection_created.connect(note, dispatch_uid="tests.client_gone.opened", weak=False)
    try:
        failing["in_the_view"] = True
        post(goes_away=True, on_a_server=True)
    finally:
        connection_created.disconnect(dispatch_uid="tests.client_gone.opened")
    assert opened, "the request's thread had no connection of its own"
    return [each.alias for each in opened if each.connection is not None]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.11's Task.cancelling()")
@pytest.mark.django_db(transaction=True)
class ClientGoneTests:
    @pytest.fixture(autouse=True)
    def atomic_requests(self, monkeypatch: pytest.MonkeyPatch, settings: Any) -> None:
        monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)
        settings.ROOT_URLCONF = __name__
        failing.clear()

    @pytest.mark.parametrize("on_a_server", [False, True], ids=["in_this_thread", "on_a_server"])
    def test_a_checkpoint_rolled_back_with_the_request_is_not_kept(self, on_a_server: bool) -> None:
        failing["in_the_view"] = True
        post(goes_away=True, on_a_server=on_a_server)
        assert not Order.objects.exists()  # rolled back with the request

        status, _, content = post(goes_away=False)

        # The step ran again: the order answered is one that exists.
        assert status == 201, content
        assert Order.objects.filter(pk=json.loads(content)["order"]).exists()
        assert calls.value == 2
        status, headers, replayed = post(goes_away=False)
        assert (status, headers["idempotent-replayed"], replayed) == (201, "true", content)

    @pytest.mark.parametrize(
        "how",
        [
            "after_the_view",
            pytest.param(
                "at_commit",
                marks=pytest.mark.skipif(
                    connection.vendor != "postgresql", reason="foreign keys checked at COMMIT"
                ),
            ),
        ],
    )
    @pytest.mark.parametrize("on_a_server", [False, True], ids=["in_this_thread", "on_a_server"])
    def test_a_claim_rolled_back_with_the_request_is_given_back_at_once(
        self, how: str, on_a_server: bool
    ) -> None:
        failing[how] = True
        post(goes_away=True, on_a_server=on_a_server)
        assert not Order.objects.exists()
        assert not IdempotencyKey.objects.exists()  # given back, not held for the lease

        status, headers, content = post(goes_away=False)

        assert status == 201, content
        assert "idempotent-replayed" not in headers
        assert Order.objects.filter(pk=json.loads(content)["order"]).exists()
        assert calls.value == 2

    def test_a_view_that_answers_after_its_client_went_is_stored_once(self) -> None:
        post(goes_away=True)
        assert IdempotencyKey.objects.get().state == State.COMPLETED

        status, headers, _ = post(goes_away=False)

        assert (status, headers["idempotent-replayed"]) == (201, "true")
        assert Order.objects.count() == 1
        assert calls.value == 1

    def test_what_the_request_end_opens_is_closed_on_a_server(self) -> None:
        # Django closes the request thread's connections before the checkpoint is put back.
        assert left_open_by_a_failure_on_a_server() == []

    def test_a_response_closed_inside_the_view_does_not_end_the_request(self) -> None:
        # Its request_finished (no handler sent it) comes inside the request's transaction.
        failing["in_the_view"] = failing["closes_a_response"] = True
        assert post(goes_away=False)[0] == 500
        assert not Order.objects.exists()

        status, _, content = post(goes_away=False)

        assert status == 201, content
        assert Order.objects.filter(pk=json.loads(content)["order"]).exists()

    @pytest.mark.parametrize("goes_away", [False, True])
    def test_a_release_that_fails_is_logged_and_leaves_the_others_to_run(
        self, goes_away: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        # With the client still there, the release runs as Django closes the response, whose
        # loop would swallow the error unseen.
        def fails(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("not a database error")

        monkeypatch.setattr(store, "restore_progress", fails)
        failing["after_the_view"] = True
        post(goes_away=goes_away)

        assert not IdempotencyKey.objects.exists()  # the claim's release still ran
        assert caplog.text.count("A release at the end of a request failed.") == 1

    def test_the_request_end_needs_no_alias_it_did_not_use(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # A database configured for other work, its driver not installed here.
        reporting = dict(
            connections.settings["default"],
            ENGINE="django.db.backends.oracle",
            ATOMIC_REQUESTS=False,
        )
        monkeypatch.setitem(connections.settings, "reporting", reporting)
        failing["in_the_view"] = True
        post(goes_away=True, on_a_server=True)

        status, _, content = post(goes_away=False)

        assert status == 201, content
        assert Order.objects.filter(pk=json.loads(content)["order"]).exists()

    def test_what_a_failed_release_opened_is_closed_on_a_server(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        def opens_then_fails(using: str, *args: Any, **kwargs: Any) -> None:
            with connections[using].cursor() as cursor:
                cursor.execute("SELECT 1")
            raise RuntimeError("not a database error")

        monkeypatch.setattr(store, "restore_progress", opens_then_fails)

        assert left_open_by_a_failure_on_a_server() == []


@pytest.fixture
def close_old_connections_disconnected() -> Any:
    # As Django's test client does around a request, to keep the test's database open.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.11's Task.cancelling()")
@pytest.mark.django_db
@pytest.mark.parametrize("goes_away", [False, True])
def test_the_request_end_leaves_a_test_transactions_connection_open(
    goes_away: bool, settings: Any, close_old_connections_disconnected: None
) -> None:
    # A checkpoint inside the test's transaction leaves its put-back to the request's end.
    settings.ROOT_URLCONF = __name__
    failing.clear()

    post(goes_away=goes_away)

    assert connection.in_atomic_block
    assert Order.objects.count() == 1  # the test's connection still answers
