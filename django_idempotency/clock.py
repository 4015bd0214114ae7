"""The database's clock: the one clock that decides.

Whether a lease ran out, a record expired or a purge's cutoff has passed is
decided in the statement that acts on it, by the database server's clock
(PostgreSQL ``statement_timestamp()``, MySQL/MariaDB ``UTC_TIMESTAMP(6)``,
SQLite ``strftime``), never by the clock of the app host or worker that
sends it: one host whose clock is wrong must not take over a live lease or
run a completed key again. SQLite is embedded, so there its clock is the app
host's. See "Time" in docs/reliability.rst.

A test that moves time pins the clock (:func:`pin`: every statement then
reads that instant, as the server's clock would show it) or shifts it
(:func:`shift`: the server's clock plus an offset).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from operator import methodcaller
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import DateTimeField
from django.db.models.expressions import Expression

_SQLITE_FORMAT = "'%%Y-%%m-%%d %%H:%%M:%%f'"

#: The instant every statement reads while a test pins the clock, else ``None``.
_pinned: datetime | None = None
#: What a test added to the database's clock.
_offset = timedelta(0)
#: Caches of SQL that has the clock in it: emptied whenever a test moves
#: the clock, so that a cache hit needs no look at the clock.
_sql_caches: list[dict[Any, str]] = []


def is_pinned() -> bool:
    """Whether a test pinned or shifted the clock (so its statements must not be cached)."""
    return _pinned is not None or bool(_offset)


def sql_cache() -> dict[Any, str]:
    """A cache of SQL with :func:`now_sql` in it, forgotten whenever a test moves the clock."""
    cache: dict[Any, str] = {}
    _sql_caches.append(cache)
    return cache


def _forget_sql() -> None:
    for cache in _sql_caches:
        cache.clear()


def pin(when: datetime | None) -> None:
    """Tests: pin the clock at ``when`` until pinned again; ``None`` gives it back."""
    global _pinned
    _pinned = when
    _forget_sql()


@contextmanager
def shifted(offset: timedelta) -> Iterator[None]:
    """Tests: add ``offset`` to the database's clock while the block runs."""
    saved = _offset
    shift(offset)
    try:
        yield
    finally:
        shift(saved)


def shift(offset: timedelta) -> None:
    """Tests: the database's clock plus ``offset`` until shifted again (``timedelta(0)``)."""
    global _offset
    _offset = offset
    _forget_sql()


def now_sql(connection: BaseDatabaseWrapper) -> str:
    """SQL for the database's clock now, in the column's own representation."""
    vendor = connection.vendor
    if vendor == "postgresql":
        if _pinned is not None:
            return _pg_literal()
        if _offset:
            return f"(statement_timestamp() + INTERVAL '{_offset.total_seconds()} seconds')"
        return "statement_timestamp()"
    if vendor == "mysql":
        if _pinned is not None:
            return _mysql_literal()
        if _offset:
            return (
                f"(UTC_TIMESTAMP(6) + INTERVAL {_offset // timedelta(microseconds=1)} MICROSECOND)"
            )
        return "UTC_TIMESTAMP(6)"
    return f"STRFTIME({_SQLITE_FORMAT}, {_sqlite_time()})"


def later_sql(connection: BaseDatabaseWrapper) -> str:
    """SQL for the database's clock plus a parameter: :func:`seconds`' value; NULL stays NULL."""
    vendor = connection.vendor
    if vendor == "postgresql":
        return f"({now_sql(connection)} + CAST(%s AS double precision) * INTERVAL '1 second')"
    if vendor == "mysql":
        return f"({now_sql(connection)} + INTERVAL %s MICROSECOND)"
    # A number of seconds, made SQLite's modifier in SQL: NULL || text is NULL.
    return f"STRFTIME({_SQLITE_FORMAT}, {_sqlite_time()}, %s || ' seconds')"


_MICROSECOND = timedelta(microseconds=1)


def seconds(connection: BaseDatabaseWrapper, duration: timedelta | None) -> Any:
    """The parameter of :func:`later_sql` for ``duration`` (``None``: NULL)."""
    if duration is None:
        return None
    return SECONDS[connection.vendor](duration)


#: :func:`seconds` of a duration (not ``None``) by vendor (``SECONDS[vendor]``),
#: for a statement's several: C calls, no frame. MySQL's INTERVAL takes whole
#: microseconds; PostgreSQL and SQLite take a number of seconds.
SECONDS: defaultdict[str, Callable[[timedelta], Any]] = defaultdict(
    lambda: timedelta.total_seconds,
    {"mysql": methodcaller("__floordiv__", _MICROSECOND)},
)


def read(connection: BaseDatabaseWrapper) -> datetime:
    """The database's clock now, in a statement of its own (for display, not to decide)."""
    with connection.cursor() as cursor:
        # With parameters, so that each backend reads "%%" as "%".
        cursor.execute(f"SELECT {now_sql(connection)}", [])
        value = cursor.fetchone()[0]
    if isinstance(value, str):  # SQLite
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt_timezone.utc)
    return value


def _utc() -> datetime:
    assert _pinned is not None
    return _pinned.astimezone(dt_timezone.utc)


def _pg_literal() -> str:
    return f"CAST('{_utc().isoformat()}' AS timestamptz)"


def _mysql_literal() -> str:
    return f"CAST('{_utc().strftime('%Y-%m-%d %H:%M:%S.%f')}' AS DATETIME(6))"


def _sqlite_time() -> str:
    """STRFTIME's time value and the test's offset, if any, as its first modifier."""
    if _pinned is not None:
        return f"'{_utc().strftime('%Y-%m-%d %H:%M:%S.%f')}'"
    if _offset:
        return f"'now', '{_offset.total_seconds():+.6f} seconds'"
    return "'now'"


class DatabaseNow(Expression):
    """The database's clock in a query (``filter(expires_at__lte=DatabaseNow())``).

    Django's ``Now()`` is the session's time zone on MySQL, not UTC; this is
    what :func:`now_sql` says on every backend.
    """

    def __init__(self) -> None:
        super().__init__(output_field=DateTimeField())

    def as_sql(self, compiler: Any, connection: BaseDatabaseWrapper) -> Any:
        return now_sql(connection), []


class DatabaseLater(Expression):
    """The database's clock plus ``duration``, in a query."""

    def __init__(self, duration: timedelta) -> None:
        super().__init__(output_field=DateTimeField())
        self.duration = duration

    def as_sql(self, compiler: Any, connection: BaseDatabaseWrapper) -> Any:
        return later_sql(connection), [seconds(connection, self.duration)]
