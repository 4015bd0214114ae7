"""The PostgreSQL server the benchmarks run on, and statements run outside any database."""

from __future__ import annotations

import os

#: From ``PGHOST``/``PGPORT``/``PGUSER``/``PGPASSWORD``, as libpq reads them.
SERVER = {
    "HOST": os.environ.get("PGHOST", "127.0.0.1"),
    "PORT": os.environ.get("PGPORT", "5432"),
    "USER": os.environ.get("PGUSER", "postgres"),
    "PASSWORD": os.environ.get("PGPASSWORD", ""),
}


def admin_sql(statement: str) -> None:
    """CREATE/DROP DATABASE cannot run in a transaction: a raw autocommit connection."""
    import psycopg

    with psycopg.connect(
        dbname="postgres",
        host=SERVER["HOST"],
        port=SERVER["PORT"],
        user=SERVER["USER"],
        password=SERVER["PASSWORD"] or None,
        autocommit=True,
    ) as connection:
        connection.execute(statement)
