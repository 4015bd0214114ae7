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

A record is purged once it expired (:func:`leases.purgeable_sql`); a lease-mode
claim left in progress (released by its owner, or abandoned when its lease
ran out) carries its attempt and checkpoints to the retry that takes it
over, so it is kept until its ``retained_until`` too: the key's TTL past
the end of its lease (as the claim, a takeover, a renewal or a release
last set it).

A purge also yields to the requests that share the database with it (see
:class:`Pace`): each batch is sized to stay under a target time, the purge
rests between batches in proportion to how long each took, and it may be
held to a number of rows per second. So it runs outside any transaction:
every batch commits on its own, and no rest holds a caller's transaction
open.
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

#: Target seconds of one batch's transaction (see :class:`Pace`). A batch of
#: DEFAULT_BATCH_SIZE rows took 10-45 ms on PostgreSQL on a busy 2-core
#: machine (``benchmarks/purge.py``), so the size shrinks only when a batch
#: stalls (a checkpoint, a lock wait) rather than under ordinary load.
DEFAULT_BATCH_SECONDS = 0.1

#: Rest after each batch, as a multiple of the time the batch took: the
#: purge has the database at most two thirds of the time, and takes at most
#: half as long again as back to back (docs/purge.rst has the figures).
DEFAULT_PAUSE = 0.5

#: The adaptive batch size starts here and never shrinks below it (nor
#: past ``batch_size``): under a hundred rows a batch's cost is its round
#: trip and commit, and shrinking it further shortens no lock.
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
    """How a purge shares the database with the requests that use it meanwhile.

    A batch's ``DELETE`` competes with claims for the server's CPU, its
    write-ahead log and its disk. ``batch_seconds`` bounds how long one
    batch holds them: the batch size adapts (shrinking at once past the
    target, doubling back while well under it) between
    :data:`MIN_BATCH_SIZE` and the purge's ``batch_size``; ``None`` keeps
    every batch at ``batch_size``. ``pause`` is the rest after each batch
    as a multiple of the time it took, so the purge uses the database at
    most ``1 / (1 + pause)`` of the time whatever the machine; ``0`` never
    rests. ``rate``, if given, holds the purge to that many rows per
    second, and no batch is larger than one second's worth.
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
            # Shrink in proportion: a batch over the target is what hurts.
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

    ``using`` defaults to the ``IDEMPOTENCY["DATABASE"]`` setting and ``now``
    to the database's clock (never the host's, which may be wrong) when the
    purge starts, fixed so that a run always ends even while new records
    keep expiring; each batch deletes only what expired by then. ``dry_run`` counts what would
    be deleted and deletes nothing. ``progress`` is called after each batch
    with the running total, so callers can report on long runs.
    ``batch_size`` is the most rows one batch deletes; ``batch_seconds``,
    ``pause`` and ``rate`` say how the purge yields to requests meanwhile
    (see :class:`Pace`).

    A record still in progress (a lease-mode claim released by its owner,
    or abandoned) is kept until its ``retained_until`` as well, so that the
    retry that takes it over resumes from its checkpoints.

    A value out of range raises :class:`ValueError` naming the fix, before
    anything is deleted; so does a call inside a transaction
    (:class:`~django.db.TransactionManagementError`; a dry run is allowed):
    every batch commits on its own and the purge rests between them, which
    inside a caller's transaction would hold it, and every row deleted so
    far, for the whole purge. Run it outside, or from
    ``transaction.on_commit``.
    An unknown database alias, and a missing table, raise
    :class:`~django.core.exceptions.ImproperlyConfigured` (the latter saying
    to run ``migrate``); a lock wait that ran out (the database is
    locked) raises :class:`~django_idempotency.store.Busy`, a
    :class:`~django.db.DatabaseError`; other database errors propagate
    unchanged.
    Rows already deleted by earlier batches stay deleted if a later batch
    fails: every batch commits on its own.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, not {batch_size!r}.")
    pace = Pace(batch_seconds=batch_seconds, pause=pause, rate=rate)
    using = using or idempotency_settings.database
    try:
        connection = connections[using]
    except ConnectionDoesNotExist as exc:
        # A scheduled task meets this as the command does: as configuration
        # to fix, not as an error of Django's connection handler.
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
    """Whether ``connection`` is inside a transaction the purge's batches cannot commit.

    The one Django's ``TestCase`` wraps each test in is tolerated, so that
    the purge stays testable there (its batches commit with the test's).
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
        # Each statement deletes every row it chose, so a short batch means
        # nothing more purgeable is left that this purge could lock; rows
        # another purge holds are that purge's to delete.
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

    InnoDB can deadlock two deletes walking the same secondary index (one
    holds the index entry, the other the row). The victim's batch is rolled
    back whole, so nothing of it was deleted or counted and it can simply run
    again. Inside a caller's transaction that transaction is lost too, so
    the error is raised instead.
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
    """:func:`leases.purgeable_sql`, for the batches and the dry run: the cutoff twice.

    Each backend walks the ``expires_at`` index and only reads the other columns of the
    rows it finds there: a claim still retained is stepped over, and left for a later run.
    """
    return leases.purgeable_sql(connection, "%s")


def _cutoff(connection: BaseDatabaseWrapper, cutoff: datetime) -> list[Any]:
    """The parameters of :func:`_purgeable_sql`."""
    value = connection.ops.adapt_datetimefield_value(cutoff)
    if connection.vendor == "sqlite" and "." not in str(value):
        # SQLite compares text: Django's text of a whole second has no
        # fraction ("... 10:21:01"), which sorts before the stored
        # "... 10:21:01.000" of STRFTIME's milliseconds. Six zeros sort
        # after both that and Django's own "... 10:21:01".
        value = f"{value}.000000"
    return [value] * 2


def _delete_batch_postgresql(
    connection: BaseDatabaseWrapper, cutoff: datetime, batch_size: int, passed: Any
) -> Batch:
    """PostgreSQL: choose and delete one batch in a single statement, from where the last ended.

    One statement is one transaction under autocommit, with no round trip
    carrying the keys. ``ORDER BY expires_at`` keeps the planner on the index
    even when only a few rows of a large table have expired, and
    ``FOR UPDATE SKIP LOCKED`` lets concurrent purges take disjoint batches.
    A deleted row's index entry stays until ``VACUUM``, so a batch that
    walked the index from its start stepped over every row the purge had
    deleted so far: each batch slower than the last, a purge's time
    quadratic in its rows. Each batch starts at the latest expiry the one
    before deleted (``>=``: rows sharing it may remain). A row locked when
    the purge passed it (a claim taking it over, another purge deleting it)
    is that transaction's, and otherwise left to the next run.
    """
    table, pk, expires = _names(connection)
    adapted = None if passed is None else connection.ops.adapt_datetimefield_value(passed)
    where, params = _batch_where(connection, cutoff, adapted)
    batch = (
        f"SELECT {pk} FROM {table} WHERE {where} ORDER BY {expires} LIMIT %s FOR UPDATE SKIP LOCKED"
    )
    # With "IN (subquery)" the planner hash-joins the batch against a
    # sequential scan of the whole table, every batch. An ARRAY(...) is
    # computed once up front and then found through the primary key.
    sql = (
        f"WITH gone AS (DELETE FROM {table} WHERE {pk} = ANY(ARRAY({batch})) "
        f"RETURNING {expires}) SELECT count(*), max({expires}) FROM gone"
    )
    # Under autocommit the one statement is its own transaction.
    with connection.cursor() as cursor:
        cursor.execute(sql, [*params, batch_size])
        removed, last = cursor.fetchone()
    return Batch(removed, last if last is not None else passed)


def _expiry_as_stored(connection: BaseDatabaseWrapper, expires: str) -> str:
    """``expires_at`` as a batch reads it back to start the next batch from.

    SQLite stores it as text of its own format (``STRFTIME``'s milliseconds)
    and compares text: read back as a ``datetime`` and sent again, it would
    be written another way (microseconds, or none) and compare unequal to
    itself, so it is read as the text it is.
    """
    return f"CAST({expires} AS TEXT)" if connection.vendor == "sqlite" else expires


def _batch_where(
    connection: BaseDatabaseWrapper, cutoff: datetime, passed: Any
) -> tuple[str, list[Any]]:
    """What a batch may delete, and its parameters: purgeable rows from where the last ended.

    From ``passed``, where the last batch ended (``>=``: rows sharing its
    expiry may remain); from the start for the first batch.
    """
    where, params = _purgeable_sql(connection), _cutoff(connection, cutoff)
    if passed is None:
        return where, params
    return f"{where} AND {_names(connection)[2]} >= %s", [*params, passed]


def _delete_batch_returning(
    connection: BaseDatabaseWrapper, cutoff: datetime, batch_size: int, passed: Any
) -> Batch:
    """MariaDB, SQLite 3.35+: delete one batch from where the last ended, learning where it ends.

    One statement is one transaction under autocommit, with no round trip
    carrying the keys; ``ORDER BY expires_at`` keeps the planner on the
    index. Each batch starts at the latest expiry the one before deleted,
    which ``RETURNING`` gives: a batch that walked the index from its start
    stepped over every claim the purge keeps (still retained) ahead of the
    rows it deletes, each batch again. The expiries come back as the
    database stores them and go back in as they came
    (:func:`_expiry_as_stored`).

    MariaDB deletes with ``DELETE ... ORDER BY expires_at LIMIT`` (see
    :func:`_delete_batch_bounded` for why not by keys); SQLite, which has no
    ``LIMIT`` on ``DELETE`` by default, by the keys of a subquery, finding
    ``IN`` rows by rowid (it serialises writers anyway).
    """
    table, pk, expires = _names(connection)
    where, params = _batch_where(connection, cutoff, passed)
    returned = _expiry_as_stored(connection, expires)
    if connection.vendor == "mysql":
        sql = f"DELETE FROM {table} WHERE {where} ORDER BY {expires} LIMIT %s RETURNING {returned}"
    else:
        batch = f"SELECT {pk} FROM {table} WHERE {where} ORDER BY {expires} LIMIT %s"
        sql = f"DELETE FROM {table} WHERE {pk} IN ({batch}) RETURNING {returned}"
    with connection.cursor() as cursor:
        cursor.execute(sql, [*params, batch_size])
        gone = [row[0] for row in cursor.fetchall()]
    return Batch(len(gone), max(gone) if gone else passed)


def _delete_batch_bounded(
    connection: BaseDatabaseWrapper, cutoff: datetime, batch_size: int, passed: Any
) -> Batch:
    """MySQL (no ``DELETE ... RETURNING``), older SQLite, any other backend: read, then delete.

    Where the batch will end is read first, without a lock: the expiry of
    the ``batch_size``-th purgeable row from where the last batch ended (or
    none, when fewer are left). The batch then deletes, in ``expires_at``
    order, at most ``batch_size`` purgeable rows between the two. Every
    purgeable row before that boundary is among them, and rows sharing it
    that the limit left are where the next batch starts (``>=``); none past
    the cutoff is ever deleted (the condition holds it too). So no batch
    steps over the claims the purge keeps ahead of it again.

    ``SKIP LOCKED`` exists only on ``SELECT`` on MySQL/MariaDB, and a locked
    ``SELECT`` followed by ``DELETE ... WHERE id IN (...)`` deadlocked
    between concurrent purges on MariaDB 10.11 while the optimizer is free
    to scan the table for a long ``IN`` list. Walking the ``expires_at``
    index in order, every purge locks rows in the same order, so concurrent
    purges queue for at most one batch instead of deadlocking; a batch that
    found rows gone behind such a wait ends this purge early, and the purge
    that deleted them carries on.
    """
    table, pk, expires = _names(connection)
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
        if connection.vendor == "mysql":
            sql = f"DELETE FROM {table} WHERE {where} ORDER BY {expires} LIMIT %s"
        else:
            batch = f"SELECT {pk} FROM {table} WHERE {where} ORDER BY {expires} LIMIT %s"
            sql = f"DELETE FROM {table} WHERE {pk} IN ({batch})"
        cursor.execute(sql, [*params, batch_size])
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
