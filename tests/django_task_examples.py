"""Idempotent tasks of Django's Tasks framework, for ``tests/test_django_tasks.py``.

The framework wants its tasks at module level, so they live here. Each
writes an ``Order`` named after its argument as its effect and appends its
run to ``<name>.runs`` in the directory the test passes in the environment
(when it does). In the worker tests they run in ``db_worker`` processes of
``django-tasks-db`` (see ``tests/django_task_results.py``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from django_idempotency.contrib.django_tasks import idempotent_task
from tests.models import Order

#: Where the tasks record their runs; the worker tests set it.
RUNS_DIR_ENV = "IDEMPOTENCY_TASK_RUNS_DIR"
#: Seconds a task holds after writing, so that a duplicate meets it in flight.
HOLD_ENV = "IDEMPOTENCY_TASK_HOLD"


def _effect(name: str, quantity: int = 1) -> dict[str, Any]:
    directory = os.environ.get(RUNS_DIR_ENV)
    if directory:
        with (Path(directory) / f"{name}.runs").open("a") as runs:
            runs.write(f"{os.getpid()}\n")
    order = Order.objects.create(item=name, quantity=quantity)
    time.sleep(float(os.environ.get(HOLD_ENV, "0")))
    return {"order": order.pk, "item": name, "quantity": quantity}


@idempotent_task
def by_result_id(name: str) -> dict[str, Any]:
    """Keyed by the result's id: one enqueue, one effect, however often it runs."""
    return _effect(name)


@idempotent_task(key=lambda name, quantity=1: f"order-{name}")
def place_order(name: str, quantity: int = 1) -> dict[str, Any]:
    """Keyed by its arguments: two enqueues of the same order are one effect."""
    return _effect(name, quantity)


@idempotent_task(key=lambda name, quantity=1: f"order-{name}", atomic=False)
def place_order_lease(name: str, quantity: int = 1) -> dict[str, Any]:
    return _effect(name, quantity)


@idempotent_task(key=lambda name: name, takes_context=True, priority=10)
def with_context(context: Any, name: str) -> dict[str, Any]:
    return {**_effect(name), "attempt": context.attempt, "result": str(context.task_result.id)}


@idempotent_task(key=lambda name: name)
async def async_order(name: str) -> dict[str, Any]:
    order = await Order.objects.acreate(item=name)
    return {"order": order.pk}


@idempotent_task(key=lambda name: name)
def failing(name: str) -> None:
    Order.objects.create(item=name)
    raise RuntimeError("the task failed after writing")


@idempotent_task(key=lambda name: name)
def stops_as_celery_would(name: str) -> None:
    """Celery's Ignore means nothing to this framework: a failure like any other."""
    from celery.exceptions import Ignore

    Order.objects.create(item=name)
    raise Ignore()


TASKS = {
    task.name: task
    for task in (
        by_result_id,
        place_order,
        place_order_lease,
        with_context,
        async_order,
        failing,
        stops_as_celery_would,
    )
}
