"""Run a request held at a known point while copies of it run in other threads.

The machinery behind :func:`django_idempotency.testing.race_duplicates`: it
decides nothing about what the answers should be. The original runs in a
thread until it sends a signal (by default ``key_claimed``, with its key
claimed and its handler about to run) and is held there; the copies start
and each is watched until it has either answered or is seen waiting in the
database for the original; then the original is let go. Every thread uses,
and closes, its own database connections and its own test client.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.sqlite3.creation import DatabaseCreation
from django.dispatch import Signal
from django.http import HttpResponseBase

# How often the test's thread looks again at the copies while the original is
# held: each look is one statement on a server database.
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


def refuse_untestable(using: str) -> None:
    """Raise :class:`RaceSetupError` where threads could not race the original.

    Inside the transaction of a ``TestCase`` every other connection would
    wait for the test's own uncommitted rows, and the copies for a claim the
    test's transaction holds: they would deadlock on the row lock, not race.
    An in-memory SQLite database is either private to one connection, or,
    as Django's test runner makes it, a shared cache whose locks answer
    "table is locked" at once instead of waiting.
    """
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


@dataclass
class _Watch:
    """What one copy's thread is doing, as its connection's statements show it."""

    table: str
    claiming: str | None = None
    session: int | None = None

    def __call__(
        self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: dict
    ) -> Any:
        # The claim's statement (SQLite: the BEGIN that waits for the write
        # lock) is marked while it runs: that is where a copy waits.
        waits_here = self.table in sql or sql.lstrip().upper().startswith("BEGIN")
        if waits_here:
            self.session = _session_id(context["connection"])
            self.claiming = sql
        try:
            return execute(sql, params, many, context)
        finally:
            if waits_here:
                self.claiming = None


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

    PostgreSQL names the wait (a lock). MariaDB lists a claim's insert
    waiting for a row lock only as a statement still running, which, while
    the original holds its claim, is the wait. SQLite waits inside the
    client library: a claim statement that has started and not returned
    is all there is to see.
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
                "SELECT id FROM information_schema.processlist "
                f"WHERE command = 'Query' AND id IN ({marks})",
                sessions,
            )
        found = {int(row[0]) for row in cursor.fetchall()}
    return {i for i, session in claiming.items() if session in found}


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

    # A daemon, so that a request stuck past every bound cannot keep the
    # test run from exiting; the test has failed by then.
    outcome.thread = threading.Thread(target=work, name=name, daemon=True)
    return outcome


@dataclass
class _Hold:
    """Where the original was held: whether it was inside a transaction, and for how long."""

    in_transaction: bool = False
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
    """Hold ``original`` the first time it sends ``signal`` (from ``sender``), until released.

    ``events`` are (reached, settled, release): the hold sets the first two
    (the original's answer sets ``settled`` too) and waits for the third.
    """
    reached, settled, release = events
    held = _Hold()

    def hold(**kwargs: Any) -> None:
        if threading.current_thread() is not original or reached.is_set():
            return
        # Read in the original's own thread: its connection is this thread's.
        held.in_transaction = connections[using].in_atomic_block
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
    hold, and ``AssertionError`` when a bound of ``timeout`` seconds runs out.
    """
    # Set when the original is held or has answered; when a duplicate answers.
    settled, changed = threading.Event(), threading.Event()
    reached, release = threading.Event(), threading.Event()
    original = _thread(send, "race-original", settled.set)
    watches = [_Watch(table) for _ in range(count)]
    copies = [
        _thread(_watched(send, watch, using), f"race-duplicate-{index + 1}", changed.set)
        for index, watch in enumerate(watches)
    ]
    assert original.thread is not None
    waited = [False] * count
    events = (reached, settled, release)
    with _holding(hold_on, hold_sender, original.thread, using, events, timeout) as held:
        try:
            original.thread.start()
            if not settled.wait(timeout):
                raise AssertionError(
                    f"the original request neither reached {hold_name} nor answered "
                    f"within {timeout:g} s"
                )
            if not reached.is_set():
                _raise_from(original)
                assert original.response is not None
                raise NotHeld(original.response)
            for copy in copies:
                assert copy.thread is not None
                copy.thread.start()
            waited = _until_all_arrived(
                using, watches, copies, changed, timeout, can_wait=held.in_transaction
            )
        finally:
            release.set()
            # Joined even when the race failed, so that no request is left
            # holding a transaction when the test's teardown empties the tables.
            started = [o for o in (original, *copies) if o.thread and o.thread.ident]
            unfinished = _join(started, timeout)
    if held.ran_out:
        raise AssertionError(
            f"the original was let go after {timeout:g} s on its own, before every "
            "duplicate had arrived: raise timeout="
        )
    if unfinished:
        raise AssertionError(
            f"{', '.join(unfinished)} did not answer within {timeout:g} s of the original "
            "being let go"
        )
    _raise_from(original, *copies)
    assert original.response is not None
    return RaceRun(
        original=original.response,
        duplicates=[copy.response for copy in copies if copy.response is not None],
        waited=waited,
    )


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
    *,
    can_wait: bool,
) -> list[bool]:
    """Wait until every duplicate has answered or is waiting for the original; who waited.

    Nothing waits in the database for an original held outside a
    transaction (lease mode, an unprotected view): ``can_wait=False``, and
    every duplicate must answer.
    """
    deadline = time.monotonic() + timeout
    waited = [False] * len(watches)
    while True:
        for index in _waiting(using, watches) if can_wait else ():
            waited[index] = True
        pending = [
            index
            for index, copy in enumerate(copies)
            if not copy.done.is_set() and not waited[index]
        ]
        if not pending:
            return waited
        if time.monotonic() >= deadline:
            doing = "; ".join(
                f"duplicate {i + 1}: " + (watches[i].claiming or "no claim statement running")
                for i in pending
            )
            raise AssertionError(
                f"{len(pending)} of {len(copies)} duplicates neither answered nor were seen "
                f"waiting for the held original within {timeout:g} s ({doing})"
            )
        # Woken at once by an answer; otherwise the database is asked again.
        changed.wait(POLL_INTERVAL)
        changed.clear()


def _join(outcomes: list[_Outcome], timeout: float) -> list[str]:
    """Wait for every thread, ``timeout`` seconds in all; the names of those still running."""
    deadline = time.monotonic() + timeout
    return [
        outcome.thread.name
        for outcome in outcomes
        if outcome.thread and not outcome.done.wait(max(0.0, deadline - time.monotonic()))
    ]


def _raise_from(*outcomes: _Outcome) -> None:
    for outcome in outcomes:
        if outcome.error is not None:
            raise outcome.error
