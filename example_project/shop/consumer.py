"""A RabbitMQ consumer loop whose messages have their effect once, however often they arrive.

RabbitMQ delivers a message at least once: a consumer that dies after its
work committed but before it acknowledged gets the message again, on
restart or on another consumer. The loop makes that harmless by the order
of two steps:

1. ``handle(message_id, body)``, an ``idempotent_function`` keyed by the
   message id in atomic mode: the effect and the record of the id commit
   in one transaction, or neither does;
2. then the acknowledgement.

Killed before 1 commits, nothing is kept and the redelivery runs it;
killed between 1 and 2, the redelivery finds the id done and gets the
stored value without running the effect. A message whose handler raises
(a poison message) commits nothing and is rejected to the dead-letter
queue, where it waits for someone to look at it; it is never marked done.

Copy it as it is: it needs only kombu (which Celery brings) and a handler.
``manage.py consume_orders`` runs it for the shop; ``docs/messages.rst``
explains each choice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import kombu
from django.db import InterfaceError, OperationalError, close_old_connections

from django_idempotency.exceptions import CallInFlight

logger = logging.getLogger(__name__)

Handler = Callable[[str, Any], Any]

#: Seconds to wait before handing back a message whose database was unreachable.
DATABASE_PAUSE = 1.0


def declare(connection: kombu.Connection, name: str) -> kombu.Queue:
    """Declare the durable work queue ``name`` and its dead-letter queue ``<name>.dead``.

    A message the consumer rejects goes to the dead-letter exchange, and
    from there to ``<name>.dead``, instead of being dropped.
    """
    dead_exchange = kombu.Exchange(f"{name}.dead", type="direct", durable=True)
    dead = kombu.Queue(f"{name}.dead", dead_exchange, routing_key=name, durable=True)
    exchange = kombu.Exchange(name, type="direct", durable=True)
    queue = kombu.Queue(
        name,
        exchange,
        routing_key=name,
        durable=True,
        queue_arguments={"x-dead-letter-exchange": dead_exchange.name},
    )
    channel = connection.default_channel
    dead(channel).declare()
    queue(channel).declare()
    return queue


def consume(
    connection: kombu.Connection,
    queue: kombu.Queue,
    handle: Handler,
    *,
    prefetch: int = 10,
    idle_timeout: float | None = None,
) -> None:
    """Call ``handle(message_id, body)`` for each message of ``queue``, then acknowledge it.

    Runs until the process is stopped (any way: a ``kill -9`` loses
    nothing), or, with ``idle_timeout``, until no message has come for that
    many seconds. ``prefetch`` bounds the messages a consumer holds
    unacknowledged; the broker redelivers them if it dies.
    """

    def on_message(body: Any, message: kombu.Message) -> None:
        message_id = message.properties.get("message_id")
        if not message_id:
            # Without a stable id, a redelivery cannot be told from new work.
            logger.error("Dead-lettered a message without a message_id.")
            message.reject(requeue=False)
            return
        # As Django does around each request: drop a connection that broke
        # or outlived CONN_MAX_AGE.
        close_old_connections()
        try:
            handle(message_id, body)
        except CallInFlight:
            # Another consumer is handling this id now (a redelivery raced
            # the original): hand it back; it will find the id done.
            message.requeue()
            return
        except (InterfaceError, OperationalError):
            # The database went away: nothing committed. Try again later.
            logger.warning("Database unavailable; message %s handed back.", message_id)
            close_old_connections()
            time.sleep(DATABASE_PAUSE)
            message.requeue()
            return
        except Exception:
            # A poison message (or the same id with another body): its
            # transaction rolled back, so nothing marks it done.
            logger.exception("Message %s failed; dead-lettered.", message_id)
            message.reject(requeue=False)
            return
        message.ack()

    consumer = connection.Consumer(
        [queue], callbacks=[on_message], accept=["json"], prefetch_count=prefetch
    )
    with consumer:
        while True:
            try:
                connection.drain_events(timeout=idle_timeout or 5.0)
            except TimeoutError:
                if idle_timeout is not None:
                    return
                connection.heartbeat_check()
