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
#: Seconds; longer than any task body here runs unless a test holds it.
VISIBILITY_TIMEOUT = 10


def make_app(broker_url: str, queue: str) -> Celery:
    """An app on ``broker_url`` that routes every task to ``queue``."""
    app = Celery("tests", set_as_current=False)
    app.conf.update(
        broker_url=broker_url,
        # Redis stores results itself; RabbitMQ sends them back over AMQP.
        result_backend=broker_url if broker_url.startswith("redis") else "rpc://",
        task_default_queue=queue,
        # Deleted once unused for a while, not when its consumer goes: a test
        # that kills the worker needs its unacknowledged message kept.
        task_queues=[Queue(queue, expires=600.0)],
        broker_connection_retry_on_startup=False,
        worker_hijack_root_logger=False,
        # Redis redelivers an unacknowledged message after the visibility
        # timeout; short here so a killed worker's message comes back in
        # seconds. The unacked keys are the queue's own, so this app never
        # restores messages of any other app sharing the Redis server.
        broker_transport_options={
            "visibility_timeout": VISIBILITY_TIMEOUT,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            "unacked_key": f"{queue}.unacked",
            "unacked_index_key": f"{queue}.unacked_index",
            "unacked_mutex_key": f"{queue}.unacked_mutex",
        },
    )
    # Lazy, so that building the app never touches the models before the
    # worker's Django setup has run.
    app.autodiscover_tasks(["django_idempotency", "tests"])
    # The endings table's tasks (tests/test_endings.py).
    app.autodiscover_tasks(["tests"], related_name="endings_tasks")
    return app


if BROKER_ENV in os.environ:
    app = make_app(os.environ[BROKER_ENV], os.environ[QUEUE_ENV])
