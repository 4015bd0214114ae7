"""Every statement a request makes on the key table, and how each backend waits.

(The batched purge of expired records lives in :mod:`django_idempotency.purge`.)

The unique constraint on (scope, key) is the only authority on who owns a
key. A claim inserts the record, takes over an expired one, or finds the
live record for the caller to answer from; a completed record is also
found by one read outside any transaction, for a replay. The wait for an
in-flight original is bounded by the database itself, never by a sleep
loop here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, IntegrityError, OperationalError, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created
from django.db.models import Field
from django.db.models.expressions import Col

from django_idempotency import clock
from django_idempotency.clock import DatabaseLater, DatabaseNow
from django_idempotency.info import IdempotencyInfo
from django_idempotency.models import IdempotencyKey

State = IdempotencyKey.State

# MySQL/MariaDB error numbers.
_ER_DUP_ENTRY = 1062
_ER_LOCK_WAIT_TIMEOUT = 1205
_ER_LOCK_DEADLOCK = 1213
_ER_NO_SUCH_TABLE = 1146
# PostgreSQL SQLSTATEs (psycopg 3 calls it ``sqlstate``, psycopg2 ``pgcode``).
_PG_LOCK_NOT_AVAILABLE = "55P03"
_PG_RETRYABLE = {"40001", "40P01"}  # serialization failure, deadlock
_PG_UNDEFINED_TABLE = "42P01"

# How often one request re-runs its claim after a deadlock or a lost race.
CLAIM_ATTEMPTS = 3


class Busy(OperationalError):
    """A bounded lock wait ran out: another transaction still holds the key.

    A :class:`~django.db.DatabaseError`, so a caller that does not translate
    it still sees a database error that says what happened.
    """


class DatabaseLocked(Busy):
    """SQLite: another connection held the database's one write lock past the wait.

    SQLite locks the whole database, not the key, so the holder may be a
    request for any key (see "SQLite" in docs/backends.rst).
    """


class Retry(OperationalError):
    """Start the claim over in a new transaction (or savepoint).

    ``transaction_lost`` is true when the database aborted the transaction
    to break a deadlock (MySQL rolls back the whole of it, savepoints and
    all), and false when only the claim's own view of the record was stale
    (a purge or a takeover raced it) and rolling back its savepoint is enough.
    """

    def __init__(self, message: str, *, transaction_lost: bool = True) -> None:
        super().__init__(message)
        self.transaction_lost = transaction_lost


@dataclass(frozen=True)
class StoredResponse:
    """What is kept of an answer: a response's status, headers and body, or a value as JSON."""

    status_code: int
    headers: list[list[str]]
    #: ``None``: too large or streaming, replayed without a body. A
    #: memoryview when read back through psycopg2.
    body: bytes | memoryview | None


@dataclass(frozen=True)
class Record:
    """A live record that another request claimed: what a duplicate is answered from."""

    id: int
    fingerprint: str
    completed: bool
    #: The stored answer of a completed record, else ``None``.
    response: StoredResponse | None
    owner_token: str
    locked_until: datetime | None
    created_at: datetime
    expires_at: datetime
    #: The database's clock when the record was read, in the same statement:
    #: what every decision about this record compares with, never the app
    #: host's clock.
    seen_at: datetime
    #: Lease mode's progress: how many owners the key has had, and the steps
    #: they recorded as done.
    attempt: int = 1
    checkpoints: dict[str, Any] = field(default_factory=dict)

    @property
    def held_until(self) -> datetime:
        """Until when an in-progress record is its owner's (its lease)."""
        return self.locked_until or self.expires_at

    @property
    def expired(self) -> bool:
        """Past its expiry by the database's clock when it was read."""
        return self.expires_at <= self.seen_at

    @property
    def held_for(self) -> timedelta:
        """How much of its lease an in-progress record had left, by the database's clock."""
        return self.held_until - self.seen_at

    @property
    def running_for(self) -> timedelta:
        """How long its current owner has held it, by the database's clock."""
        return self.seen_at - self.created_at

    def abandoned(self) -> bool:
        """In progress, and its lease ran out: its owner died (or outlived its lease)."""
        return not self.completed and self.owner_token != "" and self.expired


@dataclass(frozen=True)
class Claim:
    """What :func:`claim` found: the key is now this request's, or another's record stands.

    ``existing`` is ``None`` when the key was claimed (``record_id`` is the
    record to complete or release), else the live record to answer from.
    """

    record_id: int
    existing: Record | None = None
    #: Of a claimed key: 1, or the abandoned claim's attempt + 1 when it was
    #: taken over, with the checkpoints its owners recorded.
    attempt: int = 1
    checkpoints: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NewClaim:
    """What a request writes when it claims a key.

    Its times are durations from the database's clock when the statement
    that writes them runs (:mod:`django_idempotency.clock`), never instants
    of the app host's.
    """

    scope: str
    key: str
    fingerprint: str
    owner_token: str
    #: From the claim until its record expires.
    expires_in: timedelta
    #: Lease mode: from the claim until its lease runs out (``expires_in`` too).
    lease: timedelta | None = None

    @classmethod
    def of(
        cls,
        info: IdempotencyInfo,
        *,
        ttl: timedelta,
        token: str = "",
        lease: timedelta | None = None,
    ) -> NewClaim:
        """The claim of ``info``'s key: for ``ttl``, or held for ``lease``.

        A held lease expires with the lease, so that one index answers both
        "may this be taken over?" and "may this be purged?".
        """
        return cls(
            scope=info.scope,
            key=info.key,
            fingerprint=info.fingerprint,
            owner_token=token,
            expires_in=lease or ttl,
            lease=lease,
        )


def _columns() -> dict[str, str]:
    return {field.name: str(field.column) for field in IdempotencyKey._meta.concrete_fields}


#: Each statement's SQL, built once per (vendor, statement) rather than per
#: request: see "Performance" in docs/backends.rst.
_SQL: dict[tuple[str, Any], str] = {}


def _sql(connection: BaseDatabaseWrapper, name: Any, build: Callable[..., str]) -> str:
    if clock.is_pinned():
        return build(connection)  # a test's clock, which moves
    cache_key = (connection.vendor, name)
    sql = _SQL.get(cache_key)
    if sql is None:
        sql = _SQL[cache_key] = build(connection)
    return sql


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


def _claim_values(connection: BaseDatabaseWrapper) -> str:
    """A new claim's values in the order of ``_CLAIM_FIELDS``, then its first attempt.

    The parameters are ``_insert_params``; its times are the database's clock.
    """
    later = clock.later_sql(connection)
    return ", ".join(["%s"] * 5 + [clock.now_sql(connection), later, later, "1"])


def _insert_claim_into(connection: BaseDatabaseWrapper) -> str:
    """``INSERT INTO`` the key table, naming the columns :func:`_claim_values` fill."""
    quote = connection.ops.quote_name
    columns = _columns()
    names = [quote(columns[field]) for field in [*_CLAIM_FIELDS, "attempt"]]
    return f"INSERT INTO {quote(IdempotencyKey._meta.db_table)} ({', '.join(names)})"


def prepare_connection(using: str, wait: float) -> None:
    """Bound SQLite's wait before the transaction starts.

    SQLite takes its write lock at ``BEGIN IMMEDIATE`` (or the first write),
    so the busy timeout must already be right when ``atomic()`` opens. It is
    changed only when ``wait`` differs from the connection's ``timeout``
    option (with the defaults, 5 s both, never), and put back as soon as the
    claim is over (:func:`claiming` and :func:`claim` do), so the view's
    own statements wait as long as the connection was configured to.
    """
    connection = connections[using]
    if connection.vendor != "sqlite":
        return
    connection.ensure_connection()
    own = _sqlite_own_timeout(connection)
    target = max(1, round(wait * 1000))
    if target != own:
        _set_busy_timeout(connection, target)
        connection._idempotency_restore_busy_timeout = own  # type: ignore[attr-defined]


def _sqlite_own_timeout(connection: BaseDatabaseWrapper) -> int:
    """The busy timeout, in ms, that Django opened the connection with."""
    return round(connection.settings_dict.get("OPTIONS", {}).get("timeout", 5.0) * 1000)


def _set_busy_timeout(connection: BaseDatabaseWrapper, milliseconds: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"PRAGMA busy_timeout = {int(milliseconds)}")


def _restore_wait(connection: BaseDatabaseWrapper) -> None:
    """Give the connection back the busy timeout :func:`prepare_connection` changed."""
    own = getattr(connection, "_idempotency_restore_busy_timeout", None)
    if own is None:
        return
    connection._idempotency_restore_busy_timeout = None  # type: ignore[attr-defined]
    if connection.connection is not None:
        _set_busy_timeout(connection, own)


def _forget_connection_state(sender: Any, connection: BaseDatabaseWrapper, **kwargs: Any) -> None:
    """A new database connection starts with the server's settings, not ours.

    What this module changed on a connection is remembered on Django's
    wrapper, which outlives the connection (``CONN_MAX_AGE = 0`` closes it
    after every request); the raw connection's ``id()`` is no identity,
    since CPython hands the address of a closed connection to the next one.
    """
    connection._idempotency_restore_busy_timeout = None  # type: ignore[attr-defined]
    connection._idempotency_lock_wait = None  # type: ignore[attr-defined]


connection_created.connect(_forget_connection_state, dispatch_uid="django_idempotency.store")


T = TypeVar("T")


def retrying(
    attempt: Callable[[], T], gave_up: Callable[[], Exception], *, in_transaction: bool = False
) -> T:
    """Run ``attempt`` (a claim in a transaction or savepoint of its own) until it is not retried.

    The one place a claim starts over: after a deadlock, or after it saw a
    record as it was before a purge or a takeover. ``in_transaction`` says
    the attempt runs inside a transaction it did not open (the request's):
    a deadlock has then rolled that transaction back too, and starting over
    is not possible. When no attempt got through, raises what ``gave_up``
    returns: the caller's "in flight, retry later".
    """
    for _ in range(CLAIM_ATTEMPTS):
        try:
            return attempt()
        except Retry as retry:
            if retry.transaction_lost and in_transaction:
                break
    raise gave_up()


def reads_before_claiming(using: str) -> bool:
    """Whether a retry of finished work is looked for before the claim, outside a transaction.

    On PostgreSQL the claim that follows a miss is a plain ``INSERT`` that
    the server plans in a fraction of the full claim's time, which pays for
    the read: a new key costs about what it did, and a replay one round
    trip instead of three. On MariaDB/MySQL and SQLite the claim is a plain
    insert already, so the read would make every new key one round trip
    dearer, and new keys are most of the traffic: there the claim answers.
    """
    return connections[using].vendor == "postgresql"


def find_completed(using: str, scope: str, key: str, *, wait: float) -> Record | None:
    """The key's completed, live record, read in one indexed statement; ``None`` if there is none.

    A replay's answer without a transaction: a completed record is
    committed and stays as it is until it expires, so reading it outside
    one gives what a claim would find. Anything else (no record, one in
    progress, one expired) is left to :func:`claim`, which decides. Must
    run outside a transaction. SQLite's reader waits for a writer's commit
    at most ``wait`` seconds, as a claim would.
    """
    with claiming(using, wait):
        record = _read(connections[using], scope, key)
    if record is None or not record.completed or record.expired:
        return None
    return record


def claim(using: str, new: NewClaim, wait: float, *, take_over_abandoned: bool = True) -> Claim:
    """Claim the key, or find the live record that holds it.

    Must run inside ``transaction.atomic(using=using)``. A live record that
    is returned is committed and changes only when it expires (or, in
    lease mode, when its owner completes or releases it), so it is read
    without holding a lock: a replay writes nothing.

    An expired record is taken over in the same statement, except, with
    ``take_over_abandoned=False``, an abandoned claim (in progress, its
    lease run out): that is returned, for a recovery policy to decide on
    (:func:`take_over` then takes it, fenced by its owner's token). A claim
    taken over from the same request carries its attempt and checkpoints.

    Raises :class:`Busy` when the wait for an in-flight original runs out,
    :class:`Retry` when the claim must start over (see :func:`retrying`),
    and :class:`~django.core.exceptions.ImproperlyConfigured` when the table
    is missing.
    """
    connection = connections[using]
    try:
        with explained(using):
            found = _claim(connection, new, wait, take_over_abandoned)
    finally:
        _restore_wait(connection)
    if found is None:
        # The record changed between our statements (a purge or a takeover
        # racing us): a new transaction sees it as it is now.
        raise Retry("The idempotency record changed during the claim.", transaction_lost=False)
    return found


def _claim(
    connection: BaseDatabaseWrapper, new: NewClaim, wait: float, take_over_abandoned: bool
) -> Claim | None:
    claimed: Claim | Record | None
    if connection.vendor == "postgresql":
        claimed = _insert_postgresql(connection, new, wait)
        if claimed is None:
            claimed = _claim_postgresql(connection, new, wait, take_over_abandoned)
        if claimed is None:
            # We waited for an original that committed after this
            # statement's snapshot was taken: read it now.
            claimed = _read(connection, new.scope, new.key)
    elif connection.vendor == "mysql":
        claimed = _claim_mysql(connection, new, wait, take_over_abandoned)
    else:
        claimed = _claim_upsert(connection, new, take_over_abandoned)
        if claimed is None:
            claimed = _read(connection, new.scope, new.key)
    if isinstance(claimed, Claim):
        return claimed
    if claimed is None:
        return None  # gone, as after a purge
    if claimed.expired and not (not take_over_abandoned and claimed.abandoned()):
        # Seen as it was before another request took it over.
        return None
    return Claim(claimed.id, claimed)


@contextmanager
def claiming(using: str, wait: float) -> Iterator[None]:
    """Around a claim and the transaction it opens: bound the wait, explain the errors.

    SQLite waits at ``BEGIN IMMEDIATE``, before :func:`claim` runs, so its
    busy timeout is set first (:func:`prepare_connection`) and put back as
    soon as the block ends; an error at ``BEGIN`` means what it would mean
    in the claim (:func:`explained`).
    """
    prepare_connection(using, wait)
    try:
        with explained(using):
            yield
    finally:
        _restore_wait(connections[using])


def complete(
    using: str,
    record_id: int,
    response: StoredResponse,
    *,
    owner_token: str | None,
    ttl: timedelta,
    grace: timedelta | None = None,
) -> bool:
    """Store the response for ``ttl``; ``False`` if the claim is no longer ours (lease lost).

    With ``grace``, the expiry the claim set is kept if the claim is no
    older than that by the database's clock. Atomic mode does (1% of
    ``TTL``), so that the update writes no new value to an indexed column
    and PostgreSQL can make it a heap-only (HOT) update on the same page.
    """
    connection = connections[using]
    with_grace, with_token = grace is not None, owner_token is not None
    sql = _sql(
        connection,
        ("complete", with_grace, with_token),
        lambda c: _complete_sql(c, with_grace=with_grace, with_token=with_token),
    )
    # The fields' own conversions (jsonb on PostgreSQL, bytes on each driver),
    # without building and compiling an ORM query per request.
    params: list[Any] = [
        _STATE_COMPLETED,
        response.status_code,
        _HEADERS_FIELD.get_db_prep_save(response.headers, connection),
        _BODY_FIELD.get_db_prep_save(response.body, connection),
    ]
    if grace is not None:
        params.append(clock.seconds(connection, -grace))
    params.append(clock.seconds(connection, ttl))
    params.append(record_id)
    if owner_token is not None:
        params.append(owner_token)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount == 1


_STATE_COMPLETED = str(State.COMPLETED)
_HEADERS_FIELD: Field[Any, Any] = IdempotencyKey._meta.get_field("response_headers")  # type: ignore[assignment]
_BODY_FIELD: Field[Any, Any] = IdempotencyKey._meta.get_field("response_body")  # type: ignore[assignment]


def _complete_sql(connection: BaseDatabaseWrapper, *, with_grace: bool, with_token: bool) -> str:
    quote = connection.ops.quote_name
    columns = _columns()
    assigned = ["state", "status_code", "response_headers", "response_body"]
    assignments = [f"{quote(columns[name])} = %s" for name in assigned]
    assignments.insert(4, f"{quote(columns['locked_until'])} = NULL")
    expires, later = quote(columns["expires_at"]), clock.later_sql(connection)
    if with_grace:
        created = quote(columns["created_at"])
        later = f"CASE WHEN {created} > {later} THEN {expires} ELSE {later} END"
    assignments.append(f"{expires} = {later}")
    where = [f"{quote(IdempotencyKey._meta.pk.column)} = %s"]
    if with_token:
        where.append(f"{quote(columns['owner_token'])} = %s")
        where.append(f"{quote(columns['state'])} = '{State.IN_PROGRESS}'")
    return (
        f"UPDATE {quote(IdempotencyKey._meta.db_table)} SET {', '.join(assignments)} "
        f"WHERE {' AND '.join(where)}"
    )


def release(
    using: str,
    record_id: int,
    owner_token: str,
    *,
    keep_progress: bool = False,
    checkpoints: dict[str, Any] | None = None,
) -> bool:
    """Give an in-progress claim back so a retry can run; only its owner may.

    ``keep_progress`` keeps a claim that has checkpoints, with its attempt,
    as free to take at once (its token cleared, its lease over), so that
    the retry resumes from them instead of starting again; with
    ``checkpoints``, those in place of the ones recorded (some of which
    rolled back with the writes they recorded).
    """
    owned = _owned(using, record_id, owner_token).filter(state=State.IN_PROGRESS)
    if keep_progress:
        ended = DatabaseNow()
        changes: dict[str, Any] = {"owner_token": "", "locked_until": ended, "expires_at": ended}
        if checkpoints is not None:
            changes["checkpoints"] = checkpoints
        return owned.update(**changes) == 1
    rows, _ = owned.delete()
    return rows == 1


def take_over(using: str, abandoned: Record, new: NewClaim) -> Claim | None:
    """Take an abandoned claim over as its next attempt; ``None`` if another request did first.

    Fenced by the dead owner's token and its run-out lease, so that of two
    requests deciding on one abandoned claim only one takes it, and a slow
    owner that renewed its lease in the meantime keeps it.
    """
    taken = _still_abandoned(using, abandoned).update(
        owner_token=new.owner_token,
        attempt=abandoned.attempt + 1,
        created_at=DatabaseNow(),
        expires_at=DatabaseLater(new.expires_in),
        locked_until=None if new.lease is None else DatabaseLater(new.lease),
    )
    if taken != 1:
        return None
    return Claim(abandoned.id, attempt=abandoned.attempt + 1, checkpoints=abandoned.checkpoints)


def settle(using: str, abandoned: Record, response: StoredResponse, *, ttl: timedelta) -> bool:
    """Complete an abandoned claim with a recovery policy's response; ``False`` if it is not.

    Fenced as :func:`take_over` is, by the dead owner's token and its
    run-out lease: a slow owner that renewed its lease (a heartbeat, a
    checkpoint) while the policy asked keeps its claim, and its own result
    is the one stored.
    """
    settled = _still_abandoned(using, abandoned).update(
        state=State.COMPLETED,
        status_code=response.status_code,
        response_headers=response.headers,
        response_body=response.body,
        locked_until=None,
        expires_at=DatabaseLater(ttl),
    )
    return settled == 1


def _still_abandoned(using: str, abandoned: Record) -> Any:
    """The claim ``abandoned`` if it still is: its dead owner's, in progress, run out.

    Run out by the database's clock, in the statement that acts on it.

    The one fence of a takeover and of a recovery policy's settlement.
    """
    return _owned(using, abandoned.id, abandoned.owner_token).filter(
        state=State.IN_PROGRESS, expires_at__lte=DatabaseNow()
    )


def record_progress(
    using: str,
    record_id: int,
    *,
    owner_token: str | None,
    checkpoints: dict[str, Any] | None = None,
    lease: timedelta | None = None,
) -> bool:
    """Write an in-progress claim's checkpoints, and renew its lease for ``lease``.

    ``False`` when the claim is no longer this owner's (its lease was taken
    over, or it was released). Atomic mode passes no token: the claim is
    its own transaction's.
    """
    changes: dict[str, Any] = {}
    if checkpoints is not None:
        changes["checkpoints"] = checkpoints
    if lease is not None:
        changes.update(locked_until=DatabaseLater(lease), expires_at=DatabaseLater(lease))
    owned = _owned(using, record_id, owner_token).filter(state=State.IN_PROGRESS)
    return owned.update(**changes) == 1


def restore_progress(
    using: str, record_id: int, owner_token: str, checkpoints: dict[str, Any]
) -> bool:
    """Put an in-progress claim's checkpoints back to ``checkpoints``.

    For checkpoints recorded in a transaction that then rolled back: the
    writes they record are gone, so a retry must not skip them. Fenced by
    the token of the owner that recorded them (or the cleared token of its
    release), so a new owner's own progress is never touched.
    """
    owned = IdempotencyKey.objects.using(using).filter(
        pk=record_id, state=State.IN_PROGRESS, owner_token__in=[owner_token, ""]
    )
    return owned.update(checkpoints=checkpoints or None) == 1


def _owned(using: str, record_id: int, owner_token: str | None) -> Any:
    records = IdempotencyKey.objects.using(using).filter(pk=record_id)
    if owner_token is not None:
        records = records.filter(owner_token=owner_token)
    return records


@contextmanager
def lost_race(using: str) -> Iterator[None]:
    """Around a whole atomic-mode attempt: a MySQL/MariaDB 1213 in it is a :class:`Retry`.

    The server has rolled the transaction back, whichever statement got
    the error: a deadlock in the handler's statements or the stored
    response, or, on a Galera cluster, a write set that lost certification
    to another node's (reported by that statement or by ``COMMIT``).
    Nothing of the attempt committed, so it starts over as a new claim:
    a key another node completed is then replayed (the claim waits until
    this node has applied it), and a key still new runs again.
    """
    try:
        yield
    except Retry:
        raise
    except DatabaseError as exc:
        if connections[using].vendor != "mysql" or _errno(exc) != _ER_LOCK_DEADLOCK:
            raise
        if _other_transaction_open(using):
            # The 1213 may be another alias's, whose transaction the server
            # rolled back behind Django's back: starting over would let the
            # caller commit the rest of it. Its caller's atomic must see it.
            raise
        raise Retry(str(exc)) from exc


def _other_transaction_open(using: str) -> bool:
    """Whether a connection other than ``using``'s is inside a transaction."""
    return any(
        connection.alias != using and connection.in_atomic_block
        for connection in connections.all(initialized_only=True)
    )


def _errno(exc: DatabaseError) -> int | None:
    cause = exc.__cause__
    return cause.args[0] if cause is not None and cause.args else None


@contextmanager
def explained(using: str) -> Iterator[None]:
    """Raise what a database error on the key table means, where it is known.

    A lock wait that ran out becomes :class:`Busy` (:class:`DatabaseLocked`
    on SQLite), a deadlock :class:`Retry`, a missing table
    :class:`~django.core.exceptions.ImproperlyConfigured` saying to migrate;
    anything else propagates unchanged. Callers translate only what they
    know: a request answers 409, the purge command a ``CommandError``.
    """
    try:
        yield
    except (Busy, Retry):
        raise
    except DatabaseError as exc:
        meaning = _meaning(exc, connections[using])
        if meaning is None:
            raise
        raise meaning from exc


def _meaning(exc: DatabaseError, connection: BaseDatabaseWrapper) -> Exception | None:
    cause = exc.__cause__
    if connection.vendor == "postgresql":
        # psycopg 3 names the SQLSTATE ``sqlstate``; psycopg2 ``pgcode``.
        code = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
        if code == _PG_LOCK_NOT_AVAILABLE:
            return Busy(f"A lock wait ran out ({exc}).")
        if code in _PG_RETRYABLE:
            return Retry(str(exc))
        if code == _PG_UNDEFINED_TABLE:
            return missing_table()
    elif connection.vendor == "mysql":
        errno = _errno(exc)
        if errno == _ER_LOCK_WAIT_TIMEOUT:
            return Busy(f"A lock wait ran out ({exc}).")
        if errno == _ER_LOCK_DEADLOCK:
            return Retry(str(exc))
        if errno == _ER_NO_SUCH_TABLE:
            return missing_table()
    elif connection.vendor == "sqlite":
        message = str(exc)
        if "is locked" in message:
            return DatabaseLocked(
                "The SQLite database is locked: another connection holds its one write lock."
            )
        if "no such table" in message:
            return missing_table()
    return None


def missing_table() -> ImproperlyConfigured:
    return ImproperlyConfigured(
        f"The table {IdempotencyKey._meta.db_table!r} does not exist. "
        "Run 'python manage.py migrate django_idempotency' to create it."
    )


def _insert_params(connection: BaseDatabaseWrapper, new: NewClaim) -> list[Any]:
    return [
        new.scope,
        new.key,
        new.fingerprint,
        str(State.IN_PROGRESS),
        new.owner_token,
        clock.seconds(connection, new.expires_in),
        clock.seconds(connection, new.lease),
    ]


def _claim_upsert(
    connection: BaseDatabaseWrapper, new: NewClaim, take_over_abandoned: bool
) -> Claim | None:
    """SQLite: insert, or take over an expired record, in one statement.

    SQLite serialises writers on the whole database, so the wait happened
    at ``BEGIN`` (or at this statement) under the busy timeout.
    """
    sql = _sql(
        connection, ("claim", take_over_abandoned), lambda c: _upsert_sql(c, take_over_abandoned)
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, _insert_params(connection, new))
        row = cursor.fetchone()
    return None if row is None else _claimed(connection, row)


def _upsert_sql(connection: BaseDatabaseWrapper, take_over_abandoned: bool) -> str:
    quote = connection.ops.quote_name
    table = quote(IdempotencyKey._meta.db_table)
    columns = _columns()
    names = [quote(columns[field]) for field in _CLAIM_FIELDS]
    expires = quote(columns["expires_at"])
    created = quote(columns["created_at"])
    progress = _progress_assignments(connection, f"EXCLUDED.{quote(columns['fingerprint'])}")
    takeover = _takeover_assignments(connection, from_excluded=True)
    return (
        f"{_insert_claim_into(connection)} VALUES ({_claim_values(connection)}) "
        f"ON CONFLICT ({names[0]}, {names[1]}) DO UPDATE SET {progress}, {takeover} "
        f"WHERE {table}.{expires} <= EXCLUDED.{created}"
        f"{_unless_abandoned(connection, take_over_abandoned, table)} "
        f"RETURNING {_claimed_columns(connection)}"
    )


def _takeover_assignments(connection: BaseDatabaseWrapper, *, from_excluded: bool) -> str:
    """SET clause giving an expired record to a new claim: its values, no response.

    The values come from the upsert's ``EXCLUDED`` row, or else from
    parameters in the order of ``_insert_params(...)[2:]`` and the
    database's clock.
    """
    quote = connection.ops.quote_name
    columns = _columns()
    claim = [quote(columns[field]) for field in _CLAIM_FIELDS[2:]]
    later = clock.later_sql(connection)
    given = ["%s"] * 3 + [clock.now_sql(connection), later, later]
    values = [
        f"{name} = EXCLUDED.{name}" if from_excluded else f"{name} = {value}"
        for name, value in zip(claim, given, strict=True)
    ]
    return ", ".join(values + [f"{quote(columns[f])} = NULL" for f in _RESPONSE_FIELDS])


def _progress_assignments(connection: BaseDatabaseWrapper, fingerprint: str) -> str:
    """SET clause of a takeover's attempt and checkpoints: kept for the same request's claim.

    An abandoned claim of the same request is taken over as attempt n + 1
    with its checkpoints, a released one as attempt n with them (SPEC counts
    takeovers, not failures); an expired completed record, or another
    request's claim, starts again at 1 with none. It comes first in
    the SET clause: MySQL evaluates assignments left to right, so ``state``
    and ``fingerprint`` must still be the old record's here.
    """
    quote = connection.ops.quote_name
    columns = _columns()
    attempt, checkpoints = quote(columns["attempt"]), quote(columns["checkpoints"])
    same = (
        f"{quote(columns['state'])} = '{State.IN_PROGRESS}' "
        f"AND {quote(columns['fingerprint'])} = {fingerprint}"
    )
    # Only a takeover of an abandoned claim (its owner's token still set)
    # counts as an attempt; a claim its owner gave back keeps its number.
    owned = f"{quote(columns['owner_token'])} <> ''"
    return (
        f"{attempt} = CASE WHEN {same} "
        f"THEN {attempt} + CASE WHEN {owned} THEN 1 ELSE 0 END ELSE 1 END, "
        f"{checkpoints} = CASE WHEN {same} THEN {checkpoints} ELSE NULL END"
    )


def _unless_abandoned(
    connection: BaseDatabaseWrapper, take_over_abandoned: bool, table: str
) -> str:
    """A takeover's extra condition when abandoned claims are left to a recovery policy.

    A completed record past its expiry, or a claim its owner released (its
    token cleared), is free to take; an abandoned one is not.
    """
    if take_over_abandoned:
        return ""
    quote = connection.ops.quote_name
    columns = _columns()
    return (
        f" AND ({table}.{quote(columns['state'])} = '{State.COMPLETED}'"
        f" OR {table}.{quote(columns['owner_token'])} = '')"
    )


def _claimed_columns(connection: BaseDatabaseWrapper, table: str = "") -> str:
    """The id and progress columns, qualified by ``table`` if given (SQLite's RETURNING is not)."""
    quote = connection.ops.quote_name
    columns = _columns()
    names = [quote(IdempotencyKey._meta.pk.column), *(quote(columns[f]) for f in _PROGRESS)]
    return ", ".join(f"{table}.{name}" if table else name for name in names)


#: What a claim returns about the key it claimed, after its id.
_PROGRESS = ["attempt", "checkpoints"]


def _claimed(connection: BaseDatabaseWrapper, row: Any) -> Claim:
    """The claim of ``row``: the record id, then its attempt and checkpoints."""
    converted = _record_expressions(connection)[-len(_PROGRESS) :]
    attempt, checkpoints = (
        _convert(value, column, connection)
        for value, column in zip(row[1:], converted, strict=True)
    )
    return Claim(int(row[0]), attempt=int(attempt), checkpoints=checkpoints or {})


#: What the claim and the reads return about a live record, in this order.
_RECORD_COLUMNS = [
    "id",
    "fingerprint",
    "state",
    "status_code",
    "response_headers",
    "response_body",
    "owner_token",
    "locked_until",
    "created_at",
    "expires_at",
    *_PROGRESS,
]


def _record(connection: BaseDatabaseWrapper, row: Any) -> Record:
    """A row of ``_RECORD_COLUMNS`` and the database's clock, as the ORM would convert it.

    Converted without building a model. The columns past the state and the
    response are named as the record's fields.
    """
    expressions = _record_expressions(connection)
    values = {
        name: _convert(value, column, connection)
        for name, value, column in zip(_RECORD_COLUMNS, row[:-1], expressions, strict=True)
    }
    # The clock, converted as the expiry (a datetime column) is.
    expiry = expressions[_RECORD_COLUMNS.index("expires_at")]
    values["seen_at"] = _convert(row[-1], expiry, connection)
    completed = values.pop("state") == _STATE_COMPLETED
    response = StoredResponse(
        values.pop("status_code") or 200,
        values.pop("response_headers") or [],
        values.pop("response_body"),
    )
    values.update(
        id=int(values["id"]),
        attempt=int(values["attempt"]),
        checkpoints=values["checkpoints"] or {},
    )
    return Record(completed=completed, response=response if completed else None, **values)


_EXPRESSIONS: dict[str, list[tuple[Col, list[Any]]]] = {}


def _record_expressions(connection: BaseDatabaseWrapper) -> list[tuple[Col, list[Any]]]:
    """Each record column with the converters the ORM applies to it on this backend."""
    found = _EXPRESSIONS.get(connection.vendor)
    if found is None:
        found = []
        for name in _RECORD_COLUMNS:
            field = IdempotencyKey._meta.get_field(name)
            assert isinstance(field, Field)
            column = Col(IdempotencyKey._meta.db_table, field)
            converters = connection.ops.get_db_converters(column)
            converters += field.get_db_converters(connection)
            found.append((column, converters))
        _EXPRESSIONS[connection.vendor] = found
    return found


def _convert(value: Any, column: tuple[Col, list[Any]], connection: BaseDatabaseWrapper) -> Any:
    expression, converters = column
    for converter in converters:
        value = converter(value, expression, connection)
    return value


def _record_select_sql(connection: BaseDatabaseWrapper, *, lock: str = "") -> str:
    quote = connection.ops.quote_name
    columns = _columns()
    return (
        f"SELECT {', '.join(quote(columns[name]) for name in _RECORD_COLUMNS)}, "
        f"{clock.now_sql(connection)} FROM {quote(IdempotencyKey._meta.db_table)} "
        f"WHERE {quote(columns['scope'])} = %s AND {quote(columns['key'])} = %s{lock}"
    )


def _insert_postgresql(connection: BaseDatabaseWrapper, new: NewClaim, wait: float) -> Claim | None:
    """Claim a key nobody holds, in a statement PostgreSQL plans in a fraction of the full one.

    The common case: a new key. ``None`` when the key has a record (or had
    one we waited for); :func:`_claim_postgresql` then decides, in the
    same transaction, between a takeover and the live record. The wait for
    an uncommitted original is bounded here too, and ``lock_timeout`` is
    put back by the same statement either way.
    """
    sql = _sql(connection, "insert", _postgresql_insert_sql)
    params = [_postgresql_lock_timeout(wait), *_insert_params(connection, new)]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        record_id = cursor.fetchone()[0]
    return None if record_id is None else Claim(int(record_id))


def _postgresql_insert_sql(connection: BaseDatabaseWrapper) -> str:
    pk = connection.ops.quote_name(IdempotencyKey._meta.pk.column)
    return (
        f"{_PG_BOUNDED_WAIT}{_postgresql_inserted(connection, pk)} "
        f"SELECT inserted.{pk}, {_PG_RESTORED_WAIT} FROM wait LEFT JOIN inserted ON true"
    )


#: The claim statements' first CTE: the view's ``lock_timeout``, and the
#: claim's bound (the first parameter) applied for the rest of the statement.
_PG_BOUNDED_WAIT = (
    "WITH wait AS (SELECT current_setting('lock_timeout') AS previous, "
    "set_config('lock_timeout', %s, true) AS applied), "
)
#: Their last column: the view's ``lock_timeout`` put back, once the insert
#: (and any wait for an uncommitted original) is over.
_PG_RESTORED_WAIT = "set_config('lock_timeout', wait.previous, true)"


def _postgresql_lock_timeout(wait: float) -> str:
    return f"{max(1, round(wait * 1000))}ms"


def _postgresql_inserted(connection: BaseDatabaseWrapper, returned: str) -> str:
    """The CTE ``inserted``: the new claim's row, unless the key has one (then nothing)."""
    quote = connection.ops.quote_name
    columns = _columns()
    return (
        f"inserted AS ({_insert_claim_into(connection)} "
        f"SELECT {_claim_values(connection)} FROM wait "
        f"ON CONFLICT ({quote(columns['scope'])}, {quote(columns['key'])}) "
        f"DO NOTHING RETURNING {returned})"
    )


def _claim_postgresql(
    connection: BaseDatabaseWrapper, new: NewClaim, wait: float, take_over_abandoned: bool
) -> Claim | Record | None:
    """Claim, take over an expired record, or read the live one, in one statement.

    ``INSERT ... ON CONFLICT DO NOTHING`` waits for an uncommitted original
    (bounded by ``lock_timeout``, set inside the statement and, when the key
    is claimed, put back to the view's own value so that its statements keep
    theirs) and locks nothing on conflict. A conditional ``UPDATE`` takes
    over an expired record. Otherwise the live record comes back in the same
    round trip, and a replay writes nothing, so its commit needs no disk
    flush. The record is ``None`` only when the original committed after
    this statement's snapshot was taken.

    A claim that starts over does so in a new transaction or savepoint,
    whose rollback undoes the bounded ``lock_timeout``: so the value the
    statement finds is always the view's own.
    """
    sql = _sql(
        connection,
        ("claim", take_over_abandoned),
        lambda c: _postgresql_claim_sql(c, take_over_abandoned),
    )
    params = _postgresql_claim_params(connection, new, wait)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    mine, values = row[0], row[1:-2]
    if mine is None:
        return None
    if mine:
        return _claimed(connection, [values[0], *values[-len(_PROGRESS) :]])
    return _record(connection, [*values, row[-2]])


def _postgresql_claim_params(
    connection: BaseDatabaseWrapper, new: NewClaim, wait: float
) -> list[Any]:
    insert = _insert_params(connection, new)
    return [
        _postgresql_lock_timeout(wait),
        *insert,
        new.fingerprint,
        new.fingerprint,
        *insert[2:],
        new.scope,
        new.key,
        new.scope,
        new.key,
    ]


def _postgresql_claim_sql(connection: BaseDatabaseWrapper, take_over_abandoned: bool) -> str:
    quote = connection.ops.quote_name
    table = quote(IdempotencyKey._meta.db_table)
    columns = _columns()
    names = [quote(columns[field]) for field in _CLAIM_FIELDS]
    scope, key = names[0], names[1]
    expires = quote(columns["expires_at"])
    now = clock.now_sql(connection)
    pk = quote(IdempotencyKey._meta.pk.column)
    progress = [quote(columns[name]) for name in _PROGRESS]
    record = ", ".join(f"{table}.{quote(columns[name])}" for name in _RECORD_COLUMNS[1:])
    # A claimed key's row: its id, nothing of a record, then its progress.
    nulls = ", ".join(["NULL"] * (len(_RECORD_COLUMNS) - 1 - len(_PROGRESS)))
    claimed_progress = ", ".join(f"claimed.{name}" for name in progress)
    found_columns = ", ".join(["mine", *(f"c{i}" for i in range(len(_RECORD_COLUMNS)))])
    returned = ", ".join([pk, *progress])
    return (
        f"{_PG_BOUNDED_WAIT}{_postgresql_inserted(connection, returned)}, "
        f"taken AS (UPDATE {table} SET {_progress_assignments(connection, '%s')}, "
        f"{_takeover_assignments(connection, from_excluded=False)} "
        f"WHERE {scope} = %s AND {key} = %s AND {expires} <= {now}"
        f"{_unless_abandoned(connection, take_over_abandoned, table)} "
        "AND NOT EXISTS (SELECT 1 FROM inserted) "
        f"RETURNING {_claimed_columns(connection, table)}), "
        f"claimed AS (SELECT {returned} FROM inserted UNION ALL SELECT {returned} FROM taken), "
        f"found ({found_columns}) AS (SELECT true, claimed.{pk}, {nulls}, {claimed_progress} "
        f"FROM claimed UNION ALL SELECT false, {table}.{pk}, {record} FROM {table} "
        f"WHERE {scope} = %s AND {key} = %s AND NOT EXISTS (SELECT 1 FROM claimed)) "
        # Always exactly one row, so the view's lock_timeout is always put back:
        # also when the claim found another's record inside the view's transaction.
        # With the database's clock, which decides about the record found.
        f"SELECT found.*, {now}, {_PG_RESTORED_WAIT} FROM wait LEFT JOIN found ON true"
    )


def _read(connection: BaseDatabaseWrapper, scope: str, key: str) -> Record | None:
    sql = _sql(connection, "read", _record_select_sql)
    with connection.cursor() as cursor:
        cursor.execute(sql, [scope, key])
        row = cursor.fetchone()
    return None if row is None else _record(connection, row)


def _mysql_wait_prefix(connection: BaseDatabaseWrapper, wait: float) -> str:
    """Bound InnoDB's row-lock wait for one statement (MariaDB) or the session (MySQL).

    On a Galera node the statement also waits until the node has applied
    what the cluster committed before it (see :func:`galera_sync_wait`).
    """
    if getattr(connection, "mysql_is_mariadb", False):
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

    A node applies what other nodes committed a moment later, so a claim
    could find no record (or an in-progress one) for an original that has
    already answered. With the INSERT bit, the claim's ``INSERT`` first
    waits until the node has applied everything committed before it; the
    READ bit would not do, since MariaDB makes no causal wait inside an
    open transaction, and the claim opens one. The session's own bits are
    kept. Asked once per connection wrapper, the first time it claims:
    like the server version Django reads once, whether a configured
    server is a Galera node does not change between its connections, so
    a plain server pays one statement per process thread, not per request.
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


def _claim_mysql(
    connection: BaseDatabaseWrapper, new: NewClaim, wait: float, take_over_abandoned: bool
) -> Claim | Record | None:
    """MySQL/MariaDB: insert; on a duplicate, read under a shared lock.

    A failed INSERT rolls back only itself in InnoDB, so no savepoint is
    needed around it. The duplicate read uses a shared lock, not FOR UPDATE:
    the failed INSERT already holds a shared lock on the row, and many
    duplicates upgrading it to exclusive at once would deadlock.
    """
    prefix = _mysql_wait_prefix(connection, wait)
    with connection.cursor() as cursor:
        try:
            cursor.execute(
                prefix + _sql(connection, "claim", _mysql_insert_sql),
                _insert_params(connection, new),
            )
            return Claim(int(cursor.lastrowid))
        except IntegrityError as exc:
            if exc.__cause__ is None or exc.__cause__.args[0] != _ER_DUP_ENTRY:
                raise
    with connection.cursor() as cursor:
        cursor.execute(
            prefix + _sql(connection, "shared read", _mysql_read_sql), [new.scope, new.key]
        )
        row = cursor.fetchone()
    if row is None:
        return None
    record = _record(connection, row)
    if not record.expired:
        return record
    if not take_over_abandoned and record.abandoned():
        return record  # for the recovery policy to decide on
    return _take_over_mysql(connection, record.id, new, prefix)


def _mysql_insert_sql(connection: BaseDatabaseWrapper) -> str:
    return f"{_insert_claim_into(connection)} VALUES ({_claim_values(connection)})"


def _mysql_read_sql(connection: BaseDatabaseWrapper) -> str:
    return _record_select_sql(connection, lock=" LOCK IN SHARE MODE")


def _take_over_mysql(
    connection: BaseDatabaseWrapper, record_id: int, new: NewClaim, prefix: str
) -> Claim | None:
    quote = connection.ops.quote_name
    table = quote(IdempotencyKey._meta.db_table)
    columns = _columns()
    progress = _progress_assignments(connection, "%s")
    assignments = _takeover_assignments(connection, from_excluded=False)
    pk = quote(IdempotencyKey._meta.pk.column)
    expires = quote(columns["expires_at"])
    params = [new.fingerprint, new.fingerprint, *_insert_params(connection, new)[2:]]
    with connection.cursor() as cursor:
        cursor.execute(
            f"{prefix}UPDATE {table} SET {progress}, {assignments} "
            f"WHERE {pk} = %s AND {expires} <= {clock.now_sql(connection)}",
            [*params, record_id],
        )
        if cursor.rowcount != 1:
            return None
        # No RETURNING on MySQL: read back what the update carried over.
        cursor.execute(
            f"SELECT {_claimed_columns(connection, table)} FROM {table} WHERE {pk} = %s",
            [record_id],
        )
        return _claimed(connection, cursor.fetchone())
