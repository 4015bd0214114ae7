"""Deleting expired records in bounded batches.

The management command and the tasks (:func:`purge_expired_keys`) all call
:func:`purge_expired`. Each
batch deletes at most ``batch_size`` rows, found by the indexed
``expires_at`` column, in one short transaction of its own: no long lock, no
huge transaction, no row loaded into Python. Where the database can, a batch
skips rows another purge (or a claim taking over an expired key) has locked,
so concurrent purges do not queue; each row is counted by the one ``DELETE``
that removed it.
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.transaction import TransactionManagementError
from django.utils.connection import ConnectionDoesNotExist

from django_idempotency import clock, leases, store
from django_idempotency.conf import idempotency_settings
from django_idempotency.models import IdempotencyKey

#: Rows per batch. ``benchmarks/purge.py`` on PostgreSQL (1,000,000 rows, a
#: writer claiming throughout): 1000 took 4.9-5.0 s, 5000 3.1-3.4 s, 10000
#: 2.7-3.1 s; the writer's longest claim 10-110 ms at every size. Past 5000 a
#: doubling buys ~10% while each batch holds twice the row locks twice as
#: long (what a second purge waits for on MariaDB/MySQL).
DEFAULT_BATCH_SIZE = 5000

#: How often one batch runs again after losing a deadlock before giving up.
DEADLOCK_ATTEMPTS = 5

#: Target seconds of one batch (:class:`Pace`). A full batch took 10-45 ms on
#: PostgreSQL on a busy 2-core machine, so the size shrinks only when a batch
#: stalls (a checkpoint, a lock wait).
DEFAULT_BATCH_SECONDS = 0.1

#: Rest after each batch, as a multiple of its time: the purge has the database
#: at most two thirds of the time, and takes at most 1.5 times as long.
DEFAULT_PAUSE = 0.5

#: The adaptive batch size's start and floor (unless the largest batch is
#: smaller): below it a batch's cost is its round trip and commit.
MIN_BATCH_SIZE = 100

Progress = Callable[[int], None]

#: Waits out a rest; a module attribute so that tests can record the rests.
_rest = time.sleep


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value: object) -> bool:
    return _number(value) and value > 0  # type: ignore[operator]


@dataclass(frozen=True)
class Pace:
    """How a purge yields the database to the requests using it meanwhile.

    ``batch_seconds`` is one batch's target time: the size shrinks in
    proportion past it and doubles while under half of it, between
    :data:`MIN_BATCH_SIZE` and ``batch_size``; ``None`` keeps every batch at
    ``batch_size``. ``pause`` is the rest after each batch as a multiple of
    its time, so the purge uses the database at most ``1 / (1 + pause)`` of
    the time; ``0`` never rests. ``rate`` caps the rows per second, and no
    batch is larger than one second's worth.
    """

    batch_seconds: float | None = DEFAULT_BATCH_SECONDS
    pause: float = DEFAULT_PAUSE
    rate: float | None = None

    def __post_init__(self) -> None:
        if self.batch_seconds is not None and not _positive(self.batch_seconds):
            raise ValueError(
                "batch_seconds must be a positive number of seconds (or None to keep "
                f"every batch at batch_size), not {self.batch_seconds!r}."
            )
        if not _number(self.pause) or self.pause < 0:
            raise ValueError(
                "pause must be a number of batch durations, 0 or more "
                f"(0 turns the rest between batches off), not {self.pause!r}."
            )
        if self.rate is not None and not _positive(self.rate):
            raise ValueError(
                "rate must be a positive number of rows per second (or None for no "
                f"limit), not {self.rate!r}."
            )

    def largest(self, batch_size: int) -> int:
        """The largest batch: ``batch_size``, or one second's worth at ``rate``."""
        if self.rate is None:
            return batch_size
        return max(1, min(batch_size, math.floor(self.rate)))

    def smallest(self, batch_size: int) -> int:
        """The smallest batch the adaptive size shrinks to."""
        return min(MIN_BATCH_SIZE, self.largest(batch_size))

    def first_size(self, batch_size: int) -> int:
        """The first batch's size: the smallest while the batch time is unknown."""
        if self.batch_seconds is None:
            return self.largest(batch_size)
        return self.smallest(batch_size)

    def next_size(self, size: int, seconds: float, batch_size: int) -> int:
        """The next batch's size, after one of ``size`` rows took ``seconds``."""
        if self.batch_seconds is None:
            return self.largest(batch_size)
        if seconds > self.batch_seconds:
            wanted = math.floor(size * self.batch_seconds / seconds)
        elif seconds * 2 <= self.batch_seconds:
            wanted = size * 2
        else:
            wanted = size
        return max(self.smallest(batch_size), min(wanted, self.largest(batch_size)))

    def rest(self, rows: int, seconds: float) -> float:
        """Seconds to rest after a batch that deleted ``rows`` in ``seconds``."""
        rest = self.pause * seconds
        if self.rate is not None:
            rest = max(rest, rows / self.rate - seconds)
        return rest


def purge_expired(
    using: str | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    dry_run: bool = False,
    now: datetime | None = None,
    progress: Progress | None = None,
    *,
    batch_seconds: float | None = DEFAULT_BATCH_SECONDS,
    pause: float = DEFAULT_PAUSE,
    rate: float | None = None,
) -> int:
    """Delete every record that expired at or before ``now``; return how many went.

    ``using`` defaults to ``IDEMPOTENCY["DATABASE"]``, ``now`` to the
    database's clock (never the host's, which may be wrong), read once at the start so that a
    run ends even while records keep expiring. A lease-mode claim left in
    progress (released, or its lease ran out) is also kept until its
    ``retained_until`` (the key's TTL past its lease's end), so the retry
    that takes it over resumes from its checkpoints. ``dry_run`` only
    counts. ``progress`` gets the running total after each batch.
    ``batch_size`` caps one batch; ``batch_seconds``, ``pause`` and ``rate``
    are :class:`Pace`'s.

    Before deleting anything, a value out of range raises
    :class:`ValueError`, and a call inside a transaction (unless
    ``dry_run``) :class:`~django.db.TransactionManagementError`: every
    batch commits on its own and the purge rests between them, which inside
    a caller's transaction would hold it, and every row deleted so far, for
    the whole purge (run it outside, or from ``transaction.on_commit``). An unknown
    alias, or a missing table (run ``migrate``), raises
    :class:`~django.core.exceptions.ImproperlyConfigured`; a lock wait that
    ran out, :class:`~django_idempotency.store.Busy` (a
    :class:`~django.db.DatabaseError`); other database errors propagate.
    Every batch commits on its own: rows deleted before a failure stay
    deleted.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, not {batch_size!r}.")
    pace = Pace(batch_seconds=batch_seconds, pause=pause, rate=rate)
    using = using or idempotency_settings.database
    try:
        connection = connections[using]
    except ConnectionDoesNotExist as exc:
        # Configuration to fix, for the command and the tasks alike.
        raise ImproperlyConfigured(f"Unknown database {using!r}: {exc}") from exc
    if not dry_run and _in_a_transaction(connection):
        raise TransactionManagementError(
            f"purge_expired() cannot run inside a transaction on database {using!r}: each "
            "batch commits on its own and the purge rests between batches, which would hold "
            "the transaction, and every row deleted so far, open for the whole purge. Call it "
            "outside transaction.atomic() (or with autocommit on), for example from "
            "transaction.on_commit(), or pass dry_run=True to only count."
        )
    with store.explained(using):
        cutoff = clock.read(connection) if now is None else now
        if dry_run:
            return _count(connection, cutoff)
        return _purge(connection, cutoff, batch_size, pace, progress)


def purge_expired_keys(
    batch_size: int = DEFAULT_BATCH_SIZE,
    database: str | None = None,
    batch_seconds: float | None = DEFAULT_BATCH_SECONDS,
    pause: float = DEFAULT_PAUSE,
    rate: float | None = None,
) -> int:
    """Delete expired idempotency records; return how many were deleted.

    The body of Celery's task and the Tasks framework's, each registered by its ``contrib``
    module. ``database`` defaults to ``IDEMPOTENCY["DATABASE"]``. Safe on several workers at
    once: each record is deleted, and counted, once. Idempotent tasks' records share the
    table and go with the rest. ``batch_seconds``, ``pause`` and ``rate`` pace it as the
    command's options do (``batch_seconds=None, pause=0`` runs batches back to back); a value
    out of range raises ``ValueError`` before anything is deleted.
    """
    return purge_expired(
        using=database, batch_size=batch_size, batch_seconds=batch_seconds, pause=pause, rate=rate
    )


def _count(connection: BaseDatabaseWrapper, cutoff: datetime) -> int:
    """What a purge with ``cutoff`` would delete: the batches' own condition, counted."""
    table = _names(connection)[0]
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT COUNT(*) FROM {table} WHERE {_purgeable_sql(connection)}",
            _cutoff(connection, cutoff),
        )
        return int(cursor.fetchone()[0])


def _in_a_transaction(connection: BaseDatabaseWrapper) -> bool:
    """Whether ``connection`` is in a transaction the batches cannot commit.

    ``TestCase``'s own is tolerated, so the purge is testable there.
    """
    if connection.in_atomic_block:
        blocks = connection.atomic_blocks
        return not all(getattr(block, "_from_testcase", False) for block in blocks)
    return not connection.get_autocommit()


def _purge(
    connection: BaseDatabaseWrapper,
    cutoff: datetime,
    batch_size: int,
    pace: Pace,
    progress: Progress | None,
) -> int:
    delete_batch = _delete_batch(connection)
    deleted = 0
    size = pace.first_size(batch_size)
    passed: datetime | None = None
    while True:
        started = time.monotonic()
        batch = _with_deadlock_retry(connection, delete_batch, cutoff, size, passed)
        seconds = time.monotonic() - started
        deleted += batch.removed
        passed = batch.passed
        if progress is not None and batch.removed:
            progress(deleted)
        # A short batch: nothing purgeable is left that this purge could
        # lock; rows another purge holds are that purge's to delete.
        if batch.removed < size:
            return deleted
        rest = pace.rest(batch.removed, seconds)
        if rest > 0:
            _rest(rest)
        size = pace.next_size(size, seconds, batch_size)


class Batch(NamedTuple):
    """What one batch did: the rows it deleted, and how far it got."""

    removed: int
    #: The latest expiry deleted (or a boundary no purgeable row before it
    #: was left), where the next batch starts; as the database returned it.
    passed: Any = None


DeleteBatch = Callable[[BaseDatabaseWrapper, datetime, int, Any], Batch]


def _with_deadlock_retry(
    connection: BaseDatabaseWrapper,
    delete_batch: DeleteBatch,
    cutoff: datetime,
    batch_size: int,
    passed: Any,
) -> Batch:
    """Run one batch again if the database chose it as a deadlock victim.

    InnoDB can deadlock two deletes walking the same secondary index. The
    victim's batch was rolled back whole, so nothing of it was deleted or
    counted, and it simply runs again. Inside a caller's transaction, which
    the deadlock rolled back too, the error is raised.
    """
    for attempt in range(1, DEADLOCK_ATTEMPTS + 1):
        try:
            with store.explained(connection.alias):
                return delete_batch(connection, cutoff, batch_size, passed)
        except store.Retry:
            if connection.in_atomic_block or attempt == DEADLOCK_ATTEMPTS:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def _names(connection: BaseDatabaseWrapper) -> tuple[str, str, str]:
    quote = connection.ops.quote_name
    meta = IdempotencyKey._meta
    return quote(meta.db_table), quote(meta.pk.column), _column(connection, "expires_at")


def _column(connection: BaseDatabaseWrapper, name: str) -> str:
    field = IdempotencyKey._meta.get_field(name)
    return connection.ops.quote_name(str(field.column))  # type: ignore[union-attr]


def _purgeable_sql(connection: BaseDatabaseWrapper) -> str:
    """:func:`leases.purgeable_sql` for the batches and the dry run: the cutoff twice.

    Found on the ``expires_at`` index, a claim still retained is stepped over for a later run.
    """
    return leases.purgeable_sql(connection, "%s")


def _cutoff(connection: BaseDatabaseWrapper, cutoff: datetime) -> list[Any]:
    """The parameters of :func:`_purgeable_sql`."""
    value = connection.ops.adapt_datetimefield_value(cutoff)
    if connection.vendor == "sqlite" and "." not in str(value):
        # SQLite compares text: Django writes a whole second without a
        # fraction ("10:21:01"), which sorts before the stored "10:21:01.000";
        # six zeros sort after both.
        value = f"{value}.000000"
    return [value] * 2


def _delete_batch_postgresql(
    connection: BaseDatabaseWrapper, cutoff: datetime, batch_size: int, passed: Any
) -> Batch:
    """PostgreSQL: choose and delete one batch in a single statement, from where the last ended.

    One statement is its own transaction under autocommit, with no round
    trip carrying the keys. ``ORDER BY expires_at`` keeps the planner on the
    index even when few rows have expired; ``FOR UPDATE SKIP LOCKED`` leaves
    a locked row (a claim taking it over, another purge) to that
    transaction, or else to the next run. A deleted row's index entry stays
    until ``VACUUM``: a batch walking the index from its start would step
    over every row deleted so far, making a purge quadratic in its rows.
    """
    table, pk, expires = _names(connection)
    adapted = None if passed is None else connection.ops.adapt_datetimefield_value(passed)
    where, params = _batch_where(connection, cutoff, adapted)
    batch = (
        f"SELECT {pk} FROM {table} WHERE {where} ORDER BY {expires} LIMIT %s FOR UPDATE SKIP LOCKED"
    )
    # "IN (subquery)" hash-joins each batch against a sequential scan of the
    # table; an ARRAY(...) is computed once and found through the primary key.
    sql = (
        f"WITH gone AS (DELETE FROM {table} WHERE {pk} = ANY(ARRAY({batch})) "
        f"RETURNING {expires}) SELECT count(*), max({expires}) FROM gone"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [*params, batch_size])
        removed, last = cursor.fetchone()
    return Batch(removed, last if last is not None else passed)


def _expiry_as_stored(connection: BaseDatabaseWrapper, expires: str) -> str:
    """``expires_at`` as read back to start the next batch from.

    SQLite stores and compares it as text (``STRFTIME``'s milliseconds); sent
    back as a ``datetime`` it would be written otherwise and not equal itself.
    """
    return f"CAST({expires} AS TEXT)" if connection.vendor == "sqlite" else expires


def _batch_where(
    connection: BaseDatabaseWrapper, cutoff: datetime, passed: Any
) -> tuple[str, list[Any]]:
    """What a batch may delete, and its parameters: purgeable rows from ``passed`` on.

    ``>=``: rows sharing the last batch's final expiry may remain.
    """
    where, params = _purgeable_sql(connection), _cutoff(connection, cutoff)
    if passed is None:
        return where, params
    return f"{where} AND {_names(connection)[2]} >= %s", [*params, passed]


def _delete_first(connection: BaseDatabaseWrapper, where: str) -> str:
    """``DELETE`` of the first rows by expiry matching ``where``, ``LIMIT`` the last parameter.

    MySQL/MariaDB delete by ``ORDER BY expires_at LIMIT``, not by keys
    (:func:`_delete_batch_bounded` says why); SQLite, without ``LIMIT`` on
    ``DELETE``, by a subquery's keys (it serialises writers anyway).
    """
    table, pk, expires = _names(connection)
    if connection.vendor == "mysql":
        return f"DELETE FROM {table} WHERE {where} ORDER BY {expires} LIMIT %s"
    batch = f"SELECT {pk} FROM {table} WHERE {where} ORDER BY {expires} LIMIT %s"
    return f"DELETE FROM {table} WHERE {pk} IN ({batch})"


def _delete_batch_returning(
    connection: BaseDatabaseWrapper, cutoff: datetime, batch_size: int, passed: Any
) -> Batch:
    """MariaDB, SQLite 3.35+: delete one batch from where the last ended, learning where it ends.

    One statement, its own transaction under autocommit. ``RETURNING`` gives
    where the batch ended, so the next does not step again over the retained
    claims ahead of the rows it deletes (expiries as stored:
    :func:`_expiry_as_stored`), in the statement :func:`_delete_first` writes.
    """
    where, params = _batch_where(connection, cutoff, passed)
    returned = _expiry_as_stored(connection, _names(connection)[2])
    sql = f"{_delete_first(connection, where)} RETURNING {returned}"
    with connection.cursor() as cursor:
        cursor.execute(sql, [*params, batch_size])
        gone = [row[0] for row in cursor.fetchall()]
    return Batch(len(gone), max(gone) if gone else passed)


def _delete_batch_bounded(
    connection: BaseDatabaseWrapper, cutoff: datetime, batch_size: int, passed: Any
) -> Batch:
    """MySQL (no ``DELETE ... RETURNING``), older SQLite, any other backend: read, then delete.

    First, unlocked, the boundary: the expiry of the ``batch_size``-th
    purgeable row from where the last batch ended (none when fewer are
    left). Then at most ``batch_size`` purgeable rows up to it go, in
    ``expires_at`` order, none past the cutoff ever deleted (the condition
    holds it too); rows sharing it that the limit left start the next
    batch, so none steps again over the claims kept ahead of it.

    MySQL/MariaDB have ``SKIP LOCKED`` only on ``SELECT``, and a locked
    ``SELECT`` then ``DELETE ... WHERE id IN (...)`` deadlocked concurrent
    purges on MariaDB 10.11 (the optimizer may scan the table for a long
    ``IN`` list). Walking the index in order, every purge locks rows in the
    same order: concurrent purges queue for at most one batch, and one that
    finds its rows gone behind that wait ends early, leaving the rest to
    the purge that deleted them.
    """
    table, _, expires = _names(connection)
    where, params = _batch_where(connection, cutoff, passed)
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {_expiry_as_stored(connection, expires)} FROM {table} WHERE {where} "
            f"ORDER BY {expires} LIMIT 1 OFFSET %s",
            [*params, batch_size - 1],
        )
        row = cursor.fetchone()
        boundary = None if row is None else row[0]
        if boundary is not None:
            where = f"{where} AND {expires} <= %s"
            params.append(boundary)
        cursor.execute(_delete_first(connection, where), [*params, batch_size])
        removed = cursor.rowcount
    return Batch(removed, passed if boundary is None else boundary)


_DELETE_BATCH: dict[str, DeleteBatch] = {"postgresql": _delete_batch_postgresql}


def _delete_batch(connection: BaseDatabaseWrapper) -> DeleteBatch:
    """The batch for ``connection``'s database."""
    if connection.vendor in _DELETE_BATCH:
        return _DELETE_BATCH[connection.vendor]
    if connection.vendor == "mysql":
        mariadb = getattr(connection, "mysql_is_mariadb", False)
        return _delete_batch_returning if mariadb else _delete_batch_bounded
    if connection.vendor == "sqlite" and sqlite3.sqlite_version_info >= (3, 35):
        return _delete_batch_returning
    return _delete_batch_bounded
