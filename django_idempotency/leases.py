"""The states of a record, each defined once, by the database's clock.

A record is ``completed``, or in progress; an in-progress record is

- ``held``: its owner's lease is ahead of the database's clock, so its
  owner may still be running;
- ``abandoned``: it has an owner (a token) and its lease ran out: the owner
  stopped before it finished, and the next retry may take it over;
- ``released``: its owner gave it back (the token cleared) keeping its
  checkpoints, so the next retry takes it over at once.

While a lease is held, ``expires_at`` is where it ends (``locked_until``
too), so one indexed column decides. (The purge keeps a record in progress
past its ``expires_at``, until its ``retained_until``: see
:mod:`django_idempotency.purge`. That decides no state.) Each state is written three ways,
for the three places that ask: Python, for a record read together with the
database's clock (the store's claim); an ORM ``Q``, evaluated by the
statement that filters (the operators' commands and the admin); and SQL,
for the store's fenced statements. ``tests/test_leases.py`` checks, on every
backend, that the three agree on every kind of row.
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
STATES: tuple[State, ...] = (COMPLETED, HELD, ABANDONED, RELEASED)

_IN_PROGRESS = str(IdempotencyKey.State.IN_PROGRESS)


def state_of(completed: bool, owner_token: str, expires_at: datetime, now: datetime) -> State:
    """A record's state, from its columns and the database's clock read with them."""
    if completed:
        return COMPLETED
    if owner_token == "":
        return RELEASED
    return ABANDONED if expires_at <= now else HELD


def q(state: State, now: Any = None) -> Q:
    """The records in ``state``; ``now`` is the database's clock unless given."""
    now = clock.DatabaseNow() if now is None else now
    if state == COMPLETED:
        return ~Q(state=_IN_PROGRESS)
    if state == RELEASED:
        return Q(state=_IN_PROGRESS, owner_token="")
    owned = Q(state=_IN_PROGRESS) & ~Q(owner_token="")
    if state == ABANDONED:
        return owned & Q(expires_at__lte=now)
    return owned & Q(expires_at__gt=now)


def sql(state: State, connection: BaseDatabaseWrapper, table: str = "") -> str:
    """The records in ``state`` as a SQL condition, by the database's clock in the statement.

    ``table`` qualifies the columns (``"t."``), for a statement that names
    the key table twice.
    """
    quote = connection.ops.quote_name
    fields = IdempotencyKey._meta

    def column(name: str) -> str:
        return f"{table}{quote(str(fields.get_field(name).column))}"  # type: ignore[union-attr]

    in_progress = f"{column('state')} = '{_IN_PROGRESS}'"
    if state == COMPLETED:
        return f"{column('state')} <> '{_IN_PROGRESS}'"
    if state == RELEASED:
        return f"({in_progress} AND {column('owner_token')} = '')"
    owned = f"{in_progress} AND {column('owner_token')} <> ''"
    compare = "<=" if state == ABANDONED else ">"
    return f"({owned} AND {column('expires_at')} {compare} {clock.now_sql(connection)})"
