"""What every backend shares: the records, the key table's columns and standard SQL.

A backend says how one database claims a key, bounds the wait and names its errors;
:mod:`django_idempotency.store`, its only caller, decides.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, OperationalError
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Field
from django.db.models.expressions import Col

from django_idempotency import clock, leases
from django_idempotency.info import IdempotencyInfo
from django_idempotency.models import IdempotencyKey

State = IdempotencyKey.State
Connection = BaseDatabaseWrapper


class Busy(OperationalError):
    """A bounded lock wait ran out: another transaction still holds the key."""


class DatabaseLocked(Busy):
    """SQLite: its one write lock was held past the wait, by a request for any key."""


class Retry(OperationalError):
    """Start the claim over.

    ``transaction_lost``: the database aborted the whole transaction (a MySQL deadlock), not
    only the claim's savepoint (a stale view of the record).
    """

    def __init__(self, message: str, *, transaction_lost: bool = True) -> None:
        super().__init__(message)
        self.transaction_lost = transaction_lost


@dataclass(frozen=True)
class StoredResponse:
    """What is kept of an answer: a response's status, headers and body, or a value as JSON."""

    status_code: int
    headers: list[list[str]]
    #: ``None``: too large or streaming, replayed without one. A memoryview from psycopg2.
    body: bytes | memoryview | None


@dataclass(frozen=True)
class Record:
    """A live record that another request claimed: what a duplicate is answered from."""

    id: int
    fingerprint: str
    completed: bool
    response: StoredResponse | None
    owner_token: str = field(repr=False)
    created_at: datetime
    expires_at: datetime
    #: The database's clock, read in the same statement: every decision about this
    #: record compares with it, never with the app host's clock.
    seen_at: datetime
    #: Lease mode: how many owners the key has had, and the steps they recorded done.
    attempt: int = 1
    checkpoints: dict[str, Any] = field(default_factory=dict)
    #: Lease mode: until when the purge keeps it in progress (``None``: atomic mode).
    retained_until: datetime | None = None

    @property
    def expired(self) -> bool:
        """Past its expiry by the database's clock when it was read."""
        return leases.expired(self.expires_at, self.seen_at)

    @property
    def held_for(self) -> timedelta:
        """How much of its lease an in-progress record had left, by the database's clock."""
        return self.expires_at - self.seen_at

    @property
    def running_for(self) -> timedelta:
        """How long its current owner has held it, by the database's clock."""
        return self.seen_at - self.created_at

    def abandoned(self) -> bool:
        """In progress, and its lease ran out: its owner died (or outlived its lease)."""
        state = leases.state_of(self.completed, self.owner_token, self.expires_at, self.seen_at)
        return state == leases.ABANDONED

    def free_to_take(self, fingerprint: str, take_over_abandoned: bool) -> bool:
        """Whether a claim of ``fingerprint`` takes this record over: :func:`takeover_condition`."""
        if not self.expired:
            return False
        if not take_over_abandoned and self.abandoned():
            return False
        return not self.bound_to_other_work(fingerprint)

    def bound_to_other_work(self, fingerprint: str) -> bool:
        """Bound to work other than ``fingerprint``'s: not to be taken over by it.

        A claim left with checkpoints stays bound to its request while the purge retains it:
        another fingerprint gets 422 (SPEC 4.3). :func:`unless_bound` is the rule in SQL.
        """
        state = leases.state_of(self.completed, self.owner_token, self.expires_at, self.seen_at)
        return (
            state in (leases.RELEASED, leases.ABANDONED)
            and self.fingerprint != fingerprint
            and leases.carries_checkpoints(self.checkpoints)
            and leases.retained(self.retained_until, self.seen_at)
        )


@dataclass(frozen=True)
class Claim:
    """What :func:`claim` found: the key claimed (``existing`` is ``None``), or another's record."""

    record_id: int
    existing: Record | None = None
    #: 1, or an abandoned claim's attempt + 1 with its checkpoints when taken over.
    attempt: int = 1
    checkpoints: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NewClaim:
    """What a request writes when it claims a key.

    Times are durations from the database's clock in the writing statement, never app host
    instants.
    """

    scope: str
    # Never in a repr: an error report shows the locals of the frames it passes.
    key: str = field(repr=False)
    fingerprint: str
    owner_token: str = field(repr=False)
    #: From the claim until its record expires.
    expires_in: timedelta
    #: Lease mode: from the claim until its lease runs out (``expires_in`` too).
    lease: timedelta | None = None
    #: Lease mode: until the purge may delete it in progress: lease end plus TTL.
    retained_for: timedelta | None = None

    @classmethod
    def of(
        cls,
        info: IdempotencyInfo,
        *,
        ttl: timedelta,
        token: str = leases.NO_OWNER,
        lease: timedelta | None = None,
    ) -> NewClaim:
        """The claim of ``info``'s key: for ``ttl``, or held for ``lease``.

        A lease's claim is retained ``ttl`` past it, so that a claim left in progress keeps
        its progress.
        """
        new = object.__new__(cls)
        # What the generated __init__ sets, without its frame: every request makes one.
        new.__dict__.update(
            scope=info.scope,
            key=info.key,
            fingerprint=info.fingerprint,
            owner_token=token,
            expires_in=lease or ttl,
            lease=lease,
            retained_for=lease + ttl if lease else None,
        )
        return new


_COLUMNS = MappingProxyType(
    {field.name: str(field.column) for field in IdempotencyKey._meta.concrete_fields}
)


def column_names() -> Mapping[str, str]:
    return _COLUMNS


def quoted_table(connection: BaseDatabaseWrapper) -> str:
    return connection.ops.quote_name(IdempotencyKey._meta.db_table)


def key_columns(connection: BaseDatabaseWrapper) -> tuple[str, str]:
    quote = connection.ops.quote_name
    return quote(_COLUMNS["scope"]), quote(_COLUMNS["key"])


#: Each statement's SQL by (vendor, name), built once (docs/backends.rst,
#: "Performance"). Emptied when a test moves the clock.
STATEMENTS: dict[Any, str] = clock.sql_cache()


def cached_sql(connection: BaseDatabaseWrapper, name: Any, build: Callable[..., str]) -> str:
    sql = STATEMENTS.get((connection.vendor, name))
    if sql is None:
        sql = build(connection)
        if not clock.is_pinned():  # a test's clock, which moves
            STATEMENTS[(connection.vendor, name)] = sql
    return sql


CLAIM_FIELDS = [
    "scope",
    "key",
    "fingerprint",
    "state",
    "owner_token",
    "created_at",
    "expires_at",
    "locked_until",
    "retained_until",
]
RESPONSE_FIELDS = ["status_code", "response_headers", "response_body"]


def claim_values(connection: BaseDatabaseWrapper) -> str:
    """A new claim's values in ``CLAIM_FIELDS`` order, then attempt 1.

    Parameters from ``insert_params``; times by the database's clock.
    """
    later = clock.later_sql(connection)
    return ", ".join(["%s"] * 5 + [clock.now_sql(connection), later, later, later, "1"])


def insert_claim_into(connection: BaseDatabaseWrapper) -> str:
    quote = connection.ops.quote_name
    columns = column_names()
    names = [quote(columns[field]) for field in [*CLAIM_FIELDS, "attempt"]]
    return f"INSERT INTO {quoted_table(connection)} ({', '.join(names)})"


STATE_COMPLETED = str(State.COMPLETED)
HEADERS_FIELD: Field[Any, Any] = IdempotencyKey._meta.get_field("response_headers")  # type: ignore[assignment]
BODY_FIELD: Field[Any, Any] = IdempotencyKey._meta.get_field("response_body")  # type: ignore[assignment]


def complete_sql(connection: BaseDatabaseWrapper, fence: str, *, with_grace: bool) -> str:
    """The one statement that completes a key; ``with_grace``: see ``store.complete``."""
    expires, later = column_names()["expires_at"], clock.later_sql(connection)
    if with_grace:
        quote = connection.ops.quote_name
        created, expires = quote(column_names()["created_at"]), quote(expires)
        later = f"CASE WHEN {created} > {later} THEN {expires} ELSE {later} END"
    return update_sql(
        connection,
        fence,
        state="%s",
        status_code="%s",
        response_headers="%s",
        response_body="%s",
        locked_until="NULL",
        expires_at=later,
    )


#: Fences: whose a claim must still be, checked in the writing statement. Parameters end
#: with the record's id, then (not ``OWN_TRANSACTION``) a token.
#: Atomic mode: the claim is the writer's own transaction's.
OWN_TRANSACTION = "own transaction"
#: Lease mode: still this owner's (not taken over, released or completed).
OWNER = "owner"
#: A takeover or settlement: still its dead owner's, its lease run out by the database's clock.
ABANDONED = "abandoned"
#: This owner's, or released by it: its checkpoints.
OWNER_OR_RELEASED = "owner or released"
#: A completed refusal (SPEC 4.6), still its owner's as an operator read it.
REFUSED = "refused"
#: The lowest refusal status (a view's 500, a function's 507); no stored result is a 5xx.
REFUSAL_STATUS = 500


def fenced(connection: BaseDatabaseWrapper, fence: str) -> str:
    """The ``WHERE`` clause of a write to one in-progress claim (or refusal), behind ``fence``."""
    quote = connection.ops.quote_name
    columns = column_names()
    token = quote(columns["owner_token"])
    state = State.COMPLETED if fence == REFUSED else State.IN_PROGRESS
    where = [
        f"{quote(IdempotencyKey._meta.pk.column)} = %s",
        f"{quote(columns['state'])} = '{state}'",
    ]
    if fence in (OWNER, ABANDONED, REFUSED):
        where.append(f"{token} = %s")
    if fence == REFUSED:
        where.append(f"{quote(columns['status_code'])} >= {REFUSAL_STATUS}")
    if fence == ABANDONED:
        where.append(leases.sql(leases.ABANDONED, connection))
    if fence == OWNER_OR_RELEASED:
        where.append(f"{token} IN (%s, '{leases.NO_OWNER}')")
    return " AND ".join(where)


def update_sql(connection: BaseDatabaseWrapper, fence: str, **assigned: str) -> str:
    quote = connection.ops.quote_name
    columns = column_names()
    assignments = ", ".join(f"{quote(columns[name])} = {sql}" for name, sql in assigned.items())
    return f"UPDATE {quoted_table(connection)} SET {assignments} WHERE {fenced(connection, fence)}"


def delete_sql(connection: BaseDatabaseWrapper, fence: str) -> str:
    table = connection.ops.quote_name(IdempotencyKey._meta.db_table)
    return f"DELETE FROM {table} WHERE {fenced(connection, fence)}"


CHECKPOINTS_FIELD: Field[Any, Any] = IdempotencyKey._meta.get_field("checkpoints")  # type: ignore[assignment]


#: What a server's error code means: a lock wait ran out, start over, or no table.
BUSY, RETRY, MISSING = "busy", "retry", "missing"


def errno(exc: DatabaseError) -> int | None:
    cause = exc.__cause__
    return cause.args[0] if cause is not None and cause.args else None


def missing_table() -> ImproperlyConfigured:
    return ImproperlyConfigured(
        f"The table {IdempotencyKey._meta.db_table!r} does not exist. "
        "Run 'python manage.py migrate django_idempotency' to create it."
    )


STATE_IN_PROGRESS = str(State.IN_PROGRESS)


def insert_params(connection: BaseDatabaseWrapper, new: NewClaim) -> list[Any]:
    seconds = clock.SECONDS[connection.vendor]
    # Atomic mode holds no lease and retains nothing.
    lease, retained_for = new.lease, new.retained_for
    return [
        new.scope,
        new.key,
        new.fingerprint,
        STATE_IN_PROGRESS,
        new.owner_token,
        seconds(new.expires_in),
        None if lease is None else seconds(lease),
        None if retained_for is None else seconds(retained_for),
    ]


def claim_upsert(
    connection: BaseDatabaseWrapper, new: NewClaim, take_over_abandoned: bool
) -> Claim | None:
    """SQLite: insert, or take over an expired record, in one statement."""
    name = ("upsert", take_over_abandoned)
    sql = STATEMENTS.get((connection.vendor, name)) or cached_sql(
        connection, name, lambda c: upsert_sql(c, take_over_abandoned)
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, insert_params(connection, new))
        row = cursor.fetchone()
    return None if row is None else claimed(connection, row)


def upsert_sql(connection: BaseDatabaseWrapper, take_over_abandoned: bool) -> str:
    table = quoted_table(connection)
    scope, key = key_columns(connection)
    fingerprint = connection.ops.quote_name(column_names()["fingerprint"])
    excluded = f"EXCLUDED.{fingerprint}"
    progress = progress_assignments(connection, excluded)
    takeover = takeover_assignments(connection, from_excluded=True)
    # SQLite reads 'now' once per statement: the condition and created_at agree.
    return (
        f"{insert_claim_into(connection)} VALUES ({claim_values(connection)}) "
        f"ON CONFLICT ({scope}, {key}) DO UPDATE SET {progress}, {takeover} "
        f"WHERE {takeover_condition(connection, take_over_abandoned, excluded, f'{table}.')} "
        f"RETURNING {claimed_columns(connection)}"
    )


def takeover_assignments(connection: BaseDatabaseWrapper, *, from_excluded: bool) -> str:
    """Give an expired record to a new claim, from ``EXCLUDED`` or ``insert_params(...)[2:]``."""
    quote = connection.ops.quote_name
    columns = column_names()
    claim = [quote(columns[field]) for field in CLAIM_FIELDS[2:]]
    later = clock.later_sql(connection)
    given = ["%s"] * 3 + [clock.now_sql(connection), later, later, later]
    values = [
        f"{name} = EXCLUDED.{name}" if from_excluded else f"{name} = {value}"
        for name, value in zip(claim, given, strict=True)
    ]
    return ", ".join(values + [f"{quote(columns[f])} = NULL" for f in RESPONSE_FIELDS])


def progress_assignments(connection: BaseDatabaseWrapper, fingerprint: str) -> str:
    """A takeover's attempt and checkpoints, first, as MySQL assigns left to right.

    The same request's abandoned claim goes to attempt n + 1, its released one stays n,
    another request's to 1 and no checkpoints.
    """
    quote = connection.ops.quote_name
    columns = column_names()
    attempt, checkpoints = quote(columns["attempt"]), quote(columns["checkpoints"])
    same = (
        f"{quote(columns['state'])} = '{State.IN_PROGRESS}' "
        f"AND {quote(columns['fingerprint'])} = {fingerprint}"
    )
    return (
        f"{attempt} = CASE WHEN {same} "
        f"THEN {attempt} + CASE WHEN {leases.owned_sql(connection)} THEN 1 ELSE 0 END ELSE 1 END, "
        f"{checkpoints} = CASE WHEN {same} THEN {checkpoints} ELSE NULL END"
    )


def takeover_condition(
    connection: BaseDatabaseWrapper, take_over_abandoned: bool, fingerprint: str, table: str = ""
) -> str:
    """Every takeover's condition, :meth:`Record.free_to_take` in SQL.

    Expired by the database's clock in the statement, not an abandoned claim left to a
    recovery policy, not bound to another request. ``fingerprint`` is SQL (``%s`` or an
    ``EXCLUDED`` column); ``table`` qualifies the columns (``"t."``).
    """
    return (
        f"{leases.expiry_sql(True, connection, table)}"
        f"{unless_abandoned(connection, take_over_abandoned, table)}"
        f"{unless_bound(connection, fingerprint, table)}"
    )


def unless_abandoned(connection: BaseDatabaseWrapper, take_over_abandoned: bool, table: str) -> str:
    if take_over_abandoned:
        return ""
    return f" AND NOT {leases.sql(leases.ABANDONED, connection, table)}"


def unless_bound(connection: BaseDatabaseWrapper, fingerprint: str, table: str = "") -> str:
    """Not :meth:`Record.bound_to_other_work`, in SQL; arguments as :func:`takeover_condition`."""
    quote = connection.ops.quote_name
    ran_out = (
        f"({leases.sql(leases.RELEASED, connection, table)} "
        f"OR {leases.sql(leases.ABANDONED, connection, table)})"
    )
    carried = leases.checkpoints_sql(connection, table)
    retained = leases.retained_sql(connection, table)
    other = f"{table}{quote(column_names()['fingerprint'])} <> {fingerprint}"
    return f" AND NOT ({ran_out} AND {carried} AND {retained} AND {other})"


def claimed_columns(connection: BaseDatabaseWrapper, table: str = "") -> str:
    """The id and progress columns (``table``: qualified; SQLite's ``RETURNING`` is not)."""
    quote = connection.ops.quote_name
    columns = column_names()
    names = [quote(IdempotencyKey._meta.pk.column), *(quote(columns[f]) for f in PROGRESS)]
    return ", ".join(f"{table}.{name}" if table else name for name in names)


#: What a claim returns about the key it claimed, after its id.
PROGRESS = ["attempt", "checkpoints"]


def claimed(connection: BaseDatabaseWrapper, row: Any) -> Claim:
    values = list(row)
    converters = _CONVERTERS.get(connection.vendor) or row_converters(connection)
    for index, expression, converter in converters[1]:
        values[index] = converter(values[index], expression, connection)
    record_id, attempt, checkpoints = values
    return Claim(int(record_id), attempt=int(attempt), checkpoints=checkpoints or {})


#: What the claim and the reads return about a live record, in this order.
RECORD_COLUMNS = [
    "id",
    "fingerprint",
    "state",
    "status_code",
    "response_headers",
    "response_body",
    "owner_token",
    "created_at",
    "expires_at",
    "retained_until",
    *PROGRESS,
]


def record_of(connection: BaseDatabaseWrapper, row: Any) -> Record:
    """A row of ``RECORD_COLUMNS`` and the database's clock, converted as the ORM would.

    Without building a model; only the columns the ORM converts.
    """
    values = list(row)
    converters = _CONVERTERS.get(connection.vendor) or row_converters(connection)
    for index, expression, converter in converters[0]:
        values[index] = converter(values[index], expression, connection)
    (
        record_id,
        fingerprint,
        state,
        status_code,
        headers,
        body,
        owner_token,
        created_at,
        expires_at,
        retained_until,
        attempt,
        checkpoints,
        seen_at,
    ) = values
    completed = state == STATE_COMPLETED
    return Record(
        id=int(record_id),
        fingerprint=fingerprint,
        completed=completed,
        response=StoredResponse(status_code or 200, headers or [], body) if completed else None,
        owner_token=owner_token,
        created_at=created_at,
        expires_at=expires_at,
        seen_at=seen_at,
        attempt=int(attempt),
        checkpoints=checkpoints or {},
        retained_until=retained_until,
    )


#: Per vendor, the ORM's converters of a record's row (with the clock), then of a
#: claim's row: (position, column, converter), for the columns that have any.
_CONVERTERS: dict[str, tuple[list[tuple[int, Col, Any]], list[tuple[int, Col, Any]]]] = {}


def row_converters(connection: BaseDatabaseWrapper) -> tuple[list[Any], list[Any]]:
    record: list[tuple[int, Col, Any]] = []
    # The clock, last, is converted as the expiry (a datetime column) is.
    for index, name in enumerate([*RECORD_COLUMNS, "expires_at"]):
        field = IdempotencyKey._meta.get_field(name)
        assert isinstance(field, Field)
        column = Col(IdempotencyKey._meta.db_table, field)
        converters = connection.ops.get_db_converters(column)
        converters += field.get_db_converters(connection)
        for converter in converters:
            record.append((index, column, converter))
    # A claim's row is the id, then the record's last columns (its progress).
    first = len(RECORD_COLUMNS) - len(PROGRESS)
    progress: list[tuple[int, Col, Any]] = []
    for index, column, converter in record:
        if first <= index < len(RECORD_COLUMNS):
            progress.append((index - first + 1, column, converter))
    found = _CONVERTERS[connection.vendor] = (record, progress)
    return found


def record_select_sql(connection: BaseDatabaseWrapper, *, lock: str = "") -> str:
    quote = connection.ops.quote_name
    columns = column_names()
    names = ", ".join([quote(columns[name]) for name in RECORD_COLUMNS])
    scope, key = key_columns(connection)
    return (
        f"SELECT {names}, {clock.now_sql(connection)} FROM {quoted_table(connection)} "
        f"WHERE {scope} = %s AND {key} = %s{lock}"
    )


def read_record(connection: BaseDatabaseWrapper, scope: str, key: str) -> Record | None:
    sql = STATEMENTS.get((connection.vendor, "read")) or cached_sql(
        connection, "read", record_select_sql
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [scope, key])
        row = cursor.fetchone()
    return None if row is None else record_of(connection, row)


#: What a backend's claim finds: the key claimed, the live record holding it, or nothing.
Found = Claim | Record | None


class Backend:
    """One database's way to claim a key, and what its errors mean.

    Here, standard SQL: an upsert that inserts or takes over an expired record, else a read
    of the live one. A vendor overrides what it does otherwise.
    """

    #: The wait happens at ``BEGIN`` (SQLite): :meth:`prepare` bounds it, :meth:`restore` after.
    waits_at_begin = False
    #: Whether a replay is read before the claim (``store.reads_before_claiming``).
    reads_before_claiming = False
    #: A server error code, as :meth:`code` reads it, to BUSY, RETRY or MISSING.
    codes: dict[Any, str] = {}

    def prepare(self, connection: BaseDatabaseWrapper, wait: float) -> None:
        """Bound the wait for an in-flight original before the claim's transaction opens."""

    def restore(self, connection: BaseDatabaseWrapper) -> None:
        """Give the connection back what :meth:`prepare` changed."""

    def claim(self, connection: Connection, new: NewClaim, wait: float, take_over: bool) -> Found:
        """The key claimed, the live record holding it, or ``None`` if it vanished meanwhile.

        ``take_over``: take an abandoned claim over too.
        """
        claimed_key = claim_upsert(connection, new, take_over)
        if claimed_key is not None:
            return claimed_key
        return read_record(connection, new.scope, new.key)

    def code(self, exc: DatabaseError) -> Any:
        return errno(exc)

    def meaning(self, exc: DatabaseError) -> Exception | None:
        """What ``exc`` means on the key table, or ``None`` for an error to let through."""
        meaning = self.codes.get(self.code(exc))
        if meaning == BUSY:
            return Busy(f"A lock wait ran out ({exc}).")
        if meaning == RETRY:
            return Retry(str(exc))
        return missing_table() if meaning == MISSING else None
