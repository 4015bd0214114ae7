"""Where a protected request's time goes, in one process, on PostgreSQL.

    python3 benchmarks/explain.py [--requests 300] [--new-connection]

Runs inside ``.venv-bench`` (make it once with ``benchmarks/run.py``).
Sends interleaved requests (undecorated, ``@idempotent`` first request,
``@idempotent`` replay) through Django's test client and reports, per kind
of request, the median time of the request, of each SQL statement and of
the COMMIT, how many times psycopg waited on the connection, whether the
transaction wrote anything (PostgreSQL assigns a transaction id only to a
transaction that writes, and only such a COMMIT waits for the WAL flush).
and how many of the key table's updates were HOT. This is the evidence
behind the throughput notes in the docs. ``--new-connection`` opens a
connection for every request, as ``CONN_MAX_AGE = 0`` does, and times the
connect too: on a new connection the server's caches are cold, so the
first statement of every request costs more, whichever it is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _kind(sql: str) -> str:
    text = " ".join(sql.split())
    if "set_config('lock_timeout'" in text:
        return "claim (INSERT ... ON CONFLICT)"
    if text.startswith("SELECT txid_current_if_assigned"):
        return "probe"
    words = text.split()
    table = words[2] if words[0] == "INSERT" else words[1] if words[0] == "UPDATE" else ""
    suffix = " FOR UPDATE" if "FOR UPDATE" in text else ""
    return f"{words[0]} {table}".strip() + suffix


def explain(requests: int, *, new_connection: bool = False) -> None:
    import psycopg
    from django.db import connection
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.test import Client

    client = Client()
    body = json.dumps({"item": "book", "quantity": 1})
    phase = {"name": "warm-up"}
    request_ms: dict[str, list[float]] = defaultdict(list)
    statement_ms: dict[tuple[str, str], list[float]] = defaultdict(list)
    connect_ms: dict[str, list[float]] = defaultdict(list)
    commit_ms: dict[str, list[float]] = defaultdict(list)
    waits: dict[str, int] = defaultdict(int)
    wrote: dict[str, int] = defaultdict(int)

    def timed_statement(execute, sql, params, many, context):
        started = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            elapsed = (time.perf_counter() - started) * 1000
            statement_ms[(phase["name"], _kind(sql))].append(elapsed)

    original_commit = BaseDatabaseWrapper._commit
    original_wait = psycopg.Connection.wait

    def timed_commit(self):
        # A transaction id means the transaction wrote: its COMMIT flushes WAL.
        with self.connection.cursor() as cursor:
            cursor.execute("SELECT txid_current_if_assigned()")
            wrote[phase["name"]] += cursor.fetchone()[0] is not None
        waits[phase["name"]] -= 1  # the probe's own wait
        started = time.perf_counter()
        try:
            return original_commit(self)
        finally:
            commit_ms[phase["name"]].append((time.perf_counter() - started) * 1000)

    def counted_wait(self, *args, **kwargs):
        waits[phase["name"]] += 1
        return original_wait(self, *args, **kwargs)

    def post(path: str, key: str) -> None:
        response = client.post(
            path, body, content_type="application/json", headers={"Idempotency-Key": key}
        )
        assert response.status_code == 201, response.status_code

    completed = [str(uuid.uuid4()) for _ in range(50)]
    for key in completed:
        post("/ours/", key)
        post("/plain/", key)
    BaseDatabaseWrapper._commit = timed_commit
    psycopg.Connection.wait = counted_wait
    if new_connection:
        connection.close()
    try:
        with connection.execute_wrapper(timed_statement):
            for number in range(requests):
                for name, path, key in (
                    ("undecorated", "/plain/", str(uuid.uuid4())),
                    ("@idempotent first", "/ours/", str(uuid.uuid4())),
                    ("@idempotent replay", "/ours/", completed[number % len(completed)]),
                ):
                    phase["name"] = name
                    started = time.perf_counter()
                    if new_connection:
                        connection.ensure_connection()
                        connect_ms[name].append((time.perf_counter() - started) * 1000)
                    post(path, key)
                    request_ms[name].append((time.perf_counter() - started) * 1000)
                    if new_connection:
                        # What Django does once a request with CONN_MAX_AGE = 0
                        # has finished (the test client skips it).
                        connection.close()
    finally:
        BaseDatabaseWrapper._commit = original_commit
        psycopg.Connection.wait = original_wait

    for name, times in request_ms.items():
        print(f"{name}: request {statistics.median(times):.2f} ms (median of {len(times)})")
        if connect_ms[name]:
            print(f"    {'connect':45} {statistics.median(connect_ms[name]):.3f} ms")
        for (statement_phase, kind), values in sorted(statement_ms.items()):
            if statement_phase == name:
                print(f"    {kind:45} {statistics.median(values):.3f} ms")
        if commit_ms[name]:
            print(
                f"    {'COMMIT':45} {statistics.median(commit_ms[name]):.3f} ms; "
                f"wrote (had a transaction id) in {wrote[name]}/{len(times)} requests"
            )
        else:
            print(f"    {'(autocommit: each statement commits itself)':45}")
        print(f"    psycopg waits per request: {waits[name] / len(times):.1f}")
    _print_update_kinds()


def _print_update_kinds() -> None:
    """Whether completions were HOT updates (in place, no new index entries)."""
    from django.db import connection

    from django_idempotency.models import IdempotencyKey

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = %s",
            [IdempotencyKey._meta.db_table],
        )
        updates, hot = cursor.fetchone()
    print(f"key table: {updates} updates, {hot} of them HOT (no new index entries)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument(
        "--new-connection", action="store_true", help="a new connection for every request"
    )
    options = parser.parse_args()
    from benchmarks import suite

    suite.admin_sql(f'CREATE DATABASE "{suite.DATABASE_NAME}"')
    try:
        suite._setup_django()
        explain(options.requests, new_connection=options.new_connection)
    finally:
        from django.db import connections

        connections.close_all()
        suite.admin_sql(f'DROP DATABASE IF EXISTS "{suite.DATABASE_NAME}" WITH (FORCE)')


if __name__ == "__main__":
    main()
