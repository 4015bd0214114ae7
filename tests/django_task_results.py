"""A command line for the worker tests: enqueue tasks, read and put back their results.

The results' model belongs to ``django-tasks-db``, which only the worker
settings (``tests.django_tasks_settings``) install, so the test reaches it
through a process of its own on those settings::

    python -m tests.django_task_results enqueue TASK ARGUMENT [ARGUMENT ...]
    python -m tests.django_task_results results ID [ID ...]
    python -m tests.django_task_results requeue ID
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def main(argv: list[str]) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_tasks_settings")
    import django

    django.setup()
    from tests.django_task_examples import TASKS

    command, *rest = argv
    if command == "enqueue":
        name, *arguments = rest
        result = TASKS[name].enqueue(*arguments)
        print(json.dumps({"id": str(result.id)}), flush=True)
    elif command == "results":
        from django_tasks_db.models import DBTaskResult

        found = {str(row.id): row for row in DBTaskResult.objects.filter(id__in=rest)}
        print(json.dumps([_described(found[result_id]) for result_id in rest]), flush=True)
    elif command == "requeue":
        # What an operator does for a result its dead worker left running.
        from django_tasks_db.models import DBTaskResult

        [result_id] = rest
        DBTaskResult.objects.filter(id=result_id).update(status="READY", finished_at=None)
    else:
        raise SystemExit(f"unknown command {command!r}")


def _described(row: Any) -> dict[str, Any]:
    result = row.task_result
    error = result.errors[-1].exception_class_path if result.errors else None
    value = result.return_value if result.status.name == "SUCCESSFUL" else None
    return {"status": result.status.name, "return_value": value, "error": error}


if __name__ == "__main__":
    main(sys.argv[1:])
