"""Wall and CPU time of each step of a first request, in one process, by timing around it.

    DJANGO_SETTINGS_MODULE=benchmarks.bench.inprocess_settings BENCH_BACKEND=postgresql \\
        python -m benchmarks.phases [--requests 2000]

The same harness as :mod:`benchmarks.inprocess` (its settings, a throwaway
test database). Each step is wrapped where it is called from, so a step's
figure includes the Django and psycopg work of its statement; what is left
of ``protect`` beyond the steps is the protocol's own Python. CPU time is
the process's, so a step's wall time minus its CPU time is waiting.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BODY = json.dumps({"item": "book", "quantity": 1})


def _timed(owner: Any, name: str, label: str, spent: dict[str, list[float]]) -> None:
    original = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return original(*args, **kwargs)
        finally:
            spent[label][0] += time.perf_counter() - wall
            spent[label][1] += time.process_time() - cpu

    setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    requests = parser.parse_args().requests
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.db import connection
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.test import Client

    from benchmarks.bench import views
    from django_idempotency import core, store

    spent: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for owner, name, label in [
        (core, "protect", "protect, in all"),
        (core, "_call", "key, scope and fingerprint"),
        (store, "find_completed", "replay lookup"),
        (store, "claim", "claim (with BEGIN)"),
        (views, "write_order", "handler"),
        (store, "complete", "store"),
        (BaseDatabaseWrapper, "commit", "COMMIT"),
    ]:
        _timed(owner, name, label, spent)
    old_name = connection.creation.create_test_db(verbosity=0, autoclobber=True)
    client = Client()

    def post(path: str) -> None:
        key = uuid.uuid4().hex
        response = client.post(
            path, BODY, content_type="application/json", headers={"Idempotency-Key": key}
        )
        assert response.status_code == 201, response.status_code

    try:
        for _ in range(300):  # warm every path
            post("/ours/")
            post("/plain/")
        for kind, path in [("undecorated", "/plain/"), ("first", "/ours/")]:
            spent.clear()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(requests):
                post(path)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            print(f"{kind}: {wall / requests * 1e6:.0f} us wall, {cpu / requests * 1e6:.0f} us CPU")
            for label, (step_wall, step_cpu) in spent.items():
                per_request = step_wall / requests * 1e6, step_cpu / requests * 1e6
                print(f"    {label:28} {per_request[0]:6.0f} us wall {per_request[1]:6.0f} us CPU")
    finally:
        connection.close()
        connection.creation.destroy_test_db(old_name, verbosity=0)


if __name__ == "__main__":
    main()
