"""Benchmark the purge on PostgreSQL while requests keep claiming keys.

Creates its own database, fills it with ``--rows`` expired records in one
``INSERT ... SELECT generate_series`` statement, then runs
:func:`django_idempotency.purge.purge_expired` once per ``--batch-size``
while a writer thread claims keys the whole time, half of them new and
half re-using the keys of expired rows (so the writer takes rows over
while the purge may hold their locks). It prints one line per batch size:
how fast the purge went, the process's peak RSS, and the writer's longest
claim, which is how long a request could stall behind the purge.

    python benchmarks/purge.py --rows 1000000 --batch-size 1000 5000 10000

Connection settings come from ``PGHOST``/``PGPORT``/``PGUSER``/``PGPASSWORD``
(default: postgres on 127.0.0.1:5432). The database is dropped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import django
from django.conf import settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.postgres import SERVER, admin_sql

DATABASE_NAME = f"idempotency_purge_bench_{os.getpid()}"


def configure() -> None:
    settings.configure(
        DATABASES={
            "default": {"ENGINE": "django.db.backends.postgresql", "NAME": DATABASE_NAME} | SERVER,
        },
        INSTALLED_APPS=["django_idempotency"],
        USE_TZ=True,
        TIME_ZONE="UTC",
    )
    django.setup()


def fill(rows: int) -> None:
    """``rows`` expired records, written by the server in one statement."""
    from django.db import connection

    from django_idempotency.models import IdempotencyKey

    table = connection.ops.quote_name(IdempotencyKey._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (scope, key, fingerprint, state, status_code, "
            "response_headers, response_body, owner_token, created_at, expires_at, attempt) "
            "SELECT 'bench', 'expired-' || n, repeat('f', 64), 'completed', 201, "
            """'[["Content-Type", "application/json"]]'::jsonb, '{"ok": true}'::bytea, '', """
            "now() - interval '25 hours', now() - interval '1 hour' - n * interval '1 ms', 1 "
            "FROM generate_series(1, %s) AS n",
            [rows],
        )
        cursor.execute(f"VACUUM ANALYZE {table}")


class Writer(threading.Thread):
    """Claims keys back to back, as requests would, and times each claim."""

    def __init__(self, rows: int) -> None:
        super().__init__(daemon=True)
        self.rows = rows
        self.stop = threading.Event()
        self.claims = 0
        self.busy = 0
        self.longest = 0.0

    def run(self) -> None:
        from django.db import DatabaseError, connection, transaction

        from django_idempotency import store
        from django_idempotency.info import IdempotencyInfo

        rng = random.Random(0)
        try:
            while not self.stop.is_set():
                if self.claims % 2:
                    key = f"expired-{rng.randint(1, self.rows)}"
                else:
                    key = f"new-{self.claims}-{rng.random()}"
                info = IdempotencyInfo(key=key, scope="bench", fingerprint="f" * 64)
                new = store.NewClaim.of(info, ttl=timedelta(hours=24))
                started = time.perf_counter()
                try:
                    with transaction.atomic():
                        store.claim("default", new, wait=5.0)
                except DatabaseError:
                    self.busy += 1
                self.longest = max(self.longest, time.perf_counter() - started)
                self.claims += 1
        finally:
            connection.close()


def run(rows: int, batch_size: int) -> dict[str, float]:
    from django.db import connection

    from django_idempotency.models import IdempotencyKey
    from django_idempotency.purge import purge_expired

    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {connection.ops.quote_name(IdempotencyKey._meta.db_table)}")
    fill(rows)
    writer = Writer(rows)
    writer.start()
    started = time.perf_counter()
    deleted = purge_expired(batch_size=batch_size)
    seconds = time.perf_counter() - started
    writer.stop.set()
    writer.join()
    connection.close()
    return {
        "rows": deleted,
        "batch": batch_size,
        "seconds": seconds,
        "rate": deleted / seconds,
        # Linux reports kilobytes.
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "stall": writer.longest * 1000,
        "claims": writer.claims,
        "busy": writer.busy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1000, 2000, 5000, 10000])
    parser.add_argument(
        "--json", action="store_true", help="one JSON object per batch size, for benchmarks/run.py"
    )
    options = parser.parse_args()

    configure()
    from django.core.management import call_command
    from django.db import connections

    admin_sql(f'CREATE DATABASE "{DATABASE_NAME}"')
    try:
        call_command("migrate", "django_idempotency", verbosity=0)
        if options.json:
            for batch_size in options.batch_size:
                print(json.dumps(run(options.rows, batch_size)), flush=True)
            return
        header = (
            f"{'rows':>9} {'batch':>6} {'seconds':>8} {'rows/s':>8} "
            f"{'peak RSS MB':>11} {'max stall ms':>12} {'claims':>7} {'409s':>5}"
        )
        print(header)
        print("-" * len(header))
        for batch_size in options.batch_size:
            result = run(options.rows, batch_size)
            print(
                f"{result['rows']:>9,.0f} {result['batch']:>6} {result['seconds']:>8.1f} "
                f"{result['rate']:>8,.0f} {result['rss']:>11.0f} {result['stall']:>12.0f} "
                f"{result['claims']:>7} {result['busy']:>5}",
                flush=True,
            )
    finally:
        connections.close_all()
        admin_sql(f'DROP DATABASE IF EXISTS "{DATABASE_NAME}" WITH (FORCE)')


if __name__ == "__main__":
    main()
