"""The endings table's tasks of Django's Tasks framework, at module level as it wants them.

The body is ``tests.endings_function``'s; a sync task for each mode, enqueued
on the ImmediateBackend, and an ``async def`` one, awaited through
``Task.acall()`` with no context, so keyed by its arguments.
"""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async

from django_idempotency.contrib.django_tasks import idempotent_task
from tests.endings_function import LEASE_SECONDS, WAIT_SECONDS, body


def by_key(key: str, ending: str) -> str:
    return key


OPTIONS: dict[str, Any] = {"key": by_key, "wait": WAIT_SECONDS, "lease": LEASE_SECONDS}


@idempotent_task(atomic=True, **OPTIONS)
def enqueued_atomic(key: str, ending: str) -> dict[str, Any]:
    return body(key, ending)


@idempotent_task(atomic=False, **OPTIONS)
def enqueued_lease(key: str, ending: str) -> dict[str, Any]:
    return body(key, ending)


@idempotent_task(atomic=True, **OPTIONS)
async def awaited_atomic(key: str, ending: str) -> dict[str, Any]:
    return await sync_to_async(body)(key, ending)


@idempotent_task(atomic=False, **OPTIONS)
async def awaited_lease(key: str, ending: str) -> dict[str, Any]:
    return await sync_to_async(body)(key, ending)


TASKS = {
    ("enqueue", True): enqueued_atomic,
    ("enqueue", False): enqueued_lease,
    ("acall", True): awaited_atomic,
    ("acall", False): awaited_lease,
}
