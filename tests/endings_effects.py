"""What the endings table's handlers do besides answering: count, hold, lose their connection.

Shared by the views (``tests/endings_views.py``, in gunicorn and uvicorn)
and the tasks (``tests/endings_tasks.py``, in a Celery worker). Every file
lives in the directory the test passes in the environment: the servers'
control directory, or the worker's task directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from django.db import connection, connections

from tests.drf_views import CONTROL_DIR_ENV
from tests.tasks import TASK_DIR_ENV

#: How long a handler waits for the test's go-ahead before giving up on its own.
HOLD_LIMIT = 20.0
#: The endings whose handler reports ``<key>.held`` and waits for ``<key>.go``.
HOLDING = frozenset({"disconnect_before", "kill9", "db_kill_mid"})


def control_dir() -> Path:
    return Path(os.environ.get(CONTROL_DIR_ENV) or os.environ[TASK_DIR_ENV])


def count_run(key: str) -> int:
    """Append this run (PID and time) to ``<key>.runs``; return the run's number."""
    runs = control_dir() / f"{key}.runs"
    with runs.open("a") as lines:
        lines.write(f"{os.getpid()} {time.time()}\n")
    return len(runs.read_text().splitlines())


def server_connection_id() -> int | None:
    """The database server's id of this thread's connection (``None`` on SQLite)."""
    if connection.vendor == "sqlite":
        return None
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_backend_pid()")
        else:
            cursor.execute("SELECT CONNECTION_ID()")
        return int(cursor.fetchone()[0])


def kill_own_connection() -> None:
    """End this thread's connection from a second one, as a failover would."""
    server_id = server_connection_id()
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            if other.vendor == "postgresql":
                cursor.execute("SELECT pg_terminate_backend(%s)", [server_id])
            else:
                cursor.execute(f"KILL {int(server_id or 0)}")
    finally:
        other.close()


def report(name: str, **fields: Any) -> None:
    """Write ``name`` (JSON: this PID and ``fields``) in the control directory, whole."""
    control = control_dir()
    (control / f"{name}.tmp").write_text(json.dumps({"pid": os.getpid(), **fields}))
    (control / f"{name}.tmp").replace(control / name)


def hold(key: str, *, what: str = "held", **fields: Any) -> bool:
    """Report ``<key>.<what>``, then wait for ``<key>.go``; ``False`` if it never came."""
    report(f"{key}.{what}", **fields)
    go = control_dir() / f"{key}.go"
    deadline = time.monotonic() + HOLD_LIMIT
    while not go.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


async def ahold(key: str, *, what: str = "held", **fields: Any) -> bool:
    """:func:`hold` on the event loop."""
    report(f"{key}.{what}", **fields)
    go = control_dir() / f"{key}.go"
    deadline = time.monotonic() + HOLD_LIMIT
    while not go.exists():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True
