"""Run a request held at a known point while copies of it run in other threads.

For :func:`django_idempotency.testing.race_duplicates`, which judges the
answers. The original is held where it sends a signal, and let go once each
copy has answered or is seen waiting for it in the database; a copy counted
as waiting must still be in its claim then. Each thread has its own
connections and client.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from django.db import DatabaseError, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.sqlite3.creation import DatabaseCreation
from django.dispatch import Signal
from django.http import HttpResponseBase

# Seconds between looks at the copies while the original is held (a statement each).
POLL_INTERVAL = 0.005

_is_in_memory_db = DatabaseCreation.is_in_memory_db


class RaceSetupError(RuntimeError):
    """The test cannot run a race: the message says what to change."""


class NotHeld(AssertionError):
    """The original answered without ever reaching the point it was to be held at."""

    def __init__(self, response: HttpResponseBase) -> None:
        super().__init__(f"the original was answered {response.status_code} without being held")
        self.response = response


@dataclass
class RaceRun:
    """What a race produced: the answers, and which copies were seen waiting."""

    original: HttpResponseBase
    duplicates: list[HttpResponseBase]
    waited: list[bool]
    #: Whether the original was held inside a transaction (atomic mode).
    in_transaction: bool


def refuse_untestable(using: str) -> None:
    """Raise :class:`RaceSetupError` where threads could not race the original.

    In a ``TestCase``'s transaction the threads' connections would block on
    (or not see) the test's uncommitted rows;
    in-memory SQLite is private to one connection, or a shared cache
    answering "table is locked" at once. Called from a running event loop,
    or on a server database reached through a pooler, the race cannot run
    either (:func:`_refuse_event_loop`, :func:`_refuse_proxied`).
    """
    _refuse_event_loop()
    for connection in connections.all(initialized_only=True):
        if connection.in_atomic_block:
            raise RaceSetupError(
                f"race_duplicates() needs a transactional test: database {connection.alias!r} "
                "is inside the transaction that TestCase (or django_db without "
                "transaction=True) wraps the test in, where the original's rows are not "
                "committed and its copies would block on them. Use TransactionTestCase, or "
                "@pytest.mark.django_db(transaction=True)."
            )
    connection = connections[using]
    if connection.vendor == "sqlite" and _is_in_memory_db(connection.settings_dict["NAME"]):
        raise RaceSetupError(
            f"race_duplicates() cannot race on database {using!r}: it is an in-memory SQLite "
            "database, which is either private to one connection or shared through a cache "
            "that answers 'table is locked' at once instead of waiting. Give the test "
            f"database a file: DATABASES[{using!r}]['TEST']['NAME'] = 'test.sqlite3'."
        )
    _refuse_proxied(connection)


def _refuse_event_loop() -> None:
    """Refuse a running event loop, as Django refuses the database there.

    The race blocks the calling thread until every request has answered,
    and reads ``effect()`` and the database from it. Django would raise
    ``SynchronousOnlyOperation`` only at the race's first query, after the
    setup had begun. ``DJANGO_ALLOW_ASYNC_UNSAFE`` lifts both.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    if os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE"):
        return
    raise RaceSetupError(
        "race_duplicates() was called from async code (an event loop is running in this "
        "thread, as in an async test): it blocks the thread it is called from until every "
        "request has answered, and reads effect() and the database there, which Django "
        "refuses inside an event loop. Call it from a sync test, or from the async one "
        "through asgiref: await sync_to_async(race_duplicates)(client, ...)."
    )


def _refuse_proxied(connection: BaseDatabaseWrapper) -> None:
    """Refuse a server database reached through a pooler or proxy (PgBouncer, ProxySQL).

    The race finds waits, and ends requests left running, by the session id
    a connection got on connecting. Through a pooler that id is made up, or
    serves other clients between transactions: the race could see no wait
    and end another client's session.
    """
    if connection.vendor not in {"postgresql", "mysql"}:
        return
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_backend_pid()")
        else:
            cursor.execute("SELECT CONNECTION_ID()")
        (running,) = cursor.fetchone()
    given = _session_id(connection)
    if given == int(running):
        return
    alias = connection.alias
    server, pooler = (
        ("PostgreSQL", "PgBouncer")
        if connection.vendor == "postgresql"
        else ("the database server", "ProxySQL")
    )
    raise RaceSetupError(
        f"race_duplicates() cannot race on database {alias!r}: its connections reach "
        f"{server} through a connection pooler or proxy (such as {pooler}). The session "
        f"running this connection's statements ({running}) is not the one it was given "
        f"when it connected ({given}), so the race could neither see which duplicate waits "
        "for the original nor end a request left running without risking another "
        f"client's session. Run these tests against {server} itself: in the settings the "
        f"tests run with, give DATABASES[{alias!r}] the server's HOST and PORT, not the "
        "pooler's."
    )


@dataclass
class _Watch:
    """What one copy's thread is doing, as its connection's statements show it.

    Written by the copy's thread, read by the test's, under ``lock``: shared with
    the let-go, which so sees each claim statement running or returned.
    """

    table: str
    lock: threading.Lock
    claiming: str | None = None
    session: int | None = None
    #: When (``time.monotonic()``) its first claim statement started.
    started: float | None = None
    #: When its last claim statement returned; ``None`` while one runs.
    returned: float | None = None
    #: Whether that statement raised: its wait ended without the original.
    gave_up: bool = False

    def __call__(
        self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: dict
    ) -> Any:
        # Any statement: a copy stuck outside its claim is still named by its session.
        self.session = _session_id(context["connection"])
        # Where a copy waits: the claim's statement (SQLite: the BEGIN awaiting the write lock).
        waits_here = self.table in sql or sql.lstrip().upper().startswith("BEGIN")
        if not waits_here:
            return execute(sql, params, many, context)
        with self.lock:
            self.claiming = sql
            self.returned = None
            if self.started is None:
                self.started = time.monotonic()
        gave_up = True
        try:
            result = execute(sql, params, many, context)
            gave_up = False
            return result
        finally:
            with self.lock:
                self.claiming = None
                self.returned = time.monotonic()
                self.gave_up = gave_up


@dataclass(frozen=True)
class _Sighting:
    """A copy's claim as the let-go found it."""

    started: float | None
    running: bool
    returned: float | None
    gave_up: bool


def _session_id(connection: BaseDatabaseWrapper) -> int | None:
    """The server's id of the connection (PostgreSQL pid, MySQL thread id), if it has one."""
    raw = connection.connection
    if connection.vendor == "postgresql":
        info = getattr(raw, "info", None)  # psycopg 3
        return int(info.backend_pid) if info is not None else int(raw.get_backend_pid())
    if connection.vendor == "mysql":
        return int(raw.thread_id())
    return None


def _waiting(using: str, watches: list[_Watch]) -> set[int]:
    """The indexes of the copies whose claim is waiting in the database now.

    PostgreSQL names a lock wait; MariaDB shows only a statement running, which
    is the wait while the original holds its claim; on SQLite, which waits in
    the client library, a claim started and not returned is all there is.
    """
    claiming = {i: w.session for i, w in enumerate(watches) if w.claiming is not None}
    connection = connections[using]
    if not claiming or connection.vendor not in {"postgresql", "mysql"}:
        return set(claiming)
    sessions = [s for s in claiming.values() if s is not None]
    if not sessions:
        return set()
    marks = ", ".join(["%s"] * len(sessions))
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT pid FROM pg_stat_activity "
                f"WHERE wait_event_type = 'Lock' AND pid IN ({marks})",
                sessions,
            )
        else:
            cursor.execute(
                f"SELECT id FROM {_process_list(connection)} "
                f"WHERE command = 'Query' AND id IN ({marks})",
                sessions,
            )
        found = {int(row[0]) for row in cursor.fetchall()}
    return {i for i, session in claiming.items() if session in found}


def _process_list(connection: BaseDatabaseWrapper) -> str:
    """The server's process list: MySQL 8 deprecates ``information_schema``'s, MariaDB keeps it."""
    if getattr(connection, "mysql_is_mariadb", True):
        return "information_schema.processlist"
    return "performance_schema.processlist"


@dataclass
class _Outcome:
    thread: threading.Thread | None = None
    response: HttpResponseBase | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


def _thread(
    target: Callable[[], HttpResponseBase], name: str, after: Callable[[], None]
) -> _Outcome:
    """A thread, not started yet, that runs ``target`` on database connections of its own."""
    outcome = _Outcome()

    def work() -> None:
        try:
            outcome.response = target()
        except BaseException as exc:  # re-raised in the test's thread
            outcome.error = exc
        finally:
            for connection in connections.all(initialized_only=True):
                connection.close()
            outcome.done.set()
            after()

    # A daemon: a request stuck past every bound (the test failed) cannot block exit.
    outcome.thread = threading.Thread(target=work, name=name, daemon=True)
    return outcome


@dataclass
class _Hold:
    """Where the original was held: in a transaction or not, on which session, for how long."""

    in_transaction: bool = False
    session: int | None = None
    ran_out: bool = False


@contextmanager
def _holding(
    signal: Signal,
    sender: Any,
    original: threading.Thread,
    using: str,
    events: tuple[threading.Event, threading.Event, threading.Event],
    timeout: float,
) -> Iterator[_Hold]:
    """Hold ``original`` at the first ``signal`` it sends (from ``sender``) until ``release``."""
    reached, settled, release = events
    held = _Hold()

    def hold(**kwargs: Any) -> None:
        if threading.current_thread() is not original or reached.is_set():
            return
        # Read in the original's own thread: its connection is this thread's.
        connection = connections[using]
        held.in_transaction = connection.in_atomic_block
        if connection.connection is not None:
            held.session = _session_id(connection)
        reached.set()
        settled.set()
        # Bounded, in case the test's thread died without letting go.
        held.ran_out = not release.wait(timeout)

    uid = f"django_idempotency.races.{id(hold)}"
    signal.connect(hold, sender=sender, weak=False, dispatch_uid=uid)
    try:
        yield held
    finally:
        signal.disconnect(sender=sender, dispatch_uid=uid)


def run(
    send: Callable[[], HttpResponseBase],
    count: int,
    *,
    hold_on: Signal,
    hold_sender: Any,
    hold_name: str,
    using: str,
    table: str,
    timeout: float,
) -> RaceRun:
    """Run ``send`` once as the original, held at ``hold_on``, and ``count`` times beside it.

    Raises :class:`NotHeld` when the original answers without reaching the
    hold, and ``AssertionError`` when a ``timeout`` runs out or a copy
    counted as waiting was not (:func:`_check_sightings`).
    """
    # Set when the original is held or has answered; when a duplicate answers.
    settled, changed = threading.Event(), threading.Event()
    reached, release = threading.Event(), threading.Event()
    original = _thread(send, "race-original", settled.set)
    lock = threading.Lock()
    watches = [_Watch(table, lock) for _ in range(count)]
    copies = [
        _thread(_watched(send, watch, using), f"race-duplicate-{index + 1}", changed.set)
        for index, watch in enumerate(watches)
    ]
    assert original.thread is not None
    seen = [False] * count
    sightings: list[_Sighting] = []
    let_go = 0.0
    late: str | None = None
    stuck = ""
    events = (reached, settled, release)
    with _holding(hold_on, hold_sender, original.thread, using, events, timeout) as held:
        try:
            original.thread.start()
            if not settled.wait(timeout):
                late = (
                    f"the original request neither reached {hold_name} nor answered "
                    f"within {timeout:g} s: pass a larger timeout="
                )
            elif not reached.is_set():
                _raise_from(original)
                assert original.response is not None
                raise NotHeld(original.response)
            else:
                for copy in copies:
                    assert copy.thread is not None
                    copy.thread.start()
                late = _until_all_arrived(
                    using, watches, copies, changed, timeout, seen, can_wait=held.in_transaction
                )
        finally:
            # Under the watches' lock: no claim starts or returns as the original goes.
            with lock:
                let_go = time.monotonic()
                sightings = [_sighting(watch) for watch in watches]
                release.set()
            # Joined even after a failure: no request may hold a transaction into teardown.
            started = [o for o in (original, *copies) if o.thread and o.thread.ident]
            unfinished = _join(started, timeout)
            if unfinished:
                sessions = {original.thread.name: held.session}
                sessions.update(
                    (copy.thread.name, watch.session)
                    for copy, watch in zip(copies, watches, strict=True)
                    if copy.thread is not None
                )
                stuck = _end_sessions(using, unfinished, sessions)
                # A request whose session was ended fails, closes its connections and ends.
                _join([o for o in started if o.thread and o.thread.name in unfinished], timeout)
    if late is not None:
        raise AssertionError(late + (f"; {stuck}" if unfinished else ""))
    if held.ran_out:
        raise AssertionError(
            f"the original was let go after {timeout:g} s on its own, before every "
            "duplicate had arrived: pass a larger timeout=, or fewer duplicates"
        )
    if unfinished:
        raise AssertionError(
            f"the original was let go, and not every request answered within {timeout:g} s "
            f"after: {stuck}"
        )
    _raise_from(original, *copies)
    assert original.response is not None
    waited = [False] * count
    if held.in_transaction:
        waited = _check_sightings(seen, sightings, watches, let_go)
    duplicates = []
    for index, copy in enumerate(copies, start=1):
        if copy.response is None:
            raise AssertionError(f"duplicate {index} ended without a response")
        duplicates.append(copy.response)
    return RaceRun(
        original=original.response,
        duplicates=duplicates,
        waited=waited,
        in_transaction=held.in_transaction,
    )


def _sighting(watch: _Watch) -> _Sighting:
    return _Sighting(
        started=watch.started,
        running=watch.claiming is not None,
        returned=watch.returned,
        gave_up=watch.gave_up,
    )


def _check_sightings(
    seen: list[bool], sightings: list[_Sighting], watches: list[_Watch], let_go: float
) -> list[bool]:
    """Which copies waited for the original; ``AssertionError`` if one seen waiting did not.

    One seen waiting must be in its claim when the original goes: one not yet
    in it met a committed original, one whose claim returned without error
    waited for nothing. A claim that raised gave up (``wait=0``, ``WAIT`` ran out).
    """
    waited = [False] * len(seen)
    wrong = []
    for index, (was_seen, sighting) in enumerate(zip(seen, sightings, strict=True)):
        if not was_seen:
            continue
        if sighting.running:
            waited[index] = True
        elif sighting.started is None:
            later = watches[index].started
            wrong.append(
                f"duplicate {index + 1} had not started its claim when the original was let "
                "go ("
                + (
                    f"it started {later - let_go:.3f} s after"
                    if later is not None
                    else "it never ran one"
                )
                + ")"
            )
        elif not sighting.gave_up:
            assert sighting.returned is not None
            wrong.append(
                f"duplicate {index + 1}'s claim statement had returned "
                f"{let_go - sighting.returned:.3f} s before the original was let go, "
                "without waiting for it"
            )
    if wrong:
        raise AssertionError(
            "duplicates counted as waiting in the database for the held original were not "
            "waiting when it was let go, so the race did not take place: " + "; ".join(wrong)
        )
    return waited


def _watched(
    send: Callable[[], HttpResponseBase], watch: _Watch, using: str
) -> Callable[[], HttpResponseBase]:
    def target() -> HttpResponseBase:
        # connections[using] is this thread's own: the wrapper sees this duplicate alone.
        with connections[using].execute_wrapper(watch):
            return send()

    return target


def _until_all_arrived(
    using: str,
    watches: list[_Watch],
    copies: list[_Outcome],
    changed: threading.Event,
    timeout: float,
    seen: list[bool],
    *,
    can_wait: bool,
) -> str | None:
    """Wait until every duplicate has answered or is seen waiting for the original.

    Marks copies seen waiting in ``seen``; returns what went wrong on timeout.
    With ``can_wait=False`` (nothing waits outside a transaction) all must answer.
    """
    deadline = time.monotonic() + timeout
    while True:
        for index in _waiting(using, watches) if can_wait else ():
            seen[index] = True
        pending = [
            index for index, copy in enumerate(copies) if not copy.done.is_set() and not seen[index]
        ]
        if not pending:
            return None
        if time.monotonic() >= deadline:
            doing = "; ".join(_doing(i, watches[i], can_wait) for i in pending)
            return (
                f"{len(pending)} of {len(copies)} duplicates neither answered nor were seen "
                f"waiting for the held original within {timeout:g} s ({doing})"
            )
        # Woken at once by an answer; otherwise the database is asked again.
        changed.wait(POLL_INTERVAL)
        changed.clear()


def _doing(index: int, watch: _Watch, can_wait: bool) -> str:
    """What a duplicate that has not arrived is doing, and what would let it arrive."""
    if watch.claiming is None:
        return (
            f"duplicate {index + 1} has no claim statement running: it is blocked outside "
            "the idempotency claim (a lock or an event in the view, a middleware, a "
            "connection pool), or needs longer: pass a larger timeout="
        )
    if not can_wait:
        return (
            f"duplicate {index + 1} is in its claim ({watch.claiming}) although the original "
            "was held outside a transaction, where nothing should wait for it: pass a larger "
            "timeout= if the database is slow"
        )
    return (
        f"duplicate {index + 1} is in its claim ({watch.claiming}) but the database does "
        "not show it waiting: pass a larger timeout=, or fewer duplicates"
    )


def _join(outcomes: list[_Outcome], timeout: float) -> list[str]:
    """Wait for every thread, ``timeout`` seconds in all; the names of those still running."""
    deadline = time.monotonic() + timeout
    return [
        outcome.thread.name
        for outcome in outcomes
        if outcome.thread and not outcome.done.wait(max(0.0, deadline - time.monotonic()))
    ]


def _end_sessions(using: str, names: list[str], sessions: dict[str, int | None]) -> str:
    """End the database sessions of threads still running; say what each was left holding.

    Left running, their locks would last into teardown; one blocked outside
    the database, or on SQLite, keeps its connection. Only the race's own
    sessions go: ids the server gave (:func:`_refuse_proxied`), still listed
    on this database when the ending statement runs.
    """
    connection = connections[using]
    said = []
    for name in names:
        session = sessions.get(name)
        if session is None or connection.vendor not in {"postgresql", "mysql"}:
            said.append(f"{name} is still running and keeps its database connection until it ends")
            continue
        try:
            ended = _end_session(connection, session)
        except DatabaseError as exc:
            said.append(
                f"{name} is still running and keeps its database session {session}, "
                f"which could not be ended ({exc})"
            )
            continue
        if ended:
            said.append(f"{name} was still running: its database session {session} was ended")
        else:
            said.append(
                f"{name} is still running; its database session {session} is no longer on "
                "this database, and was left alone"
            )
    return "; ".join(said)


def _end_session(connection: BaseDatabaseWrapper, session: int) -> bool:
    """End ``session`` if the server lists it on this connection's database; whether it did."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE pid = %s AND datname = current_database()",
                [session],
            )
            return any(ended for (ended,) in cursor.fetchall())
        # MySQL's ids are not reused while the server runs: one listed is the same session.
        cursor.execute(
            f"SELECT id FROM {_process_list(connection)} WHERE id = %s AND db = DATABASE()",
            [session],
        )
        if not cursor.fetchall():
            return False
        cursor.execute(f"KILL {int(session)}")
        return True


def _raise_from(*outcomes: _Outcome) -> None:
    for outcome in outcomes:
        if outcome.error is not None:
            raise outcome.error
