"""Section 5: per-request time in one process, through Django's test client.

Each backend and connection mode runs in a process of its own (its own
settings, its own throwaway test database): ``python -m benchmarks.inprocess
--backend postgresql --conn-max-age 600 --json``. Variants are interleaved
round by round (undecorated, first, replay, replay from each cache), so that
the noise of a shared machine falls on all of them alike; each figure is the
median over rounds of the mean time per request within a round.

``--pipeline`` instead times the statement sequences of a first request (the
lookup in autocommit, then BEGIN, the claim, the handler's INSERT, the store
and COMMIT) and of a replay (the lookup alone) on PostgreSQL, as psycopg
sends them today (one round trip each) and in pipeline mode (BEGIN with the
claim, the store with COMMIT), on the same table with the same SQL, to see
whether pipelining pays.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BODY = json.dumps({"item": "book", "quantity": 1})

VARIANTS = [
    "undecorated",
    "statements alone",
    "first",
    "replay",
    "replay, cache on Redis",
    "replay, cache on locmem",
]
PIPELINE_VARIANTS = [
    "first, one round trip per statement",
    "first, pipelined",
    "replay, one round trip per statement",
    "replay, pipelined",
]


def run(
    backend: str,
    conn_max_age: int,
    requests: int,
    rounds: int,
    *,
    db_port: int | None = None,
    prepared: bool = False,
    pipeline: bool = False,
    timeout: float = 900.0,
) -> dict[str, list[float]]:
    """Microseconds per request, one figure per round, by variant (in a subprocess)."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "benchmarks.bench.inprocess_settings",
        "BENCH_BACKEND": backend,
        "BENCH_CONN_MAX_AGE": str(conn_max_age),
        "BENCH_DATABASE_NAME": f"bench_inprocess_{uuid.uuid4().hex[:12]}",
    }
    if db_port is not None:
        env["BENCH_DB_PORT"] = str(db_port)
    if prepared:
        env["BENCH_PG_PREPARED"] = "1"
    command = [sys.executable, "-m", "benchmarks.inprocess", "--requests", str(requests)]
    command += ["--rounds", str(rounds)] + (["--pipeline"] if pipeline else [])
    completed = subprocess.run(
        command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    if completed.returncode:
        raise RuntimeError(f"{backend} in-process run failed:\n{completed.stderr[-3000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


# Inside the measuring process ----------------------------------------------------


def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pipeline", action="store_true")
    arguments = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.db import connection

    old_name = connection.creation.create_test_db(verbosity=0, autoclobber=True)
    try:
        if arguments.pipeline:
            results = _pipeline(arguments.requests, arguments.rounds)
        else:
            results = _requests(arguments.requests, arguments.rounds)
    finally:
        connection.close()
        connection.creation.destroy_test_db(old_name, verbosity=0)
    print(json.dumps(results))


def _requests(requests: int, rounds: int) -> dict[str, list[float]]:
    from django.core.cache import caches
    from django.db import close_old_connections, connection
    from django.test import Client, override_settings

    client = Client()
    # The test client keeps Django from closing connections at the end of a
    # request; close them here as the request handler would.
    per_request = connection.settings_dict["CONN_MAX_AGE"] == 0

    def post(path: str, key: str) -> None:
        response = client.post(
            path, BODY, content_type="application/json", headers={"Idempotency-Key": key}
        )
        assert response.status_code == 201, response.status_code
        if per_request:
            close_old_connections()

    pool = [uuid.uuid4().hex for _ in range(requests)]
    for key in pool:
        post("/ours/", key)

    def keys(fresh: bool) -> list[str]:
        return [uuid.uuid4().hex for _ in range(requests)] if fresh else pool

    def timed(path: str, fresh: bool, cache: str | None) -> float:
        batch = keys(fresh)
        with override_settings(IDEMPOTENCY={"REPLAY_CACHE": cache}):
            if cache is not None:
                for key in batch:  # a replay from the database fills the cache
                    post(path, key)
            started = time.perf_counter()
            for key in batch:
                post(path, key)
            elapsed = time.perf_counter() - started
        return elapsed / requests * 1e6

    runs: dict[str, Callable[[], float]] = {
        "undecorated": lambda: timed("/plain/", True, None),
        "first": lambda: timed("/ours/", True, None),
    }
    if connection.vendor == "postgresql":
        # The first request's statements through Django, without the package.
        runs["statements alone"] = lambda: timed("/statements-alone/", True, None)
    runs |= {
        "replay": lambda: timed("/ours/", False, None),
        "replay, cache on Redis": lambda: timed("/ours/", False, "redis"),
        "replay, cache on locmem": lambda: timed("/ours/", False, "locmem"),
    }
    for run_once in runs.values():  # warm every path once
        run_once()
    results: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run_once in runs.items():
            results[name].append(run_once())
    # Only this run's entries: other users of the Redis server keep theirs.
    from django_idempotency.replay_cache import cache_key

    caches["redis"].delete_many([cache_key("anonymous", key) for key in pool])
    return results


def _pipeline(requests: int, rounds: int) -> dict[str, list[float]]:
    """Time the first-request and replay statement sequences with and without a pipeline."""
    from django.db import connection
    from django.utils import timezone

    from benchmarks.bench.models import BenchOrder
    from django_idempotency import clock, store
    from django_idempotency.backends import base, postgresql

    connection.ensure_connection()
    connection.set_autocommit(False)  # BEGIN before the first statement, as atomic() does
    raw = connection.connection
    lookup_sql = base.cached_sql(connection, "read", base.record_select_sql)
    claim_sql = base.cached_sql(connection, "insert", postgresql.insert_sql)
    complete_sql = base.cached_sql(
        connection,
        ("complete", True, False),
        lambda c: base.complete_sql(c, base.OWN_TRANSACTION, with_grace=True),
    )
    ttl = timezone.timedelta(hours=1)
    # Atomic mode's completion: the claim's expiry kept within 1% of the TTL.
    expiry_params = [clock.seconds(connection, -ttl / 100), clock.seconds(connection, ttl)]
    table = connection.ops.quote_name(BenchOrder._meta.db_table)
    insert_sql = (
        f"INSERT INTO {table} (variant, key, nonce, created_at) "
        "VALUES (%s, %s, %s, %s) RETURNING id"
    )
    headers = base.HEADERS_FIELD.get_db_prep_save(
        [["Content-Type", "application/json"]], connection
    )
    body = b'{"id": 1, "variant": "bench"}'

    def claim_params(key: str) -> list:
        new = store.NewClaim("bench", key, "f" * 64, "", timezone.timedelta(hours=1))
        return [postgresql.lock_timeout(5.0), *base.insert_params(connection, new)]

    def lookup(key: str, pipelined: bool) -> Any:
        """The replay lookup, in autocommit, as a request makes it before any claim."""
        raw.autocommit = True
        try:
            cursor = raw.cursor()
            with raw.pipeline() if pipelined else nullcontext():
                cursor.execute(lookup_sql, ["bench", key])
                return cursor.fetchone()
        finally:
            raw.autocommit = False

    def first(key: str, pipelined: bool) -> None:
        assert lookup(key, pipelined) is None
        cursor = raw.cursor()
        with raw.pipeline() if pipelined else nullcontext():
            cursor.execute(claim_sql, claim_params(key))
            record_id = cursor.fetchone()[0]
            cursor.execute(insert_sql, ["pipeline", key, "", timezone.now()])
            cursor.fetchone()
            cursor.execute(
                complete_sql,
                [base.STATE_COMPLETED, 201, headers, body, *expiry_params, record_id],
            )
            raw.commit()

    def replay(key: str, pipelined: bool) -> None:
        assert lookup(key, pipelined) is not None

    pool = [uuid.uuid4().hex for _ in range(requests)]
    for key in pool:
        first(key, False)

    def timed(step: Callable[[str, bool], None], fresh: bool, pipelined: bool) -> float:
        batch = [uuid.uuid4().hex for _ in range(requests)] if fresh else pool
        started = time.perf_counter()
        for key in batch:
            step(key, pipelined)
        return (time.perf_counter() - started) / requests * 1e6

    runs = {
        PIPELINE_VARIANTS[0]: lambda: timed(first, True, False),
        PIPELINE_VARIANTS[1]: lambda: timed(first, True, True),
        PIPELINE_VARIANTS[2]: lambda: timed(replay, False, False),
        PIPELINE_VARIANTS[3]: lambda: timed(replay, False, True),
    }
    for run_once in runs.values():
        run_once()
    results: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run_once in runs.items():
            results[name].append(run_once())
    return results


def median(values: list[float]) -> float:
    return statistics.median(values)


if __name__ == "__main__":
    _main()
