"""Every statement a request makes on the key table, and how each backend waits.

(The batched purge of expired records lives in :mod:`django_idempotency.purge`.)

The unique constraint on (scope, key) is the only authority on who owns a
key. A claim is one statement that either inserts the record, takes over an
expired one, or (on conflict) leaves the live record locked for the caller
to read. The wait for an in-flight original is bounded by the database
itself, never by a sleep loop here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, IntegrityError, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_idempotency.models import IdempotencyKey

State = IdempotencyKey.State

# MySQL/MariaDB error numbers.
_ER_DUP_ENTRY = 1062
_ER_LOCK_WAIT_TIMEOUT = 1205
_ER_LOCK_DEADLOCK = 1213
_ER_NO_SUCH_TABLE = 1146
# PostgreSQL SQLSTATEs.
_PG_LOCK_NOT_AVAILABLE = "55P03"
_PG_RETRYABLE = {"40001", "40P01"}  # serialization failure, deadlock
_PG_UNDEFINED_TABLE = "42P01"

# How often one request re-runs its claim after a deadlock or a lost race.
CLAIM_ATTEMPTS = 3


class Busy(Exception):
    """The wait for an in-flight original ran out."""


class Retry(Exception):
    """The database aborted the claim (deadlock); it may run again from scratch."""


@dataclass(frozen=True)
class NewClaim:
    """What a request writes when it claims a key."""

    scope: str
    key: str
    fingerprint: str
    owner_token: str
    created_at: datetime
    expires_at: datetime
    locked_until: datetime | None


def _columns() -> dict[str, str]:
    return {field.name: str(field.column) for field in IdempotencyKey._meta.concrete_fields}


_CLAIM_FIELDS = [
    "scope",
    "key",
    "fingerprint",
    "state",
    "owner_token",
    "created_at",
    "expires_at",
    "locked_until",
]
_RESPONSE_FIELDS = ["status_code", "response_headers", "response_body"]


def prepare_connection(using: str, wait: float) -> None:
    """Bound SQLite's wait before the transaction starts.

    SQLite takes its write lock at ``BEGIN IMMEDIATE`` (or the first write),
    so the busy timeout must already be right when ``atomic()`` opens. It is
    set only when it differs from what the connection has, which with the
    defaults (5 s both) is never.
    """
    connection = connections[using]
    if connection.vendor != "sqlite":
        return
    connection.ensure_connection()
    target = max(1, round(wait * 1000))
    raw_id = id(connection.connection)
    known = getattr(connection, "_idempotency_busy_timeout", None)
    if known is None or known[0] != raw_id:
        opened_with = connection.settings_dict.get("OPTIONS", {}).get("timeout", 5.0)
        known = (raw_id, round(opened_with * 1000))
    if known[1] != target:
        with connection.cursor() as cursor:
            cursor.execute(f"PRAGMA busy_timeout = {int(target)}")
        known = (raw_id, target)
    connection._idempotency_busy_timeout = known  # type: ignore[attr-defined]


def claim(using: str, new: NewClaim, wait: float) -> int | IdempotencyKey:
    """Claim the key (returning the record id) or return the live record.

    Must run inside ``transaction.atomic(using=using)``. A returned
    record is locked for the rest of the transaction on PostgreSQL
    and MySQL (SQLite locks the whole database anyway).
    """
    connection = connections[using]
    for _ in range(CLAIM_ATTEMPTS):
        if connection.vendor == "mysql":
            claimed: int | IdempotencyKey | None = _claim_mysql(connection, new, wait)
        else:
            claimed = _claim_upsert(connection, new, wait)
            if claimed is None:
                claimed = _read_for_update(using, new)
        if claimed is not None:
            return claimed
    # Only reachable if the record vanished between two of our own
    # statements each time: a purge racing us. Start the request over.
    raise Retry


def complete(
    using: str,
    record_id: int,
    *,
    owner_token: str | None,
    status_code: int,
    headers: list[list[str]],
    body: bytes | None,
    expires_at: datetime,
) -> bool:
    """Store the response; ``False`` if the claim is no longer ours (lease lost)."""
    rows = _owned(using, record_id, owner_token).update(
        state=State.COMPLETED,
        status_code=status_code,
        response_headers=headers,
        response_body=body,
        expires_at=expires_at,
        locked_until=None,
    )
    return rows == 1


def release(using: str, record_id: int, owner_token: str) -> bool:
    """Give an in-progress claim back so a retry can run; only its owner may."""
    rows, _ = _owned(using, record_id, owner_token).filter(state=State.IN_PROGRESS).delete()
    return rows == 1


def _owned(using: str, record_id: int, owner_token: str | None) -> Any:
    records = IdempotencyKey.objects.using(using).filter(pk=record_id)
    if owner_token is not None:
        records = records.filter(owner_token=owner_token)
    return records


def classify(exc: DatabaseError, using: str) -> Exception:
    """Turn a database error raised while claiming into what it means for us."""
    connection = connections[using]
    cause = exc.__cause__
    if connection.vendor == "postgresql":
        sqlstate = getattr(cause, "sqlstate", None)
        if sqlstate == _PG_LOCK_NOT_AVAILABLE:
            return Busy()
        if sqlstate in _PG_RETRYABLE:
            return Retry()
        if sqlstate == _PG_UNDEFINED_TABLE:
            return missing_table()
    elif connection.vendor == "mysql":
        errno = cause.args[0] if cause is not None and cause.args else None
        if errno == _ER_LOCK_WAIT_TIMEOUT:
            return Busy()
        if errno == _ER_LOCK_DEADLOCK:
            return Retry()
        if errno == _ER_NO_SUCH_TABLE:
            return missing_table()
    elif connection.vendor == "sqlite":
        message = str(exc)
        if "is locked" in message:
            return Busy()
        if "no such table" in message:
            return missing_table()
    return exc


def missing_table() -> ImproperlyConfigured:
    return ImproperlyConfigured(
        f"The table {IdempotencyKey._meta.db_table!r} does not exist. "
        "Run 'python manage.py migrate django_idempotency' to create it."
    )


def _insert_params(connection: BaseDatabaseWrapper, new: NewClaim) -> list[Any]:
    adapt = connection.ops.adapt_datetimefield_value
    return [
        new.scope,
        new.key,
        new.fingerprint,
        str(State.IN_PROGRESS),
        new.owner_token,
        adapt(new.created_at),
        adapt(new.expires_at),
        adapt(new.locked_until),
    ]


def _claim_upsert(connection: BaseDatabaseWrapper, new: NewClaim, wait: float) -> int | None:
    """PostgreSQL and SQLite: insert, or take over an expired record, in one statement.

    On a live conflict nothing is returned, and the conflicting row is left
    locked (PostgreSQL locks it even when the ``WHERE`` rejects the update).
    On PostgreSQL the statement also waits for an uncommitted original, so
    it carries its own ``lock_timeout`` and restores the previous value once
    it has claimed, so the handler's own statements are not bounded by it.
    """
    quote = connection.ops.quote_name
    table = quote(IdempotencyKey._meta.db_table)
    columns = _columns()
    names = [quote(columns[field]) for field in _CLAIM_FIELDS]
    placeholders = ", ".join(["%s"] * len(names))
    assignments = ", ".join(
        [f"{name} = EXCLUDED.{name}" for name in names[2:]]
        + [f"{quote(columns[field])} = NULL" for field in _RESPONSE_FIELDS]
    )
    expires = quote(columns["expires_at"])
    created = quote(columns["created_at"])
    conflict = (
        f"ON CONFLICT ({names[0]}, {names[1]}) DO UPDATE SET {assignments} "
        f"WHERE {table}.{expires} <= EXCLUDED.{created}"
    )
    pk = quote(IdempotencyKey._meta.pk.column)
    params = _insert_params(connection, new)
    if connection.vendor == "postgresql":
        sql = (
            "WITH wait AS (SELECT current_setting('lock_timeout') AS previous, "
            "set_config('lock_timeout', %s, true) AS applied), "
            f"claimed AS (INSERT INTO {table} ({', '.join(names)}) "
            f"SELECT {placeholders} FROM wait {conflict} RETURNING {table}.{pk}) "
            f"SELECT claimed.{pk}, set_config('lock_timeout', wait.previous, true) "
            "FROM claimed, wait"
        )
        params = [f"{max(1, round(wait * 1000))}ms", *params]
    else:
        sql = (
            f"INSERT INTO {table} ({', '.join(names)}) VALUES ({placeholders}) "
            f"{conflict} RETURNING {pk}"
        )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    return None if row is None else int(row[0])


def _read_for_update(using: str, new: NewClaim) -> IdempotencyKey | None:
    return (
        IdempotencyKey.objects.using(using)
        .select_for_update()
        .filter(scope=new.scope, key=new.key)
        .first()
    )


def _mysql_wait_prefix(connection: BaseDatabaseWrapper, wait: float) -> str:
    """Bound InnoDB's row-lock wait for one statement (MariaDB) or the session (MySQL)."""
    if getattr(connection, "mysql_is_mariadb", False):
        return f"SET STATEMENT innodb_lock_wait_timeout={math.ceil(wait)} FOR "
    seconds = max(1, math.ceil(wait))
    raw_id = id(connection.connection)
    if getattr(connection, "_idempotency_lock_wait", None) != (raw_id, seconds):
        with connection.cursor() as cursor:
            cursor.execute(f"SET SESSION innodb_lock_wait_timeout = {seconds}")
        connection._idempotency_lock_wait = (raw_id, seconds)  # type: ignore[attr-defined]
    return ""


def _claim_mysql(
    connection: BaseDatabaseWrapper, new: NewClaim, wait: float
) -> int | IdempotencyKey | None:
    """MySQL/MariaDB: insert; on a duplicate, read under a shared lock.

    A failed INSERT rolls back only itself in InnoDB, so no savepoint is
    needed around it. The duplicate read uses a shared lock, not FOR UPDATE:
    the failed INSERT already holds a shared lock on the row, and many
    duplicates upgrading it to exclusive at once would deadlock.
    """
    quote = connection.ops.quote_name
    table = quote(IdempotencyKey._meta.db_table)
    columns = _columns()
    names = [quote(columns[field]) for field in _CLAIM_FIELDS]
    prefix = _mysql_wait_prefix(connection, wait)
    with connection.cursor() as cursor:
        try:
            cursor.execute(
                f"{prefix}INSERT INTO {table} ({', '.join(names)}) "
                f"VALUES ({', '.join(['%s'] * len(names))})",
                _insert_params(connection, new),
            )
            return int(cursor.lastrowid)
        except IntegrityError as exc:
            if exc.__cause__ is None or exc.__cause__.args[0] != _ER_DUP_ENTRY:
                raise
    # A raw query, for the per-statement wait; the ORM still converts the row.
    found = list(
        IdempotencyKey.objects.db_manager(connection.alias).raw(
            f"{prefix}SELECT * FROM {table} "
            f"WHERE {names[0]} = %s AND {names[1]} = %s LOCK IN SHARE MODE",
            [new.scope, new.key],
        )
    )
    if not found:
        return None
    record = found[0]
    if record.expires_at > new.created_at:
        return record
    return _take_over_mysql(connection, record.pk, new, prefix)


def _take_over_mysql(
    connection: BaseDatabaseWrapper, record_id: int, new: NewClaim, prefix: str
) -> int | None:
    quote = connection.ops.quote_name
    table = quote(IdempotencyKey._meta.db_table)
    columns = _columns()
    assignments = ", ".join(
        [f"{quote(columns[field])} = %s" for field in _CLAIM_FIELDS[2:]]
        + [f"{quote(columns[field])} = NULL" for field in _RESPONSE_FIELDS]
    )
    pk = quote(IdempotencyKey._meta.pk.column)
    expires = quote(columns["expires_at"])
    adapt = connection.ops.adapt_datetimefield_value
    with connection.cursor() as cursor:
        cursor.execute(
            f"{prefix}UPDATE {table} SET {assignments} WHERE {pk} = %s AND {expires} <= %s",
            [*_insert_params(connection, new)[2:], record_id, adapt(new.created_at)],
        )
        taken = cursor.rowcount == 1
    return record_id if taken else None
