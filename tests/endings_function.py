"""The endings table's row for ``idempotent_function``: the function, and a process calling it.

``python -m tests.endings_function KEY ENDING MODE`` sets Django up on the
endings settings, calls the protected function once, and prints what the
call got as one JSON line: ``SUCCESS`` and the value, ``FAILURE`` and the
error, or ``IN_FLIGHT`` and its ``retry_after`` when the package refused to
run the body alongside an original still running. Each call is a process
of its own, as message consumers or webhook workers on several hosts are.
As the views and tasks do, the body counts its run, writes an ``Order``
named after the key, and ends as ``ending`` says on its first run only.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

LEASE_SECONDS = 2
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


def protected(atomic: bool) -> Any:
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


def call(key: str, ending: str, mode: str) -> dict[str, Any]:
    from django_idempotency.exceptions import IdempotencyError

    function = protected(atomic=mode == "atomic")
    try:
        value = function(key, ending)
    except IdempotencyError as error:
        retry_after = getattr(error, "retry_after", None)
        if retry_after is None:
            return {"status": "REFUSED", "error": type(error).__name__}
        return {"status": "IN_FLIGHT", "retry_after": retry_after}
    except Exception as error:
        return {"status": "FAILURE", "error": type(error).__name__}
    return {"status": "SUCCESS", "value": value}


def main(argv: list[str]) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.endings_settings")
    import django

    django.setup()
    key, ending, mode = argv
    print(json.dumps(call(key, ending, mode), sort_keys=True), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
