"""A consumer process for ``tests/test_consumer.py``: the example's loop on the test database.

``python -m tests.consumer_process BROKER_URL QUEUE [IDLE_SECONDS]`` sets
Django up on the server settings (the test database, whose name the test
passes in the environment) and runs ``example_project.shop.consumer`` on
``QUEUE`` with :func:`handle`, until it is killed or, with
``IDLE_SECONDS``, until the queue stays empty that long.

The handler is the example's, on the tests' ``Order``: an
``idempotent_function`` keyed by the message id, atomic mode. Around it,
for the test to see: each call is appended to ``calls`` and each run of
the body to ``runs`` in the directory the test passes; a body ``{"poison":
true}`` raises; and with ``CRASH_AFTER_COMMIT_ENV`` naming a message id,
the process kills itself (``SIGKILL``) once, after that message's effect
has committed and before the loop acknowledges it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

#: Where the calls, runs and markers go; set by the test.
CONSUMER_DIR_ENV = "IDEMPOTENCY_CONSUMER_DIR"
#: A message id: die after its commit, before its ack, the first time.
CRASH_AFTER_COMMIT_ENV = "IDEMPOTENCY_CONSUMER_CRASH_AFTER_COMMIT"
#: Seconds each message takes after its commit, so that a test can kill mid-stream.
DELAY_ENV = "IDEMPOTENCY_CONSUMER_DELAY"
#: The scope of the handler's records.
SCOPE = "tests.consumer.place_order"


def directory() -> Path:
    return Path(os.environ[CONSUMER_DIR_ENV])


def note(name: str, message_id: str) -> None:
    with (directory() / name).open("a") as lines:
        lines.write(f"{message_id}\n")


def handler() -> Any:
    from django_idempotency import idempotent_function
    from tests.models import Order

    @idempotent_function(key=lambda message_id, order: message_id, scope=SCOPE)
    def place_order(message_id: str, order: dict[str, Any]) -> dict[str, Any]:
        note("runs", message_id)
        if order.get("poison"):
            raise ValueError("this message cannot be handled")
        placed = Order.objects.create(item=message_id, quantity=order.get("quantity", 1))
        return {"order": placed.pk}

    crash_after = os.environ.get(CRASH_AFTER_COMMIT_ENV)
    delay = float(os.environ.get(DELAY_ENV, "0"))

    def handle(message_id: str, order: dict[str, Any]) -> dict[str, Any]:
        note("calls", message_id)
        value = place_order(message_id, order)
        marker = directory() / "crashed"
        if message_id == crash_after and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)  # committed, not yet acknowledged
        time.sleep(delay)
        return value

    return handle


def main(argv: list[str]) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.server_settings")
    import django

    django.setup()
    import kombu

    from example_project.shop.consumer import consume, declare

    broker, queue_name, *idle = argv
    with kombu.Connection(broker) as connection:
        queue = declare(connection, queue_name)
        (directory() / f"consuming-{os.getpid()}").touch()
        consume(connection, queue, handler(), idle_timeout=float(idle[0]) if idle else None)


if __name__ == "__main__":
    main(sys.argv[1:])
