"""What a Celery worker logs for idempotent tasks: each outcome, with the fields a view's have.

Real prefork workers of a project-style Celery app (:mod:`tests.celery_project`,
Celery's logging defaults) with a project's ``LOGGING`` that puts
``django_idempotency`` at DEBUG (:mod:`tests.celery_logging_settings`). A
view's records, read through the test client with the same formatter and
the same reader, are the control: the reader finds records where there are
some, so the worker's checks cannot pass on a log with nothing in it.
"""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from django.db import connection

from django_idempotency.keys import mask_key
from tests.celery_worker import WorkerProcess, find_broker, new_worker, publishing_to
from tests.clients import post
from tests.tasks import logged_order
from tests.worker_logging import HIJACK_ENV, LOGGING_ENV, JsonFieldsFormatter, records_in

pytestmark = pytest.mark.django_db(transaction=True)
DUPLICATES = 3
TASK = "tests.tasks.logged_order"
OUTCOMES = ["claimed", "stored"] + ["replayed"] * DUPLICATES
FIELDS = {"idempotency_outcome", "idempotency_scope", "idempotency_key", "idempotency_view"}


@pytest.fixture
def worker_with(tmp_path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start a worker whose project puts its log handler on ``package`` or ``root``."""
    with ExitStack() as stack:

        def start(handler_on: str, *, hijack: bool = True) -> WorkerProcess:
            worker = new_worker(
                find_broker(),
                str(connection.settings_dict["NAME"]),
                tmp_path,
                concurrency=2,
                settings="tests.celery_logging_settings",
                app="tests.celery_project",
                env={LOGGING_ENV: handler_on, HIJACK_ENV: "1" if hijack else "0"},
            )
            stack.enter_context(publishing_to(worker))
            return worker.start()

        yield start


def publish_with_duplicates(worker: WorkerProcess, reference: str) -> str:
    """Publish the task, then ``DUPLICATES`` more times with its key; the worker's log after."""
    results = [worker.wait_for(logged_order.delay(reference)) for _ in range(1 + DUPLICATES)]
    assert len({result["order"] for result in results}) == 1  # one effect
    return worker.log.read_text()


def for_key(records: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return [record for record in records if record.get("idempotency_key") == mask_key(key)]


def view_records(client: Any, key: str) -> list[dict[str, Any]]:
    """A view's records for one request and its duplicates, through the same formatter."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFieldsFormatter())
    logger = logging.getLogger("django_idempotency")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        for _ in range(1 + DUPLICATES):
            assert post(client, "/orders/", key).status_code == 201
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return for_key(records_in(stream.getvalue()), key)


class WorkerLogTests:
    def test_claim_and_each_replay_are_logged_as_a_views_are(self, worker_with, client):
        log = publish_with_duplicates(worker_with("package"), "log-package")
        task = for_key(records_in(log), "receipt-log-package")
        view = view_records(client, "view-key")

        # The control: the same reader finds the view's records...
        assert [r["idempotency_outcome"] for r in view] == OUTCOMES
        # ...and the worker's, with the same fields.
        assert [r["idempotency_outcome"] for r in task] == OUTCOMES
        for task_record, view_record in zip(task, view, strict=True):
            assert set(task_record) == set(view_record)
            assert set(task_record) >= FIELDS
            assert task_record["logger"] == view_record["logger"]
            assert task_record["level"] == "DEBUG"
            assert task_record["idempotency_scope"] == TASK
            assert task_record["idempotency_view"] == TASK
        assert view[0]["idempotency_view"] == "tests.views.create_order"
        # Masked everywhere in the worker's log, never in clear.
        assert mask_key("receipt-log-package") in log
        assert "receipt-log-package" not in log


class HijackedRootLoggerTests:
    """Celery's default ``worker_hijack_root_logger`` replaces the root logger's handlers."""

    def test_a_root_handler_is_replaced_by_celerys_own(self, worker_with):
        log = publish_with_duplicates(worker_with("root"), "log-root")

        # The project's handler (and its JSON formatter) is gone...
        assert records_in(log) == []
        # ...and the records reach Celery's handler instead, as plain text.
        masked = mask_key("receipt-log-root")
        plain = re.findall(rf"DEBUG/\S+\] Idempotency key {masked} in scope '{TASK}': (\w+)", log)
        assert plain == OUTCOMES
        assert "receipt-log-root" not in log

    def test_without_hijacking_the_root_handler_keeps_the_fields(self, worker_with):
        log = publish_with_duplicates(worker_with("root", hijack=False), "log-kept")
        records = for_key(records_in(log), "receipt-log-kept")

        assert [r["idempotency_outcome"] for r in records] == OUTCOMES
        assert all(set(record) >= FIELDS for record in records)
