"""PostgreSQL: a new key in one planned-once INSERT, anything else in one statement.

The wait for an uncommitted original is bounded by ``lock_timeout``, set inside the
claim's own statement and put back by it: the view's statements keep theirs.
"""

from __future__ import annotations

from typing import Any

from django.db import DatabaseError
from django.db.backends.base.base import BaseDatabaseWrapper

import django_idempotency.backends.base as base
from django_idempotency import clock

# SQLSTATEs (psycopg 3 calls it ``sqlstate``, psycopg2 ``pgcode``).
LOCK_NOT_AVAILABLE = "55P03"
SERIALIZATION_FAILURE, DEADLOCK_DETECTED = "40001", "40P01"
UNDEFINED_TABLE = "42P01"


class PostgreSQL(base.Backend):
    reads_before_claiming = True
    codes = {
        LOCK_NOT_AVAILABLE: base.BUSY,
        SERIALIZATION_FAILURE: base.RETRY,
        DEADLOCK_DETECTED: base.RETRY,
        UNDEFINED_TABLE: base.MISSING,
    }

    def claim(
        self, connection: base.Connection, new: base.NewClaim, wait: float, take_over: bool
    ) -> base.Found:
        found: base.Claim | base.Record | None = claim_new(connection, new, wait)
        if found is None:
            found = claim_or_find(connection, new, wait, take_over)
        if found is None:
            # The original we waited for committed after our snapshot: read it now.
            found = base.read_record(connection, new.scope, new.key)
        return found

    def code(self, exc: DatabaseError) -> Any:
        cause = exc.__cause__
        return getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)


def claim_new(
    connection: BaseDatabaseWrapper, new: base.NewClaim, wait: float
) -> base.Claim | None:
    """Claim a key nobody holds, in a cheap planned-once INSERT; ``None`` if it has a record."""
    sql = base.STATEMENTS.get((connection.vendor, "insert")) or base.cached_sql(
        connection, "insert", insert_sql
    )
    params = [lock_timeout(wait), *base.insert_params(connection, new)]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        record_id = cursor.fetchone()[0]
    return None if record_id is None else base.Claim(int(record_id))


def insert_sql(connection: BaseDatabaseWrapper) -> str:
    pk = connection.ops.quote_name(base.IdempotencyKey._meta.pk.column)
    return (
        f"{BOUNDED_WAIT}{_inserted(connection, pk)} "
        f"SELECT inserted.{pk}, {RESTORED_WAIT} FROM wait LEFT JOIN inserted ON true"
    )


#: The claim statements' first CTE: the view's ``lock_timeout`` saved, and the
#: claim's bound (the first parameter) applied for the rest of the statement.
BOUNDED_WAIT = (
    "WITH wait AS (SELECT current_setting('lock_timeout') AS previous, "
    "set_config('lock_timeout', %s, true) AS applied), "
)
#: Their last column: the view's ``lock_timeout`` put back after any wait.
RESTORED_WAIT = "set_config('lock_timeout', wait.previous, true)"


def lock_timeout(wait: float) -> str:
    return f"{max(1, round(wait * 1000))}ms"


def _inserted(connection: BaseDatabaseWrapper, returned: str) -> str:
    """The CTE ``inserted``: the new claim's row, unless the key has one (then nothing)."""
    scope, key = base.key_columns(connection)
    return (
        f"inserted AS ({base.insert_claim_into(connection)} "
        f"SELECT {base.claim_values(connection)} FROM wait "
        f"ON CONFLICT ({scope}, {key}) "
        f"DO NOTHING RETURNING {returned})"
    )


def claim_or_find(
    connection: BaseDatabaseWrapper, new: base.NewClaim, wait: float, take_over_abandoned: bool
) -> base.Claim | base.Record | None:
    """Claim, take over an expired record, or read the live one, in one statement.

    ``ON CONFLICT DO NOTHING`` waits for an uncommitted original and locks nothing on
    conflict; a conditional ``UPDATE`` takes over an expired record; else the live record
    comes back in the same round trip (a replay writes nothing, no flush at commit).
    ``None`` only when the original committed after this statement's snapshot. A claim
    that starts over rolls back the bounded ``lock_timeout`` with its savepoint.
    """
    sql = base.cached_sql(
        connection,
        ("claim", take_over_abandoned),
        lambda c: claim_sql(c, take_over_abandoned),
    )
    params = _claim_params(connection, new, wait)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    mine, values = row[0], row[1:-2]
    if mine is None:
        return None
    if mine:
        return base.claimed(connection, [values[0], *values[-len(base.PROGRESS) :]])
    return base.record_of(connection, [*values, row[-2]])


def _claim_params(connection: BaseDatabaseWrapper, new: base.NewClaim, wait: float) -> list[Any]:
    insert = base.insert_params(connection, new)
    return [
        lock_timeout(wait),
        *insert,
        new.fingerprint,
        new.fingerprint,
        *insert[2:],
        new.scope,
        new.key,
        new.fingerprint,
        new.scope,
        new.key,
    ]


def claim_sql(connection: BaseDatabaseWrapper, take_over_abandoned: bool) -> str:
    quote = connection.ops.quote_name
    table = base.quoted_table(connection)
    columns = base.column_names()
    scope, key = base.key_columns(connection)
    now = clock.now_sql(connection)
    pk = quote(base.IdempotencyKey._meta.pk.column)
    progress = [quote(columns[name]) for name in base.PROGRESS]
    record = ", ".join(f"{table}.{quote(columns[name])}" for name in base.RECORD_COLUMNS[1:])
    # A claimed key's row: its id, nothing of a record, then its progress.
    nulls = ", ".join(["NULL"] * (len(base.RECORD_COLUMNS) - 1 - len(base.PROGRESS)))
    claimed_progress = ", ".join(f"claimed.{name}" for name in progress)
    found_columns = ", ".join(["mine", *(f"c{i}" for i in range(len(base.RECORD_COLUMNS)))])
    returned = ", ".join([pk, *progress])
    return (
        f"{BOUNDED_WAIT}{_inserted(connection, returned)}, "
        f"taken AS (UPDATE {table} SET {base.progress_assignments(connection, '%s')}, "
        f"{base.takeover_assignments(connection, from_excluded=False)} "
        f"WHERE {scope} = %s AND {key} = %s AND "
        f"{base.takeover_condition(connection, take_over_abandoned, '%s', f'{table}.')} "
        "AND NOT EXISTS (SELECT 1 FROM inserted) "
        f"RETURNING {base.claimed_columns(connection, table)}), "
        f"claimed AS (SELECT {returned} FROM inserted UNION ALL SELECT {returned} FROM taken), "
        f"found ({found_columns}) AS (SELECT true, claimed.{pk}, {nulls}, {claimed_progress} "
        f"FROM claimed UNION ALL SELECT false, {table}.{pk}, {record} FROM {table} "
        f"WHERE {scope} = %s AND {key} = %s AND NOT EXISTS (SELECT 1 FROM claimed)) "
        # Always one row, so lock_timeout is always put back (also when another's record is
        # found inside the view's transaction); with the clock that decides about it.
        f"SELECT found.*, {now}, {RESTORED_WAIT} FROM wait LEFT JOIN found ON true"
    )
