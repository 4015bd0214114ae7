"""Leases for the admin's tests, taken through the package: a lease-mode function held open.

``hold(order)`` calls :func:`charge` in a thread of its own, which claims
the key as any caller would and then waits inside its body until the test
lets it finish; :func:`run_out` ends a held lease by the database's clock,
as a stalled owner's runs out, so that the next call takes the key over.
"""

from __future__ import annotations

import queue
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from django_idempotency import idempotent_function
from django_idempotency.clock import DatabaseNow
from django_idempotency.models import IdempotencyKey
from tests.polling import in_background

SCOPE = "billing.charge"
#: The longest a held call waits to be let finish (a test that failed first).
HOLD_LIMIT = 30.0

_gates: defaultdict[str, queue.Queue[tuple[threading.Event, threading.Event]]] = defaultdict(
    queue.Queue
)


@idempotent_function(scope=SCOPE, key=lambda order: order, atomic=False)
def charge(order: str) -> str:
    """A payment provider's charge: runs until the test lets it finish."""
    entered, finish = _gates[order].get_nowait()
    entered.set()
    assert finish.wait(HOLD_LIMIT), f"the charge of {order} was never let finish"
    return f"charged {order}"


@dataclass
class HeldCall:
    """A call of :func:`charge` inside its body, its lease held."""

    order: str
    _finish: threading.Event
    _join: Callable[[], Any]

    def finish(self) -> Any:
        """Let the body return; what the call returned."""
        self._finish.set()
        return self._join()

    def record(self) -> IdempotencyKey:
        return IdempotencyKey.objects.get(scope=SCOPE, key=self.order)


def hold(order: str) -> HeldCall:
    """Call :func:`charge` in a thread and return once its body runs (the key is claimed)."""
    entered, finish = threading.Event(), threading.Event()
    _gates[order].put((entered, finish))
    join = in_background(lambda: charge(order), limit=HOLD_LIMIT + 10)
    assert entered.wait(10), f"the charge of {order} did not start"
    return HeldCall(order, finish, join)


def finish_all(calls: Sequence[HeldCall]) -> None:
    """Let every call finish, whatever one of them raised; then raise what it raised.

    All are let go before any is waited for, so that a call that failed
    leaves none of the others blocked in its body until ``HOLD_LIMIT``.
    """
    for call in calls:
        call._finish.set()
    with ExitStack() as stack:
        # Each waited for in turn, in order; one raising does not stop the next.
        for call in reversed(calls):
            stack.callback(call.finish)


def complete(order: str) -> str:
    """Call :func:`charge` to the end: a completed record."""
    call = hold(order)
    return str(call.finish())


def run_out(record: IdempotencyKey) -> None:
    """End the record's lease now, by the database's clock: its owner stalled past it."""
    now = DatabaseNow()
    IdempotencyKey.objects.filter(pk=record.pk).update(locked_until=now, expires_at=now)
