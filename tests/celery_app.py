"""The Celery app the Celery tests run a real worker with.

The worker builds it from the environment the worker fixture sets (the
broker it found, and a queue of its own so that no other worker on the same
broker takes the test's messages); the test process builds its own twin
with :func:`make_app`.
"""

from __future__ import annotations

import os

from celery import Celery
from kombu import Queue

BROKER_ENV = "IDEMPOTENCY_TEST_BROKER_URL"
QUEUE_ENV = "IDEMPOTENCY_TEST_QUEUE"


def make_app(broker_url: str, queue: str) -> Celery:
    """An app on ``broker_url`` that routes every task to ``queue``."""
    app = Celery("tests", set_as_current=False)
    app.conf.update(
        broker_url=broker_url,
        # Redis stores results itself; RabbitMQ sends them back over AMQP.
        result_backend=broker_url if broker_url.startswith("redis") else "rpc://",
        task_default_queue=queue,
        task_queues=[Queue(queue, auto_delete=True)],
        broker_connection_retry_on_startup=False,
        worker_hijack_root_logger=False,
    )
    # Lazy, so that building the app never touches the models before the
    # worker's Django setup has run.
    app.autodiscover_tasks(["django_idempotency"])
    return app


if BROKER_ENV in os.environ:
    app = make_app(os.environ[BROKER_ENV], os.environ[QUEUE_ENV])
