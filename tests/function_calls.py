"""A process that calls an ``idempotent_function`` once, when the test says go.

``python -m tests.function_calls BATCH KEY MODE QUANTITY`` sets Django up on
the server settings (the test database, whose name the test passes in the
environment), connects, reports ``<BATCH>-<pid>.ready`` in the control
directory and waits for ``<BATCH>.go`` there, so that every process of a
batch calls at the same moment.
It then calls :func:`protected` once and prints what the call got as one
JSON line: ``SUCCESS`` and the value, ``IN_FLIGHT`` and ``retry_after``,
or ``MISMATCH``. The body appends its run to ``<key>.runs``, writes an
``Order`` named after the key and holds a second, so that the other calls
meet it in flight.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

#: Where the processes report and wait; the test passes it in the environment.
CONTROL_DIR_ENV = "IDEMPOTENCY_FUNCTION_CONTROL_DIR"
#: How long the body holds, and how long an atomic-mode duplicate waits for it.
HOLD_SECONDS = 1.0
WAIT_SECONDS = 15
GO_LIMIT = 60.0


def control_dir() -> Path:
    return Path(os.environ[CONTROL_DIR_ENV])


def protected(atomic: bool) -> Any:
    from django_idempotency import idempotent_function
    from tests.models import Order

    @idempotent_function(
        key=lambda key, quantity: key,
        scope="tests.function_calls.place",
        atomic=atomic,
        wait=WAIT_SECONDS,
    )
    def place(key: str, quantity: int) -> dict[str, Any]:
        with (control_dir() / f"{key}.runs").open("a") as runs:
            runs.write(f"{os.getpid()}\n")
        order = Order.objects.create(item=key, quantity=quantity)
        time.sleep(HOLD_SECONDS)
        return {"order": order.pk, "quantity": quantity, "pid": os.getpid()}

    return place


def call(key: str, mode: str, quantity: int) -> dict[str, Any]:
    from django_idempotency.exceptions import ArgumentsMismatch, CallInFlight

    place = protected(atomic=mode == "atomic")
    try:
        value = place(key, quantity)
    except CallInFlight as error:
        return {
            "status": "IN_FLIGHT",
            "error": type(error).__name__,
            "retry_after": error.retry_after,
        }
    except ArgumentsMismatch as error:
        return {"status": "MISMATCH", "error": type(error).__name__}
    return {"status": "SUCCESS", "value": value}


def wait_for_go(batch: str) -> None:
    control = control_dir()
    (control / f"{batch}-{os.getpid()}.ready").touch()
    deadline = time.monotonic() + GO_LIMIT
    while not (control / f"{batch}.go").exists():
        if time.monotonic() > deadline:
            raise SystemExit("the test never said go")
        time.sleep(0.005)


def main(argv: list[str]) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.server_settings")
    import django

    django.setup()
    from django.db import connection

    batch, key, mode, quantity = argv
    connection.ensure_connection()  # connected before the go: the calls start together
    wait_for_go(batch)
    print(json.dumps(call(key, mode, int(quantity)), sort_keys=True), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
