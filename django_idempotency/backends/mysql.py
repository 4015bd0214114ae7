"""MySQL and MariaDB: insert, and on a duplicate read the record under a shared lock.

InnoDB's lock wait is bounded per statement on MariaDB, per session on MySQL; on Galera
the claim first waits until the node has applied what the cluster committed.
"""

from __future__ import annotations

import math

from django.db import IntegrityError
from django.db.backends.base.base import BaseDatabaseWrapper

import django_idempotency.backends.base as base

# Error numbers.
ER_DUP_ENTRY = 1062
ER_LOCK_WAIT_TIMEOUT = 1205
ER_LOCK_DEADLOCK = 1213
ER_NO_SUCH_TABLE = 1146


class MySQL(base.Backend):
    codes = {
        ER_LOCK_WAIT_TIMEOUT: base.BUSY,
        ER_LOCK_DEADLOCK: base.RETRY,
        ER_NO_SUCH_TABLE: base.MISSING,
    }

    def claim(
        self, connection: base.Connection, new: base.NewClaim, wait: float, take_over: bool
    ) -> base.Found:
        """Insert; on a duplicate, read under a shared lock.

        A failed INSERT rolls back only itself in InnoDB: no savepoint. The read is shared, not
        FOR UPDATE: the failed INSERT holds a shared lock, and upgrading at once would deadlock.
        """
        prefix = wait_prefix(connection, wait)
        vendor = connection.vendor
        sql = base.STATEMENTS.get((vendor, "claim")) or base.cached_sql(
            connection, "claim", insert_sql
        )
        with connection.cursor() as cursor:
            try:
                cursor.execute(prefix + sql, base.insert_params(connection, new))
                return base.Claim(int(cursor.lastrowid))
            except IntegrityError as exc:
                if exc.__cause__ is None or exc.__cause__.args[0] != ER_DUP_ENTRY:
                    raise
        sql = base.STATEMENTS.get((vendor, "shared read")) or base.cached_sql(
            connection, "shared read", shared_read_sql
        )
        with connection.cursor() as cursor:
            cursor.execute(prefix + sql, [new.scope, new.key])
            row = cursor.fetchone()
        if row is None:
            return None
        record = base.record_of(connection, row)
        if not record.free_to_take(new.fingerprint, take_over):
            # Live, left to a recovery policy, or bound to another request: read under our
            # shared lock, it stays so until we commit.
            return record
        return _take_over(connection, record.id, new, prefix, take_over)


def wait_prefix(connection: BaseDatabaseWrapper, wait: float) -> str:
    """Bound InnoDB's row-lock wait for one statement (MariaDB) or the session (MySQL).

    On Galera the statement also waits for the node to catch up (:func:`galera_sync_wait`).
    """
    if getattr(connection, "mysql_is_mariadb", False):
        sync_wait = getattr(connection, "_idempotency_sync_wait", None)
        if sync_wait is None:
            sync_wait = galera_sync_wait(connection)
        causal = f", wsrep_sync_wait={sync_wait}" if sync_wait else ""
        return f"SET STATEMENT innodb_lock_wait_timeout={math.ceil(wait)}{causal} FOR "
    seconds = max(1, math.ceil(wait))
    # Forgotten when a new connection opens (see _forget_connection_state).
    if getattr(connection, "_idempotency_lock_wait", None) != seconds:
        with connection.cursor() as cursor:
            cursor.execute(f"SET SESSION innodb_lock_wait_timeout = {seconds}")
        connection._idempotency_lock_wait = seconds  # type: ignore[attr-defined]
    return ""


#: ``wsrep_sync_wait``'s bit for INSERT and REPLACE statements.
_WSREP_SYNC_INSERT = 4


def galera_sync_wait(connection: BaseDatabaseWrapper) -> int:
    """The ``wsrep_sync_wait`` a claim runs with on a Galera node; 0 on any other server.

    A node applies other nodes' commits a moment later, so a claim could miss a record whose
    original already answered. The INSERT bit makes the claim wait; the READ bit would not,
    as MariaDB makes no causal wait inside an open transaction. The session's bits are kept.
    Asked once per connection wrapper: a plain server pays one statement per thread.
    """
    found = getattr(connection, "_idempotency_sync_wait", None)
    if found is None:
        with connection.cursor() as cursor:
            cursor.execute(
                "SHOW SESSION VARIABLES WHERE Variable_name IN ('wsrep_on', 'wsrep_sync_wait')"
            )
            variables = dict(cursor.fetchall())
        found = 0
        if variables.get("wsrep_on") == "ON":
            found = int(variables.get("wsrep_sync_wait") or 0) | _WSREP_SYNC_INSERT
        connection._idempotency_sync_wait = found  # type: ignore[attr-defined]
    return found


def insert_sql(connection: BaseDatabaseWrapper) -> str:
    return f"{base.insert_claim_into(connection)} VALUES ({base.claim_values(connection)})"


def shared_read_sql(connection: BaseDatabaseWrapper) -> str:
    return base.record_select_sql(connection, lock=" LOCK IN SHARE MODE")


def _take_over(
    connection: BaseDatabaseWrapper,
    record_id: int,
    new: base.NewClaim,
    prefix: str,
    take_over: bool,
) -> base.Claim | None:
    name = ("claim take over", take_over)
    sql = base.STATEMENTS.get((connection.vendor, name)) or base.cached_sql(
        connection, name, lambda c: take_over_sql(c, take_over)
    )
    params = [new.fingerprint, new.fingerprint, *base.insert_params(connection, new)[2:]]
    with connection.cursor() as cursor:
        cursor.execute(prefix + sql, [*params, record_id, new.fingerprint])
        if cursor.rowcount != 1:
            return None
        # No RETURNING on MySQL: read back what the update carried over.
        sql = base.STATEMENTS.get((connection.vendor, "claimed")) or base.cached_sql(
            connection, "claimed", claimed_sql
        )
        cursor.execute(sql, [record_id])
        return base.claimed(connection, cursor.fetchone())


def take_over_sql(connection: BaseDatabaseWrapper, take_over: bool) -> str:
    quote = connection.ops.quote_name
    progress = base.progress_assignments(connection, "%s")
    assignments = base.takeover_assignments(connection, from_excluded=False)
    pk = quote(base.IdempotencyKey._meta.pk.column)
    return (
        f"UPDATE {base.quoted_table(connection)} SET {progress}, {assignments} "
        f"WHERE {pk} = %s AND {base.takeover_condition(connection, take_over, '%s')}"
    )


def claimed_sql(connection: BaseDatabaseWrapper) -> str:
    table = base.quoted_table(connection)
    pk = connection.ops.quote_name(base.IdempotencyKey._meta.pk.column)
    return f"SELECT {base.claimed_columns(connection, table)} FROM {table} WHERE {pk} = %s"
