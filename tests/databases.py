"""Statements and records the tests (and the benchmarks) need below the protocol.

A claim to hand to ``store.claim`` directly, the administrator's view
of the database server (a session's lock timeout, the connections this
process holds, and ending one of them from the server side), and the
round trips a request makes to PostgreSQL, from libpq's own trace.

Importing this module touches neither the settings nor the models, so a
script may import it before it configures Django; call its functions after.
"""

from __future__ import annotations

import os
import re
import tempfile
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import connection

if TYPE_CHECKING:
    from django_idempotency.store import NewClaim


def new_claim(
    key: str, *, scope: str = "s", expires_in: timedelta = timedelta(hours=1)
) -> NewClaim:
    """An atomic-mode claim of ``key`` made now, expiring ``expires_in`` from now.

    A negative ``expires_in`` makes a claim that has already expired.
    """
    from django_idempotency.store import NewClaim

    return NewClaim(
        scope=scope, key=key, fingerprint="f" * 64, owner_token="", expires_in=expires_in
    )


def lock_timeout() -> str:
    """PostgreSQL: the default connection's ``lock_timeout``, as ``SHOW`` prints it."""
    with connection.cursor() as cursor:
        cursor.execute("SHOW lock_timeout")
        return str(cursor.fetchone()[0])


def kill_connection(server_id: int) -> None:
    """End another session from the server side, as an administrator or a failover would.

    ``server_id`` is the session's backend pid (PostgreSQL) or connection id
    (MariaDB/MySQL); the default connection sends the statement.
    """
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_terminate_backend(%s)", [server_id])
            assert cursor.fetchone()[0] is True
        else:
            cursor.execute(f"KILL {int(server_id)}")


def connections_from_this_process() -> int:
    """How many sessions the server lists on this database from this process.

    Only this process's connections count (matched by their local TCP port),
    since other processes may use the same server. PostgreSQL or MariaDB/MySQL
    over TCP; the default connection asks, and counts itself.
    """
    connection.ensure_connection()  # its socket is among those read next
    default_port = 5432 if connection.vendor == "postgresql" else 3306
    ours = _own_tcp_ports(int(connection.settings_dict.get("PORT") or default_port))
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT client_port FROM pg_stat_activity WHERE datname = current_database()"
            )
            ports = [row[0] for row in cursor.fetchall()]
        else:
            cursor.execute("SELECT HOST FROM information_schema.PROCESSLIST WHERE DB = DATABASE()")
            ports = [int(host.rsplit(":", 1)[1]) for (host,) in cursor.fetchall() if ":" in host]
    return sum(1 for port in ports if port in ours)


def _own_tcp_ports(server_port: int) -> set[int]:
    """The local ports of this process's TCP sockets to ``server_port``, read from /proc.

    Only those: a socket of this process to another server (a test server
    it started) may have the same local port as another process's session
    on this one, which would be counted as this process's.
    """
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                remote_port = int(fields[2].rsplit(":", 1)[1], 16)
                if fields[9] in inodes and remote_port == server_port:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def claims_waiting() -> int:
    """How many claims on the test database are blocked in the database right now.

    PostgreSQL names the wait: a row lock. MariaDB (10.11) lists these
    inserts in its process list, in state ``Update``, but not in InnoDB's
    lock or transaction tables, so there the count is of claim inserts
    still running.
    """
    from django_idempotency.models import IdempotencyKey

    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        else:
            cursor.execute(
                "SELECT count(*) FROM information_schema.processlist "
                "WHERE db = DATABASE() AND id <> CONNECTION_ID() AND command = 'Query' "
                "AND info LIKE %s",
                [f"%INSERT INTO `{IdempotencyKey._meta.db_table}`%"],
            )
        return int(cursor.fetchone()[0])


class RoundTrips:
    """Messages the client sends PostgreSQL, read from libpq's own trace (psycopg 3).

    Unlike Django's query capture this sees transaction control too (the
    BEGIN psycopg sends before the first statement, the COMMIT), so it
    counts what each request waits for: one simple query, or one batch of
    extended-protocol messages up to its Sync, is one round trip.
    """

    def __init__(self, raw_connection: Any) -> None:
        self._pgconn = raw_connection.pgconn
        self._file = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115  closed in sent()

    def __enter__(self) -> RoundTrips:
        self._pgconn.trace(self._file.fileno())
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._pgconn.untrace()

    def sent(self) -> list[str]:
        """One entry per wait: a simple query, or an extended-protocol batch ending in Sync.

        Each entry is the statement's text as the trace shows it (libpq
        escapes what is not printable), or "?" for a statement prepared
        earlier and run by name.
        """
        with self._file:
            self._file.seek(0)
            lines = [line.split("\t") for line in self._file.read().splitlines()]
        trips, pending = [], "?"
        for fields in lines:
            if fields[1] != "F":
                continue
            if fields[3] == "Query":
                trips.append(fields[4].strip().removeprefix('"').removesuffix('"'))
            elif fields[3] == "Parse":
                # The statement's name, then its text (whose own quotes libpq
                # leaves as they are), then its parameters' types.
                parsed = re.match(r'\s*"[^"]*" "(.*)" \d', fields[4])
                pending = parsed.group(1) if parsed else "?"
            elif fields[3] == "Sync":
                trips.append(pending)
                pending = "?"
        return trips

    def trips(self) -> list[str]:
        """:meth:`sent`, each entry cut to the statement's first word."""
        return [text.split()[0] for text in self.sent()]
