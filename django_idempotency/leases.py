"""The states of a record, each defined once, by the database's clock.

A record is ``completed``, or in progress and ``held`` (its owner's lease is still ahead of
the clock), ``abandoned`` (its owner's lease ran out: the next retry may take it over) or
``released`` (given back, token cleared, keeping its checkpoints: taken over at once).
While a lease is held ``expires_at`` is its end: one indexed column decides lease and expiry.

Each state is written for Python (a record read with the clock), the ORM and SQL, which
tests/test_leases.py holds to the same rows on every backend; what the purge deletes, for
the ORM and SQL, which tests/test_purge_progress.py holds to the same rows. The purge's
``retained_until`` decides no state.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Q

from django_idempotency import clock
from django_idempotency.models import IdempotencyKey

State = Literal["completed", "held", "abandoned", "released"]
COMPLETED: State = "completed"
HELD: State = "held"
ABANDONED: State = "abandoned"
RELEASED: State = "released"

_IN_PROGRESS = str(IdempotencyKey.State.IN_PROGRESS)

#: The token of a claim without an owner: one given back, or an atomic-mode claim, which
#: its own transaction fences.
NO_OWNER = ""


def expired(expires_at: datetime, now: datetime) -> bool:
    """Whether a record is past its expiry at ``now``, the database's clock read with it."""
    return expires_at <= now


def owned(owner_token: str) -> bool:
    """Whether an in-progress claim still has its owner (held or abandoned), by its token.

    The owner's attempt counts when it gives the claim back or it is taken over: a
    released claim counted it already.
    """
    return owner_token != NO_OWNER


def owned_sql(connection: BaseDatabaseWrapper, table: str = "") -> str:
    """:func:`owned`, as SQL on the token column (``table`` qualifies it)."""
    return f"({_column(connection, table, 'owner_token')} <> '{NO_OWNER}')"


def owned_q() -> Q:
    """:func:`owned`, as an ORM condition."""
    return ~Q(owner_token=NO_OWNER)


def given_back_sql(connection: BaseDatabaseWrapper) -> dict[str, str]:
    """The assignments that make a claim :data:`RELEASED`; last, as MySQL assigns left to right."""
    now = clock.now_sql(connection)
    return {"owner_token": f"'{NO_OWNER}'", "locked_until": now, "expires_at": now}


def state_of(completed: bool, owner_token: str, expires_at: datetime, now: datetime) -> State:
    """A record's state, ``now`` being the database's clock read with its columns."""
    if completed:
        return COMPLETED
    if not owned(owner_token):
        return RELEASED
    return ABANDONED if expired(expires_at, now) else HELD


def expiry_q(past: bool, now: Any = None) -> Q:
    """The records past their expiry (``past``) or not, by the database's clock unless given."""
    now = clock.DatabaseNow() if now is None else now
    return Q(expires_at__lte=now) if past else Q(expires_at__gt=now)


def q(state: State, now: Any = None) -> Q:
    """The records in ``state``; ``now`` is the database's clock unless given."""
    now = clock.DatabaseNow() if now is None else now
    if state == COMPLETED:
        return ~Q(state=_IN_PROGRESS)
    if state == RELEASED:
        return Q(state=_IN_PROGRESS) & ~owned_q()
    has_owner = Q(state=_IN_PROGRESS) & owned_q()
    return has_owner & expiry_q(state == ABANDONED, now)


def sql(state: State, connection: BaseDatabaseWrapper, table: str = "") -> str:
    """The records in ``state``, as SQL, by the database's clock in the statement.

    ``table`` qualifies the columns (``"t."``).
    """
    in_progress = f"{_column(connection, table, 'state')} = '{_IN_PROGRESS}'"
    if state == COMPLETED:
        return f"{_column(connection, table, 'state')} <> '{_IN_PROGRESS}'"
    if state == RELEASED:
        return f"({in_progress} AND NOT {owned_sql(connection, table)})"
    has_owner = f"{in_progress} AND {owned_sql(connection, table)}"
    return f"({has_owner} AND {expiry_sql(state == ABANDONED, connection, table)})"


def carries_checkpoints(checkpoints: Any) -> bool:
    """Whether checkpoints record a step: a JSON object with a member (not ``null``, ``[]``)."""
    return isinstance(checkpoints, dict) and bool(checkpoints)


def checkpoints_sql(connection: BaseDatabaseWrapper, table: str = "") -> str:
    """:func:`carries_checkpoints` as SQL; never ``NULL``, so that it can be negated."""
    column = _column(connection, table, "checkpoints")
    if connection.vendor == "postgresql":
        kept = f"jsonb_typeof({column}) = 'object' AND {column} <> '{{}}'::jsonb"
    elif connection.vendor == "mysql":
        kept = f"JSON_TYPE({column}) = 'OBJECT' AND JSON_LENGTH({column}) > 0"
    else:
        kept = f"json_type({column}) = 'object' AND json({column}) <> '{{}}'"
    return f"({column} IS NOT NULL AND {kept})"


def retained(retained_until: datetime | None, now: datetime) -> bool:
    """Whether the purge still keeps a claim at ``now`` (``None``: atomic mode, never)."""
    return retained_until is not None and retained_until > now


def retained_q(now: Any) -> Q:
    """:func:`retained`, as an ORM condition at ``now``: the database's clock, or a cutoff."""
    return Q(retained_until__gt=now)


def retained_sql(connection: BaseDatabaseWrapper, table: str = "", now: str | None = None) -> str:
    """:func:`retained`, as SQL never ``NULL``, by the database's clock unless ``now`` (SQL)."""
    column = _column(connection, table, "retained_until")
    now = clock.now_sql(connection) if now is None else now
    return f"({column} IS NOT NULL AND {column} > {now})"


def expiry_sql(
    past: bool, connection: BaseDatabaseWrapper, table: str = "", now: str | None = None
) -> str:
    """The records past their expiry (``past``) or not, as SQL, by the database's clock.

    ``now``: SQL (a parameter) in place of the clock.
    """
    compare = "<=" if past else ">"
    now = clock.now_sql(connection) if now is None else now
    return f"{_column(connection, table, 'expires_at')} {compare} {now}"


def purgeable_q(cutoff: Any) -> Q:
    """What a purge with ``cutoff`` deletes: expired by then, and completed or not retained.

    A claim left in progress keeps its progress for the retry until ``retained_until``.
    """
    return expiry_q(True, cutoff) & (q(COMPLETED) | ~retained_q(cutoff))


def purgeable_sql(connection: BaseDatabaseWrapper, cutoff: str) -> str:
    """:func:`purgeable_q` as SQL, never ``NULL``, with ``cutoff`` (SQL) in it twice.

    The expiry first: each backend walks the ``expires_at`` index, reading other columns
    only there.
    """
    expired_then = expiry_sql(True, connection, now=cutoff)
    kept = retained_sql(connection, now=cutoff)
    return f"{expired_then} AND ({sql(COMPLETED, connection)} OR NOT {kept})"


def _column(connection: BaseDatabaseWrapper, table: str, name: str) -> str:
    column = IdempotencyKey._meta.get_field(name).column  # type: ignore[union-attr]
    return f"{table}{connection.ops.quote_name(str(column))}"
