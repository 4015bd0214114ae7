"""The record states, written once in leases.py for Python, the ORM and SQL, agree."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any, get_args

import pytest
from django.db import connection
from django.db.models import JSONField, Value

from django_idempotency import clock, leases
from django_idempotency.backends.base import read_record, takeover_condition, unless_bound
from django_idempotency.models import IdempotencyKey

pytestmark = pytest.mark.django_db

State = IdempotencyKey.State
HOUR = timedelta(hours=1)


@pytest.fixture
def every_kind_of_row() -> dict[int, leases.State]:
    """One record for each combination of the columns the states read, and its state."""
    now = clock.read(connection)
    expected: dict[int, leases.State] = {}
    kinds = itertools.product([State.COMPLETED, State.IN_PROGRESS], ["", "token"], [-HOUR, HOUR])
    for number, (state, token, offset) in enumerate(kinds):
        record = IdempotencyKey.objects.create(
            scope="leases",
            key=f"k{number}",
            fingerprint="f",
            state=state,
            owner_token=token,
            expires_at=now + offset,
            locked_until=None if state == State.COMPLETED or not token else now + offset,
        )
        completed = state == State.COMPLETED
        expected[record.pk] = leases.state_of(completed, token, now + offset, now)
    return expected


def test_each_row_is_in_the_state_a_person_would_name(every_kind_of_row):
    assert sorted(every_kind_of_row.values()) == sorted(
        ["completed"] * 4 + ["released"] * 2 + ["abandoned", "held"]
    )


@pytest.mark.parametrize("state", get_args(leases.State))
def test_the_orm_and_sql_select_the_rows_python_names(every_kind_of_row, state):
    named = {pk for pk, found in every_kind_of_row.items() if found == state}
    table = connection.ops.quote_name(IdempotencyKey._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT id FROM {table} WHERE {leases.sql(state, connection)}", [])
        by_sql = {row[0] for row in cursor.fetchall()}
    by_orm = set(IdempotencyKey.objects.filter(leases.q(state)).values_list("pk", flat=True))

    assert named
    assert by_orm == named
    assert by_sql == named


def test_a_qualified_condition_names_its_table(every_kind_of_row):
    table = connection.ops.quote_name(IdempotencyKey._meta.db_table)
    condition = leases.sql(leases.ABANDONED, connection, "t.")
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT t.id FROM {table} t WHERE {condition}", [])
        found = {row[0] for row in cursor.fetchall()}

    assert found == {pk for pk, state in every_kind_of_row.items() if state == "abandoned"}


@pytest.mark.parametrize("past", [True, False])
def test_expiry_is_the_same_rule_in_python_the_orm_and_sql(every_kind_of_row, past):
    now = clock.read(connection)
    rows = IdempotencyKey.objects.filter(pk__in=every_kind_of_row)
    named = {row.pk for row in rows if leases.expired(row.expires_at, now) == past}
    table = connection.ops.quote_name(IdempotencyKey._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT id FROM {table} WHERE {leases.expiry_sql(past, connection)}", [])
        by_sql = {row[0] for row in cursor.fetchall()}
    by_orm = set(rows.filter(leases.expiry_q(past)).values_list("pk", flat=True))

    assert len(named) == 4
    assert by_orm == named
    assert by_sql == named


@pytest.fixture
def pinned_clock() -> Iterator[datetime]:
    """The database's clock pinned at an instant with a fraction of a second."""
    when = clock.read(connection).replace(microsecond=123456)
    clock.pin(when)
    try:
        yield when
    finally:
        clock.pin(None)


def test_a_record_expiring_at_the_clocks_instant_has_expired_by_every_form(pinned_clock):
    # Written by the database's own clock expression, so it holds the instant
    # in the database's representation (SQLite's text keeps milliseconds,
    # where the ORM would write microseconds).
    record = IdempotencyKey.objects.create(
        scope="leases",
        key="boundary",
        fingerprint="f",
        owner_token="token",
        expires_at=clock.DatabaseNow(),
        locked_until=clock.DatabaseNow(),
    )
    table = connection.ops.quote_name(IdempotencyKey._meta.db_table)
    record.refresh_from_db()
    now = clock.read(connection)
    rows = IdempotencyKey.objects.filter(pk=record.pk)

    def by_sql(condition: str) -> bool:
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT id FROM {table} WHERE id = %s AND {condition}", [record.pk])
            return cursor.fetchone() is not None

    assert record.expires_at == now
    assert leases.expired(record.expires_at, now)
    assert rows.filter(leases.expiry_q(True)).exists()
    assert not rows.filter(leases.expiry_q(False)).exists()
    assert by_sql(leases.expiry_sql(True, connection))
    assert not by_sql(leases.expiry_sql(False, connection))
    assert leases.state_of(False, record.owner_token, record.expires_at, now) == leases.ABANDONED
    assert rows.filter(leases.q(leases.ABANDONED)).exists()
    assert by_sql(leases.sql(leases.ABANDONED, connection))


#: A claim's checkpoints as stored: SQL NULL, JSON null, {} and [] record no step.
CHECKPOINTS = {
    "sql-null": None,
    "json-null": Value(None, JSONField()),
    "empty": {},
    "empty-list": [],
    "some": {"charged": 1},
}


def with_progress(rows_by_pk: dict[int, Any], checkpoints: str, retained: timedelta | None) -> Any:
    """Every kind of row, given ``checkpoints`` and retained for ``retained`` from now."""
    now = clock.read(connection)
    rows = IdempotencyKey.objects.filter(pk__in=rows_by_pk)
    rows.update(
        checkpoints=CHECKPOINTS[checkpoints],
        retained_until=None if retained is None else now + retained,
    )
    return rows


def selected_by(condition: str, params: list[Any]) -> set[int]:
    """The rows of every kind that ``condition`` (SQL on the key table) selects."""
    table = connection.ops.quote_name(IdempotencyKey._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT id FROM {table} WHERE scope = 'leases' AND {condition}", params)
        return {row[0] for row in cursor.fetchall()}


@pytest.mark.parametrize("checkpoints", list(CHECKPOINTS))
@pytest.mark.parametrize("retained", [None, -HOUR, HOUR], ids=["unretained", "past", "ahead"])
def test_python_and_sql_agree_on_which_claims_are_bound_to_their_request(
    every_kind_of_row, checkpoints, retained
):
    # Only a claim whose lease ran out (released or abandoned) that carries
    # checkpoints, while the purge keeps it, and only for another request
    # (another fingerprint), is left alone by a takeover.
    rows = with_progress(every_kind_of_row, checkpoints, retained)
    carried = checkpoints == "some"
    by_sql = selected_by(leases.checkpoints_sql(connection), [])
    by_python = {
        pk
        for pk, key in rows.values_list("pk", "key")
        if leases.carries_checkpoints(read_record(connection, "leases", key).checkpoints)
    }
    assert by_sql == by_python == (set(every_kind_of_row) if carried else set())
    for fingerprint in ["f", "other"]:
        free = selected_by(f"1 = 1{unless_bound(connection, '%s')}", [fingerprint])
        by_python = {
            pk
            for pk, key in rows.values_list("pk", "key")
            if read_record(connection, "leases", key).bound_to_other_work(fingerprint)
        }
        named = {
            pk
            for pk, state in every_kind_of_row.items()
            if state in (leases.RELEASED, leases.ABANDONED)
            and carried
            and retained == HOUR
            and fingerprint != "f"
        }

        assert by_python == named
        assert free == set(every_kind_of_row) - named
        bound = carried and retained == HOUR and fingerprint != "f"
        assert len(named) == (3 if bound else 0)


@pytest.mark.parametrize("take_over_abandoned", [True, False], ids=["take-over", "recovery-policy"])
@pytest.mark.parametrize("checkpoints", ["some", "sql-null"])
@pytest.mark.parametrize("retained", [None, HOUR], ids=["unretained", "ahead"])
@pytest.mark.parametrize("qualified", [False, True], ids=["bare", "table-qualified"])
def test_the_takeover_condition_and_python_agree_on_which_records_a_claim_takes(
    every_kind_of_row, take_over_abandoned, checkpoints, retained, qualified
):
    # One condition for the three vendors' takeover statements (SQLite's and
    # PostgreSQL's name the table on each column), and its one Python reading
    # for a record the claim read (a stale read, MySQL's locked one).
    rows = with_progress(every_kind_of_row, checkpoints, retained)
    table = connection.ops.quote_name(IdempotencyKey._meta.db_table)
    qualifier = f"{table}." if qualified else ""
    condition = takeover_condition(connection, take_over_abandoned, "%s", qualifier)
    for fingerprint in ["f", "other"]:
        by_sql = selected_by(condition, [fingerprint])
        by_python = {
            pk
            for pk, key in rows.values_list("pk", "key")
            if read_record(connection, "leases", key).free_to_take(fingerprint, take_over_abandoned)
        }
        bound = checkpoints == "some" and retained == HOUR and fingerprint != "f"
        named = {
            pk
            for pk, state in every_kind_of_row.items()
            if state != leases.HELD
            # A completed record or a claim past its expiry; every row is one hour either side.
            and read_record(connection, "leases", rows.get(pk=pk).key).expired
            and not (state == leases.ABANDONED and not take_over_abandoned)
            and not (state in (leases.RELEASED, leases.ABANDONED) and bound)
        }

        assert by_python == by_sql == named
        assert named  # an expired completed record is always free


def test_python_and_sql_agree_on_which_claims_still_have_their_owner(every_kind_of_row):
    # A held or abandoned claim has its owner: ending it counts that owner's
    # attempt; a released one counted it when it was given back.
    rows = IdempotencyKey.objects.filter(pk__in=every_kind_of_row)
    by_python = {pk for pk, token in rows.values_list("pk", "owner_token") if leases.owned(token)}
    # From the columns as written, not through the states (which ask owned()).
    written = rows.values_list("pk", "state", "owner_token")
    claims = {pk for pk, state, _ in written if state == IdempotencyKey.State.IN_PROGRESS}
    with_owner = {pk for pk, _, token in written if pk in claims and token != ""}

    assert by_python & claims == with_owner
    assert len(with_owner) == 2
    assert selected_by(leases.owned_sql(connection), []) == by_python
    assert set(rows.filter(leases.owned_q()).values_list("pk", flat=True)) == by_python
