"""Idempotent tasks the Celery tests run on a real worker.

A body reports that it started, and can be held there, through files in the
directory named by ``IDEMPOTENCY_TEST_TASK_DIR``: ``<label>.started`` gets a
line per run, and the body waits while ``<label>.hold`` exists, so a test can
kill the worker while the body's transaction is open.
"""

from __future__ import annotations

import json
import os
import threading
import time
from decimal import Decimal
from pathlib import Path

from celery import shared_task
from celery.exceptions import Ignore
from django.db import connection, connections

from django_idempotency import idempotent_function
from django_idempotency.contrib.celery import idempotent_task
from tests.models import Order, RemoteCharge

TASK_DIR_ENV = "IDEMPOTENCY_TEST_TASK_DIR"
#: The lease of the lease-mode tasks: short, so a takeover takes seconds.
LEASE_SECONDS = 4
#: The lease of a task whose worker is killed and started again, with a copy sent inside
#: the dead owner's lease: it outlasts a worker's start on a loaded machine. The copy is
#: put off again and again until the lease runs out, hence the task's ``max_retries``.
CRASH_LEASE_SECONDS = 15
HOLD_LIMIT = 120.0


def checkpoint(label: str) -> int:
    """Record one run of the body; hold it while the test says so. Returns the run number."""
    directory = os.environ.get(TASK_DIR_ENV)
    if not directory:
        return 1
    started = Path(directory, f"{label}.started")
    with started.open("a") as runs:
        runs.write(f"{os.getpid()}\n")
    hold = Path(directory, f"{label}.hold")
    deadline = time.monotonic() + HOLD_LIMIT
    while hold.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(started.read_text().splitlines())


@shared_task
@idempotent_task(key=lambda label, **kwargs: f"order-{label}")
def place_order(label: str, pause: float = 0.0) -> dict:
    """Atomic mode, keyed by the work: many publishes of one label are one order."""
    order = Order.objects.create(item=label)
    time.sleep(pause)
    return {"label": label, "order": order.pk}


@shared_task
@idempotent_task(key=lambda label, **kwargs: f"order-{label}")
def place_other_order(label: str) -> dict:
    """The same keys as place_order, in another task: another scope."""
    return {"order": Order.objects.create(item=label).pk}


@shared_task(acks_late=True, reject_on_worker_lost=True)
@idempotent_task
def hold_order(label: str) -> dict:
    """Atomic mode keyed by the task id; held open for a crash."""
    order = Order.objects.create(item=label)
    checkpoint(label)
    return {"order": order.pk}


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=10)
@idempotent_task(atomic=False, lease=CRASH_LEASE_SECONDS)
def charge_and_hold(self, label: str) -> dict:  # type: ignore[no-untyped-def]
    """Lease mode: a remote charge keyed by derive(), then held for a crash."""
    reference = self.request.idempotency.derive("charge")
    charge, _ = RemoteCharge.objects.get_or_create(reference=reference, defaults={"item": label})
    checkpoint(label)
    Order.objects.create(item=label)
    return {"charge": charge.pk, "reference": reference}


@shared_task(autoretry_for=(RuntimeError,), default_retry_delay=0, max_retries=5)
@idempotent_task(key=lambda label, failures: f"flaky-{label}")
def flaky_order(label: str, failures: int) -> dict:
    """Writes, then raises on its first ``failures`` runs; Celery's autoretry runs it again."""
    order = Order.objects.create(item=label)
    run = checkpoint(label)
    if run <= failures:
        raise RuntimeError(f"run {run} fails")
    return {"order": order.pk, "run": run}


@shared_task(autoretry_for=(Exception,), default_retry_delay=1, max_retries=4)
@idempotent_task(atomic=False, lease=1, key=lambda label: f"unstorable-lease-{label}")
def unstorable_lease_charge(label: str) -> Decimal:
    """Lease mode: charges, then returns what JSON cannot hold; autoretry asks again and again.

    A one-second lease, so that the retries come after it would have run out.
    """
    checkpoint(label)
    Order.objects.create(item=label)
    return Decimal("9.99")


@shared_task(bind=True, autoretry_for=(RuntimeError,), default_retry_delay=0, max_retries=5)
@idempotent_task(atomic=False, key=lambda label, failures: f"flaky-lease-{label}")
def flaky_lease_order(self, label: str, failures: int) -> dict:  # type: ignore[no-untyped-def]
    """Lease mode: the claim is released when the body raises, so the retry runs."""
    run = checkpoint(label)
    if run <= failures:
        raise RuntimeError(f"run {run} fails")
    order = Order.objects.create(item=label)
    return {"order": order.pk, "run": run}


@shared_task
@idempotent_task(key=lambda label: f"unstorable-{label}")
def unstorable_order(label: str) -> set:
    Order.objects.create(item=label)
    return {label}


@shared_task
@idempotent_task(key=lambda label, hold: f"slow-{label}", wait=0.5)
def slow_order(label: str, hold: bool) -> dict:
    """Atomic mode with a short wait: a duplicate outlasts it and is retried later."""
    order = Order.objects.create(item=label)
    if hold:
        checkpoint(label)
    return {"order": order.pk}


# Set by a test, once: the next lease_order body loses its database
# connection after writing, or raises after writing.
lose_connection = threading.Event()
fail_next_run = threading.Event()


def kill_this_connection() -> None:
    """End this thread's connection from another one, as a server restart would."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_backend_pid()")
        else:
            cursor.execute("SELECT CONNECTION_ID()")
        server_id = cursor.fetchone()[0]
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            if other.vendor == "postgresql":
                cursor.execute("SELECT pg_terminate_backend(%s)", [server_id])
            else:
                cursor.execute(f"KILL {int(server_id)}")
    finally:
        other.close()


def _consume(flag: threading.Event) -> bool:
    if flag.is_set():
        flag.clear()
        return True
    return False


@shared_task
@idempotent_task(atomic=False, key=lambda label, **kwargs: f"lease-order-{label}")
def lease_order(label: str, unstorable: bool = False) -> object:
    """Lease mode: writes its effect, then may lose its connection, raise, or return a set."""
    order = Order.objects.create(item=label)
    if _consume(lose_connection):
        kill_this_connection()
    if _consume(fail_next_run):
        raise RuntimeError("the body failed after writing")
    if unstorable:
        return {label}
    return {"order": order.pk}


@shared_task
def record_receipt(order_pk: int, label: str) -> dict:
    """A task a view publishes: records each run, and what it found committed when it ran.

    One line per run in ``<label>.seen``: whether the view's order and its
    completed idempotency record were visible to the worker, that is
    whether the view's transaction had committed before the task ran.
    """
    from django_idempotency.models import IdempotencyKey

    seen = {
        "order": Order.objects.filter(pk=order_pk).exists(),
        "key_completed": IdempotencyKey.objects.filter(
            key=label, state=IdempotencyKey.State.COMPLETED
        ).exists(),
    }
    directory = os.environ.get(TASK_DIR_ENV)
    if directory:
        with Path(directory, f"{label}.seen").open("a") as runs:
            runs.write(json.dumps(seen) + "\n")
    return seen


def receipts_seen(directory: Path, label: str) -> list[dict]:
    """What each run of ``record_receipt`` for ``label`` saw, in order."""
    seen = directory / f"{label}.seen"
    return [json.loads(line) for line in seen.read_text().splitlines()] if seen.exists() else []


@shared_task
@idempotent_task(key=lambda reference: f"receipt-{reference}")
def logged_order(reference: str) -> dict:
    """Keyed by a reference it never returns, so a log that shows the key shows it from us."""
    return {"order": Order.objects.create(item="logged").pk}


def _count_down(task, label: str, step: int) -> dict:  # type: ignore[no-untyped-def]
    """One order per step, each step replacing the task with the next."""
    Order.objects.create(item=f"{label}-{step}")
    checkpoint(label)
    if step > 0:
        return task.replace(task.si(label, step - 1))
    return {"done": label}


@shared_task(bind=True)
@idempotent_task
def count_down(self, label: str, step: int) -> dict:  # type: ignore[no-untyped-def]
    """Keyed by the task id, in atomic mode."""
    return _count_down(self, label, step)


@shared_task(bind=True)
@idempotent_task(atomic=False)
def count_down_lease(self, label: str, step: int) -> dict:  # type: ignore[no-untyped-def]
    """Keyed by the task id, in lease mode."""
    return _count_down(self, label, step)


@shared_task
@idempotent_task
def walk_tree(node: int) -> dict:
    """Keyed by the task id: one order per node, its children handled by direct calls."""
    Order.objects.create(item=f"node-{node}")
    children = [walk_tree(child) for child in (2 * node, 2 * node + 1) if child < 4]
    return {"node": node, "children": children}


@shared_task(bind=True)
@idempotent_task(key=lambda label: f"poll-{label}")
def poll_under_one_key(self, label: str) -> dict:  # type: ignore[no-untyped-def]
    """Replaces itself with the same arguments, so with the same key: a mistake."""
    checkpoint(label)
    return self.replace(self.si(label))


@idempotent_function(key=lambda label: f"apply-{label}")
def apply_then_stop(label: str) -> None:
    """A function a task calls: it writes, then ends the task on purpose."""
    Order.objects.create(item=label)
    raise Ignore()


@shared_task
@idempotent_task(key=lambda label: f"stopping-{label}")
def stop_in_a_function(label: str) -> dict:
    Order.objects.create(item=f"{label}-task")
    apply_then_stop(label)
    return {"unreachable": label}


@shared_task
def plain_stop_in_a_function(label: str) -> dict:
    apply_then_stop(label)
    return {"unreachable": label}


@shared_task(soft_time_limit=1)
@idempotent_task(atomic=False, key=lambda label: f"soft-limit-{label}", lease=LEASE_SECONDS)
def outlive_soft_limit(label: str) -> dict:
    """Lease mode: interrupted by Celery's soft time limit while it acts."""
    checkpoint(label)
    RemoteCharge.objects.create(reference=f"soft-limit-{label}", item=label)
    time.sleep(5)
    return {"label": label}


@shared_task
def take_over_from(label: str) -> dict:
    """What :func:`hand_over` replaces itself with."""
    checkpoint(f"{label}-replacement")
    return {"replacement": label}


@shared_task(bind=True)
@idempotent_task
def hand_over(self, label: str) -> dict:  # type: ignore[no-untyped-def]
    """Keyed by the task id: replaces itself, handing the rest of its chain over."""
    checkpoint(f"{label}-first")
    return self.replace(take_over_from.si(label))


@shared_task
@idempotent_task
def end_of_chain(label: str) -> dict:
    Order.objects.create(item=f"{label}-tail")
    checkpoint(f"{label}-tail")
    return {"tail": label}


@shared_task(bind=True)
@idempotent_task
def stop_once(self, label: str) -> None:  # type: ignore[no-untyped-def]
    """Keyed by the task id: writes, then ends on purpose."""
    Order.objects.create(item=label)
    checkpoint(label)
    raise Ignore()


@shared_task(bind=True)
@idempotent_task(atomic=False)
def count_down_noting(self, label: str, step: int) -> dict:  # type: ignore[no-untyped-def]
    """:func:`count_down_lease`, recording each step with ``request.idempotency``."""
    self.request.idempotency.checkpoint(f"step-{step}")
    if step > 0:
        return self.replace(self.si(label, step - 1))
    return {"done": label, "key": self.request.idempotency.key}


#: Runs of :func:`charge_then_fail` still to fail after their checkpoint, in process.
fail_after_charging: list[bool] = []


@shared_task(bind=True)
@idempotent_task(atomic=False, key=lambda label, amount: f"charge-{label}")
def charge_then_fail(self, label: str, amount: int) -> dict:  # type: ignore[no-untyped-def]
    """Lease mode: records a charge, then fails while ``fail_after_charging`` says so."""
    info = self.request.idempotency
    resumed = sorted(info.checkpoints)
    if "charged" not in resumed:
        reference = info.derive("charge")
        RemoteCharge.objects.get_or_create(reference=reference, defaults={"item": label})
        info.checkpoint("charged", {"amount": amount})
    if fail_after_charging:
        fail_after_charging.pop()
        raise RuntimeError("failed after charging")
    return {"amount": amount, "resumed": resumed}
