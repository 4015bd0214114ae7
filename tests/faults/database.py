"""Database-side faults: kill the server's connections, restart the database server.

Only the fault suite's own gunicorn is touched: on PostgreSQL its backends
are picked by database name *and* ``application_name``; on MariaDB by
database name, leaving out the connections the test process itself holds.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tests.settings import BACKEND, DATABASES

#: The environment variable naming the application_name of the server's connections.
APPLICATION_NAME_ENV = "IDEMPOTENCY_FAULTS_APPLICATION_NAME"
#: How long a restarted database may take to accept connections again.
RESTART_LIMIT = 90.0


def _settings() -> dict[str, Any]:
    return DATABASES["default"]


def connect() -> Any:
    """A fresh autocommit connection to the server, outside Django, for the injector."""
    conf = _settings()
    if BACKEND == "postgresql":
        import psycopg

        return psycopg.connect(
            host=conf["HOST"],
            port=int(conf["PORT"]),
            user=conf["USER"],
            password=conf["PASSWORD"] or None,
            dbname="postgres",
            application_name="django-idempotency-fault-injector",
            autocommit=True,
            connect_timeout=5,
        )
    import MySQLdb

    connection = MySQLdb.connect(
        host=conf["HOST"],
        port=int(conf["PORT"]),
        user=conf["USER"],
        passwd=conf["PASSWORD"],
        connect_timeout=5,
    )
    connection.autocommit(True)
    return connection


def kill_server_connections(
    connection: Any, database: str, application_name: str, spare: Iterable[int]
) -> int:
    """Kill the server's connections that are inside a transaction or running a statement.

    Those are the ones a handler is using right now; idle ones are left for
    the health check to find. Returns how many were killed.
    """
    spare = set(spare)
    cursor = connection.cursor()
    if BACKEND == "postgresql":
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND application_name = %s AND state <> 'idle' "
            "AND pid <> pg_backend_pid()",
            [database, application_name],
        )
        return sum(1 for (terminated,) in cursor.fetchall() if terminated)
    cursor.execute(
        "SELECT p.ID FROM information_schema.PROCESSLIST p "
        "LEFT JOIN information_schema.INNODB_TRX t ON t.trx_mysql_thread_id = p.ID "
        "WHERE p.DB = %s AND p.ID <> CONNECTION_ID() "
        "AND (p.COMMAND = 'Query' OR t.trx_id IS NOT NULL)",
        [database],
    )
    killed = 0
    for (thread_id,) in cursor.fetchall():
        if thread_id in spare:
            continue
        try:
            cursor.execute(f"KILL {int(thread_id)}")
        except Exception as exc:
            # The connection ended on its own between the SELECT and the KILL.
            if "Unknown thread id" not in str(exc):
                raise
        else:
            killed += 1
    return killed


def own_connection_id(django_connection: Any) -> int | None:
    """The MariaDB thread id of a Django connection, to keep it out of the kills."""
    if BACKEND != "mariadb":
        return None
    with django_connection.cursor() as cursor:
        cursor.execute("SELECT CONNECTION_ID()")
        return int(cursor.fetchone()[0])


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=120)


def _postgresql_cluster() -> tuple[str, str]:
    versions = sorted(path.name for path in Path("/etc/postgresql").iterdir())
    return versions[-1], "main"


def stop_database() -> None:
    """Stop the database server the suite runs on (``FAULTS_DB_STOP`` overrides the command)."""
    override = os.environ.get("FAULTS_DB_STOP")
    if override:
        _run(["sh", "-c", override])
    elif BACKEND == "postgresql":
        version, cluster = _postgresql_cluster()
        _run(["pg_ctlcluster", "--skip-systemctl-redirect", version, cluster, "stop"])
    else:
        conf = _settings()
        _run(
            [
                "mysqladmin",
                f"-h{conf['HOST']}",
                f"-P{conf['PORT']}",
                f"-u{conf['USER']}",
                "shutdown",
            ]
        )
    _wait(lambda: not accepting(), "the database to stop")


def start_database() -> None:
    """Start the database server again and wait until it accepts connections."""
    override = os.environ.get("FAULTS_DB_START")
    if override:
        _run(["sh", "-c", override])
    elif BACKEND == "postgresql":
        version, cluster = _postgresql_cluster()
        _run(["pg_ctlcluster", "--skip-systemctl-redirect", version, cluster, "start"])
    else:
        _run(
            [
                "start-stop-daemon",
                "--start",
                "--oknodo",
                "--background",
                "--exec",
                "/usr/sbin/mariadbd",
            ]
        )
    _wait(accepting, "the database to accept connections")


def accepting() -> bool:
    """Whether the server answers a real login, not merely a TCP connect."""
    try:
        connection = connect()
    except Exception:
        return False
    try:
        cursor = connection.cursor()
        cursor.execute("SELECT 1")
        return True
    except Exception:
        return False
    finally:
        connection.close()


def _wait(condition: Any, what: str) -> None:
    deadline = time.monotonic() + RESTART_LIMIT
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"gave up waiting {RESTART_LIMIT:.0f} s for {what}")
        time.sleep(0.2)
