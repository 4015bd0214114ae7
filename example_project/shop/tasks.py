"""The shop's Celery task: a receipt per order, once, however often it is sent."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from celery import shared_task
from django.conf import settings

from django_idempotency.tasks import idempotent_task
from example_project.shop.models import Order, Receipt


@shared_task(acks_late=True, reject_on_worker_lost=True)
@idempotent_task(key=lambda order_id: f"receipt-{order_id}")
def send_receipt(order_id: int) -> dict:
    """Atomic mode: the receipt and the task's record commit together.

    ``acks_late`` with ``reject_on_worker_lost`` puts the message back when
    the worker running it dies, so a crash delays the receipt instead of
    losing it; the record makes the redelivered message (or a second
    publish for the same order) write no second receipt.
    """
    order = Order.objects.get(pk=order_id)
    receipt = Receipt.objects.create(order=order)
    if settings.EXAMPLE_CRASH_TASKS_ONCE:
        _crash_once(f"receipt-{order_id}")
    return {"order": order.pk, "receipt": receipt.pk}


def _crash_once(name: str) -> None:
    """The walkthrough's worker dies here, transaction open, the first time only."""
    marker = Path(settings.EXAMPLE_CRASH_TASKS_ONCE, name)
    if not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
