"""Publishing a Celery task from a protected async view: once per key, after the commit.

``delay_on_commit`` called from the coroutine is refused by Django
(``SynchronousOnlyOperation``); called through ``sync_to_async`` it runs on
the request's thread, whose connection holds the claim's transaction, and
the message leaves only once that transaction commits (docs/tasks.rst). In
process through Django's ASGI test client on every backend, and over HTTP
under uvicorn on the server backends, each with a real worker and broker.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests
from celery import _state, current_app
from celery.signals import before_task_publish
from django.core.exceptions import SynchronousOnlyOperation
from django.db import connection, connections
from django.test import AsyncClient

from django_idempotency.models import IdempotencyKey
from tests import celery_app, clients
from tests.celery_worker import WorkerProcess, find_broker, new_worker, publishing_to
from tests.models import Order
from tests.server import UvicornServer, running
from tests.server_fixtures import SERVER_TESTS
from tests.tasks import TASK_DIR_ENV, receipts_seen, record_receipt

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/async/orders/publish/"
RETRIES = 2
COMMITTED = {"order": True, "key_completed": True}


@pytest.fixture(scope="module")
def celery_worker(django_db_setup, tmp_path_factory) -> Iterator[WorkerProcess]:
    """One solo worker: it runs the messages of its queue one at a time, in order.

    The app publishing to it is made the process's default app too, as a
    project's is: an async view's code runs in the event loop's thread, and
    ``current_app`` there is the default app, not the test thread's.
    """
    worker = new_worker(
        find_broker(),
        str(connection.settings_dict["NAME"]),
        tmp_path_factory.mktemp("publishing"),
        pool="solo",
        concurrency=1,
    )
    previous = _state.default_app
    with publishing_to(worker):
        current_app.set_default()
        try:
            yield worker.start()
        finally:
            _state.set_default_app(previous)


def drain(worker: WorkerProcess, label: str) -> None:
    """Wait until the worker has run every message published so far.

    One queue, one solo worker: once a message published now has run,
    every message published before it has run too.
    """
    worker.wait_for(record_receipt.delay(0, f"barrier-{label}"))


def seen_from_outside(order_pk: int, key: str) -> dict[str, bool]:
    """What another connection sees committed: the view's order and its completed record."""
    other = connections.create_connection("default")
    quote = other.ops.quote_name
    try:
        with other.cursor() as cursor:
            cursor.execute(f"SELECT 1 FROM {quote(Order._meta.db_table)} WHERE id = %s", [order_pk])
            order = cursor.fetchone() is not None
            cursor.execute(
                f"SELECT 1 FROM {quote(IdempotencyKey._meta.db_table)} "
                f"WHERE {quote('key')} = %s AND {quote('state')} = %s",
                [key, IdempotencyKey.State.COMPLETED],
            )
            completed = cursor.fetchone() is not None
    finally:
        other.close()
    return {"order": order, "key_completed": completed}


@pytest.fixture
def published() -> Iterator[dict[str, list[dict[str, bool]]]]:
    """For each key, what another connection saw committed at each publish of ``record_receipt``."""
    found: dict[str, list[dict[str, bool]]] = {}

    def receiver(headers: dict[str, Any], body: Any, **kwargs: Any) -> None:
        if headers.get("task") != record_receipt.name:
            return
        order_pk, label = body[0]
        if not label.startswith("barrier-"):
            found.setdefault(label, []).append(seen_from_outside(order_pk, label))

    before_task_publish.connect(receiver, weak=False)
    yield found
    before_task_publish.disconnect(receiver)


def post(key: str, query: str = "", client: AsyncClient | None = None, **data: Any) -> Any:
    """``clients.post_json`` of a receipt's order, through a new ASGI client unless given one."""
    client = client or AsyncClient(raise_request_exception=False)
    return clients.post_json(client, f"{URL}?{query}", {"item": "receipt", **data}, key)


class AsgiClientTests:
    @pytest.mark.parametrize("publish", ["on_commit", "transaction"])
    def test_each_key_publishes_once_after_its_commit(self, celery_worker, published, publish):
        keys = [f"{publish}-{n}" for n in range(3)]
        for key in keys:
            first = post(key, f"publish={publish}")
            retries = [post(key, f"publish={publish}") for _ in range(RETRIES)]

            assert first.status_code == 201, first.content
            assert json.loads(first.content)["in_transaction"] is True
            assert all(retry["Idempotent-Replayed"] == "true" for retry in retries)
        drain(celery_worker, publish)

        # Published once per key, each time with the view's writes committed...
        assert published == {key: [COMMITTED] for key in keys}
        # ...and run once per key by the worker, which found them there.
        for key in keys:
            assert receipts_seen(celery_worker.task_dir, key) == [COMMITTED]
        assert Order.objects.filter(item="receipt").count() == len(keys)

    def test_a_view_that_raises_publishes_nothing(self, celery_worker, published):
        failed = post("fails", **{"raise": True})
        drain(celery_worker, "fails")

        assert failed.status_code == 500
        assert published == {}
        assert receipts_seen(celery_worker.task_dir, "fails") == []
        assert not Order.objects.exists()
        assert not IdempotencyKey.objects.exists()

        # The key was never used: its retry runs, and publishes, once.
        assert post("fails").status_code == 201
        drain(celery_worker, "fails-retry")
        assert published == {"fails": [COMMITTED]}
        assert receipts_seen(celery_worker.task_dir, "fails") == [COMMITTED]

    def test_a_publish_before_the_commit_is_seen_as_one(self, celery_worker, published):
        # The control: the check above would catch a message sent too early.
        assert post("early", "publish=at_once").status_code == 201
        drain(celery_worker, "early")

        assert published == {"early": [{"order": False, "key_completed": False}]}

    def test_delay_on_commit_from_the_coroutine_is_refused(self, celery_worker, published):
        client = AsyncClient(raise_request_exception=True)

        with pytest.raises(SynchronousOnlyOperation):
            post("naive", "publish=naive", client=client)
        answered = post("naive-answer", "publish=naive")
        drain(celery_worker, "naive")

        assert answered.status_code == 500
        assert published == {}
        assert receipts_seen(celery_worker.task_dir, "naive") == []
        assert not Order.objects.exists()
        assert not IdempotencyKey.objects.exists()


@pytest.fixture(scope="module")
def publishing_uvicorn(
    django_db_setup: None, celery_worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[UvicornServer]:
    """Uvicorn with two workers whose views publish to the test's Celery worker."""
    env = {
        celery_app.BROKER_ENV: celery_worker.broker,
        celery_app.QUEUE_ENV: celery_worker.queue,
        TASK_DIR_ENV: str(celery_worker.task_dir),
    }
    log_dir = tmp_path_factory.mktemp("publishing-uvicorn")
    with running(UvicornServer, "tests.publishing_settings", log_dir, env, workers=2) as server:
        yield server  # type: ignore[misc]


def http_post(server: UvicornServer, key: str, query: str, **data: Any) -> requests.Response:
    """``clients.http_post`` of a receipt's order, on a connection of its own."""
    return clients.http_post(
        f"{server.url}{URL}?{query}",
        {"item": "receipt", **data},
        key,
        headers={"Connection": "close"},
        timeout=30,
    )


class UvicornTests:
    """Each request in a thread of its own, as uvicorn runs Django: the same rules."""

    pytestmark = SERVER_TESTS

    def test_concurrent_duplicates_publish_once_after_the_commit(
        self, publishing_uvicorn, celery_worker
    ):
        keys = [f"uvicorn-{n}" for n in range(4)]
        # Each original holds its transaction open for a second, its
        # duplicates waiting on it: a message sent before the commit would
        # reach the worker inside that second and find nothing.
        sends = [(key, "hold=1") for key in keys for _ in range(1 + RETRIES)]
        with ThreadPoolExecutor(max_workers=len(sends)) as pool:
            responses = list(pool.map(lambda sent: http_post(publishing_uvicorn, *sent), sends))
        drain(celery_worker, "uvicorn")

        assert [r.status_code for r in responses] == [201] * len(sends)
        assert all(r.json()["in_transaction"] for r in responses)
        assert (
            sum(r.headers.get("Idempotent-Replayed") == "true" for r in responses)
            == len(keys) * RETRIES
        )
        for key in keys:
            assert receipts_seen(celery_worker.task_dir, key) == [COMMITTED]
        assert Order.objects.filter(item="receipt").count() == len(keys)

    def test_a_view_that_raises_publishes_nothing(self, publishing_uvicorn, celery_worker):
        failed = http_post(publishing_uvicorn, "uvicorn-fails", "hold=0.2", **{"raise": True})
        drain(celery_worker, "uvicorn-fails")

        assert failed.status_code == 500
        assert receipts_seen(celery_worker.task_dir, "uvicorn-fails") == []
        assert not IdempotencyKey.objects.filter(key="uvicorn-fails").exists()

    def test_a_publish_before_the_commit_finds_nothing(self, publishing_uvicorn, celery_worker):
        # The control: the view goes on until the worker has run the task.
        early = http_post(publishing_uvicorn, "uvicorn-early", "publish=at_once&hold=task")

        assert early.status_code == 201
        assert receipts_seen(celery_worker.task_dir, "uvicorn-early") == [
            {"order": False, "key_completed": False}
        ]

    def test_delay_on_commit_from_the_coroutine_is_a_500(self, publishing_uvicorn, celery_worker):
        naive = http_post(publishing_uvicorn, "uvicorn-naive", "publish=naive")
        drain(celery_worker, "uvicorn-naive")

        assert naive.status_code == 500
        assert "SynchronousOnlyOperation" in publishing_uvicorn.log()
        assert receipts_seen(celery_worker.task_dir, "uvicorn-naive") == []
