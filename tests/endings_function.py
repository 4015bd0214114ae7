"""The endings table's rows for protected calls: ``idempotent_function`` and Django's tasks.

``python -m tests.endings_function`` is a caller process, as a message
consumer or a webhook worker on another host is. It sets Django up on the
endings settings once, then takes calls on its standard input, one JSON
line each (``caller``, ``key``, ``ending``, ``mode``), and answers each on
its standard output with one JSON line, its key and: ``SUCCESS`` and the value,
``FAILURE`` and the error, or ``IN_FLIGHT`` and its ``retry_after`` (``None``
when the caller is not told it) when the package refused to run the body
alongside an original still running. Every call starts on fresh database
connections, as a consumer's next message does. The test keeps a few of
these processes (``CallerProcesses`` in ``tests/endings_cells.py``); a
``kill9`` ending kills the one whose call it is.

As the views and tasks do, the body counts its run, writes an ``Order``
named after the key, and ends as ``ending`` says on its first run only.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable
from typing import Any

#: Seconds: a lease other than the settings' (``tests/endings_settings.py``), so that a
#: decorator that dropped its own would be seen holding a dead owner's claim too briefly.
LEASE_SECONDS = 3
WAIT_SECONDS = 1


def body(key: str, ending: str) -> dict[str, Any]:
    from tests.endings_effects import (
        HOLDING,
        count_run,
        hold,
        kill_own_connection,
        server_connection_id,
    )
    from tests.models import Order

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
    if ending == "db_kill_after":
        kill_own_connection()
    return value


def protected(atomic: bool) -> Callable[[str, str], Any]:
    from django_idempotency import idempotent_function

    @idempotent_function(
        scope=f"tests.endings_function.{'atomic' if atomic else 'lease'}",
        key=lambda key, ending: key,
        atomic=atomic,
        wait=WAIT_SECONDS,
        lease=LEASE_SECONDS,
    )
    def endings_function(key: str, ending: str) -> dict[str, Any]:
        return body(key, ending)

    return endings_function


def call_function(key: str, ending: str, atomic: bool) -> dict[str, Any]:
    return succeeded(protected(atomic)(key, ending))


def enqueue_django_task(key: str, ending: str, atomic: bool) -> dict[str, Any]:
    """Enqueued on the Tasks framework's ImmediateBackend, which keeps a failure's class only."""
    from django_idempotency.exceptions import CallInFlight, IdempotencyError
    from tests import endings_django_tasks

    task = endings_django_tasks.TASKS["enqueue", atomic]
    result = task.enqueue(key, ending)
    if result.status.name == "SUCCESSFUL":
        return succeeded(result.return_value)
    error = result.errors[-1].exception_class
    if issubclass(error, CallInFlight):
        return {"status": "IN_FLIGHT", "retry_after": None}
    if issubclass(error, IdempotencyError):
        return {"status": "REFUSED", "error": error.__name__}
    return {"status": "FAILURE", "error": error.__name__}


def acall_django_task(key: str, ending: str, atomic: bool) -> dict[str, Any]:
    """An ``async def`` task awaited through ``Task.acall()``: no framework, no context."""
    from asgiref.sync import sync_to_async
    from django.db import connections

    from tests import endings_django_tasks

    task = endings_django_tasks.TASKS["acall", atomic]

    async def awaited() -> Any:
        # The body's queries run in asgiref's one thread: its connections start fresh too.
        await sync_to_async(connections.close_all)()
        return await task.acall(key, ending)

    return succeeded(asyncio.run(awaited()))


CALLERS: dict[str, Callable[[str, str, bool], dict[str, Any]]] = {
    "idempotent_function": call_function,
    "django_task_enqueue": enqueue_django_task,
    "django_task_acall": acall_django_task,
}


def succeeded(value: Any) -> dict[str, Any]:
    return {"status": "SUCCESS", "value": value}


def call(caller: str, key: str, ending: str, mode: str) -> dict[str, Any]:
    from django_idempotency.exceptions import IdempotencyError

    try:
        return CALLERS[caller](key, ending, mode == "atomic")
    except IdempotencyError as error:
        retry_after = getattr(error, "retry_after", None)
        if retry_after is None:
            return {"status": "REFUSED", "error": type(error).__name__}
        return {"status": "IN_FLIGHT", "retry_after": retry_after}
    except Exception as error:
        return {"status": "FAILURE", "error": type(error).__name__}


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.endings_settings")
    import django
    from django.db import connections

    django.setup()
    for line in sys.stdin:
        asked = json.loads(line)
        # What the call logs follows its key in this process's log.
        print(f"--- {asked['caller']} {asked['key']}", file=sys.stderr, flush=True)
        connections.close_all()  # a killed connection stays with the call that lost it
        answer = {**call(**asked), "key": asked["key"]}
        print(json.dumps(answer, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
