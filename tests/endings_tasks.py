"""The endings table's Celery tasks: the table's handler as an ``@idempotent_task`` body.

As the views (``tests/endings_views.py``) do, the body counts its run in
``<key>.runs`` and writes an ``Order`` named after the key, then ends as
``ending`` says on its first run only; later runs return their value. Files
live in the worker's task directory.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task
from celery.exceptions import Ignore, Reject

from django_idempotency.contrib.celery import idempotent_task
from tests.endings_effects import (
    HOLDING,
    control_dir,
    count_run,
    hold,
    kill_own_connection,
    server_connection_id,
)
from tests.models import Order

#: Seconds; as the servers' LEASE (tests/endings_settings.py).
LEASE_SECONDS = 2
WAIT_SECONDS = 1


def body(task: Any, key: str, ending: str) -> dict[str, Any]:
    run = count_run(key)
    order = Order.objects.create(item=key)
    value = {"key": key, "run": run, "order": order.pk}
    if run > 1:
        return value
    if ending in HOLDING:
        server_id = server_connection_id() if ending == "db_kill_mid" else None
        if not hold(key, connection=server_id):
            raise RuntimeError("the test never gave the go-ahead")
        if ending == "db_kill_mid":
            # The connection was killed while the body waited: this fails.
            value["orders"] = Order.objects.filter(item=key).count()
    if ending == "raises":
        raise RuntimeError("the body failed after writing")
    if ending == "ignore":
        raise Ignore()
    if ending == "replace":
        raise task.replace(endings_replacement.s(key))
    if ending == "retry":
        # At once, so that the retry may run before this run's RETRY state is
        # written: the table reads how it ended from the worker's log.
        raise task.retry(countdown=0)
    if ending == "reject":
        raise Reject("the body rejected its message", requeue=True)
    if ending == "db_kill_after":
        kill_own_connection()
    return value


def _key(key: str, ending: str) -> str:
    return key


@shared_task(bind=True, acks_late=True)
@idempotent_task(key=_key, wait=WAIT_SECONDS, lease=LEASE_SECONDS)
def endings_atomic(self: Any, key: str, ending: str) -> dict[str, Any]:
    return body(self, key, ending)


@shared_task(bind=True, acks_late=True)
@idempotent_task(key=_key, atomic=False, wait=WAIT_SECONDS, lease=LEASE_SECONDS)
def endings_lease(self: Any, key: str, ending: str) -> dict[str, Any]:
    return body(self, key, ending)


@shared_task
def endings_replacement(key: str) -> dict[str, Any]:
    """What ``self.replace(...)`` hands the work to: counted in ``<key>.replacement``."""
    with (control_dir() / f"{key}.replacement").open("a") as lines:
        lines.write("1\n")
    return {"key": key, "replaced": True}
