"""Deleting expired records in bounded batches.

The management command and the Celery task both call :func:`purge_expired`,
so the purge is written (and tested) once. Each batch picks at most
``batch_size`` primary keys by the indexed ``expires_at`` column and deletes
them in one short transaction of its own: a purge of millions of rows never
holds a long lock, never builds one huge transaction, and never loads a row
into Python. Purges on several workers at once do not queue behind each
other: where the database can, a batch skips rows another purge (or a claim
taking over an expired key) has locked, and each row is counted by the one
``DELETE`` that removed it.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils.connection import ConnectionDoesNotExist

from django_idempotency import clock, store
from django_idempotency.conf import idempotency_settings
from django_idempotency.models import IdempotencyKey

#: Rows per batch. Measured with ``benchmarks/purge.py`` on PostgreSQL
#: (1,000,000 expired rows, a writer claiming keys throughout, two runs):
#: 1000 took 4.9-5.0 s, 2000 3.6 s, 5000 3.1-3.4 s and 10000 2.7-3.1 s; the
#: writer's longest claim was 10-110 ms at every size, and peak RSS 52 MB.
#: Past 5000 a doubling buys about 10% while every batch holds twice as many
#: row locks for twice as long (on MariaDB/MySQL, where purges queue behind
#: each other's batch, that wait is what a second purge sees), so 5000.
DEFAULT_BATCH_SIZE = 5000

#: How often one batch runs again after losing a deadlock before giving up.
DEADLOCK_ATTEMPTS = 5

Progress = Callable[[int], None]


def purge_expired(
    using: str | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    dry_run: bool = False,
    now: datetime | None = None,
    progress: Progress | None = None,
) -> int:
    """Delete every record that expired at or before ``now``; return how many went.

    ``using`` defaults to the ``IDEMPOTENCY["DATABASE"]`` setting and ``now``
    to the database's clock (never the host's, which may be wrong) when the
    purge starts, fixed so that a run always ends even while new records
    keep expiring; each batch deletes only what expired by then. ``dry_run`` counts what would
    be deleted and deletes nothing. ``progress`` is called after each batch
    with the running total, so callers can report on long runs.

    An unknown database alias, and a missing table, raise
    :class:`~django.core.exceptions.ImproperlyConfigured` (the latter saying
    to run ``migrate``); a lock wait that ran out (the database is
    locked) raises :class:`~django_idempotency.store.Busy`, a
    :class:`~django.db.DatabaseError`; other database errors propagate
    unchanged.
    Rows already deleted by earlier batches stay deleted if a later batch
    fails: every batch commits on its own.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, not {batch_size!r}.")
    using = using or idempotency_settings.database
    try:
        connection = connections[using]
    except ConnectionDoesNotExist as exc:
        # A scheduled task meets this as the command does: as configuration
        # to fix, not as an error of Django's connection handler.
        raise ImproperlyConfigured(f"Unknown database {using!r}: {exc}") from exc
    with store.explained(using):
        cutoff = clock.read(connection) if now is None else now
        if dry_run:
            return IdempotencyKey.objects.using(using).filter(expires_at__lte=cutoff).count()
        return _purge(connection, cutoff, batch_size, progress)


def _purge(
    connection: BaseDatabaseWrapper,
    cutoff: datetime,
    batch_size: int,
    progress: Progress | None,
) -> int:
    delete_batch = _delete_batch_mysql if connection.vendor == "mysql" else _delete_batch_subquery
    deleted = 0
    while True:
        found, removed = _with_deadlock_retry(connection, delete_batch, cutoff, batch_size)
        deleted += removed
        if progress is not None and removed:
            progress(deleted)
        # A short batch means nothing more expired is left that this purge
        # could lock; rows another purge holds are that purge's to delete.
        if found < batch_size:
            return deleted


def _with_deadlock_retry(
    connection: BaseDatabaseWrapper,
    delete_batch: Callable[[BaseDatabaseWrapper, datetime, int], tuple[int, int]],
    cutoff: datetime,
    batch_size: int,
) -> tuple[int, int]:
    """Run one batch again if the database chose it as a deadlock victim.

    InnoDB can deadlock two deletes walking the same secondary index (one
    holds the index entry, the other the row). The victim's batch is rolled
    back whole, so nothing of it was deleted or counted and it can simply run
    again. Inside a caller's transaction that transaction is lost too, so
    the error is raised instead.
    """
    for attempt in range(1, DEADLOCK_ATTEMPTS + 1):
        try:
            with store.explained(connection.alias):
                return delete_batch(connection, cutoff, batch_size)
        except store.Retry:
            if connection.in_atomic_block or attempt == DEADLOCK_ATTEMPTS:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def _names(connection: BaseDatabaseWrapper) -> tuple[str, str, str]:
    quote = connection.ops.quote_name
    meta = IdempotencyKey._meta
    return (
        quote(meta.db_table),
        quote(meta.pk.column),
        quote(next(str(f.column) for f in meta.concrete_fields if f.name == "expires_at")),
    )


def _delete_batch_subquery(
    connection: BaseDatabaseWrapper, cutoff: datetime, batch_size: int
) -> tuple[int, int]:
    """PostgreSQL and SQLite: choose and delete one batch in a single statement.

    One statement is one transaction under autocommit, with no round trip
    carrying the keys. ``ORDER BY expires_at`` keeps the planner on the index
    even when only a few rows of a large table have expired. On PostgreSQL
    ``FOR UPDATE SKIP LOCKED`` lets concurrent purges take disjoint batches;
    SQLite serialises writers anyway (and finds ``IN`` rows by rowid).
    """
    table, pk, expires = _names(connection)
    batch = f"SELECT {pk} FROM {table} WHERE {expires} <= %s ORDER BY {expires} LIMIT %s"
    if connection.vendor == "postgresql":
        # With "IN (subquery)" the planner hash-joins the batch against a
        # sequential scan of the whole table, every batch. An ARRAY(...) is
        # computed once up front and then found through the primary key.
        sql = f"DELETE FROM {table} WHERE {pk} = ANY(ARRAY({batch} FOR UPDATE SKIP LOCKED))"
    else:
        sql = f"DELETE FROM {table} WHERE {pk} IN ({batch})"
    params = [connection.ops.adapt_datetimefield_value(cutoff), batch_size]
    # Under autocommit the one statement is its own transaction.
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        removed = cursor.rowcount
    # The statement does not say how many rows it chose, only how many it
    # deleted; on these backends the two are the same rows.
    return removed, removed


def _delete_batch_mysql(
    connection: BaseDatabaseWrapper, cutoff: datetime, batch_size: int
) -> tuple[int, int]:
    """MySQL/MariaDB: one ``DELETE ... ORDER BY expires_at LIMIT`` per batch.

    ``SKIP LOCKED`` exists only on ``SELECT`` here (MariaDB 10.6+, MySQL 8),
    and a locked ``SELECT`` followed by ``DELETE ... WHERE id IN (...)``
    deadlocked between concurrent purges on MariaDB 10.11 while the
    optimizer is free to scan the table for a long ``IN`` list. Walking the
    ``expires_at`` index in order, every purge locks rows in the same order,
    so concurrent purges queue for at most one batch instead of deadlocking.
    """
    table, _pk, expires = _names(connection)
    with connection.cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {table} WHERE {expires} <= %s ORDER BY {expires} LIMIT %s",
            [connection.ops.adapt_datetimefield_value(cutoff), batch_size],
        )
        removed = cursor.rowcount
    return removed, removed
