"""Every statement a request makes on the key table, and what each answer means.

The unique constraint on (scope, key) is the only authority on who owns a key; the wait for
an in-flight original is bounded by the database, never by a sleep loop here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any

from django.db import DatabaseError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from django_idempotency import clock, leases
from django_idempotency.backends import BY_VENDOR, STANDARD
from django_idempotency.backends.base import (
    ABANDONED,
    BODY_FIELD,
    CHECKPOINTS_FIELD,
    HEADERS_FIELD,
    OWN_TRANSACTION,
    OWNER,
    OWNER_OR_RELEASED,
    REFUSAL_STATUS,
    REFUSED,
    STATE_COMPLETED,
    STATEMENTS,
    Backend,
    Busy,
    Claim,
    DatabaseLocked,
    NewClaim,
    Record,
    Retry,
    StoredResponse,
    cached_sql,
    column_names,
    complete_sql,
    delete_sql,
    errno,
    read_record,
    update_sql,
)
from django_idempotency.backends.mysql import ER_LOCK_DEADLOCK, galera_sync_wait
from django_idempotency.models import IdempotencyKey

__all__ = [
    "Busy",
    "Claim",
    "DatabaseLocked",
    "NewClaim",
    "Record",
    "Retry",
    "StoredResponse",
    "galera_sync_wait",
]

State = IdempotencyKey.State

# How often one request re-runs its claim after a deadlock or a lost race.
CLAIM_ATTEMPTS = 3


def reads_before_claiming(connection: BaseDatabaseWrapper) -> bool:
    """Whether to read for a replay before claiming: on PostgreSQL alone.

    There the claim after a miss is a cheap ``INSERT``; elsewhere the read would tax every
    new key.
    """
    return BY_VENDOR.get(connection.vendor, STANDARD).reads_before_claiming


def find_completed(connection: BaseDatabaseWrapper, scope: str, key: str) -> Record | None:
    """The key's completed, live record, from one indexed read outside a transaction.

    A completed record is committed and unchanged until it expires, so this finds what a
    claim would; anything else (``None``) is left to :func:`claim`.
    """
    try:
        record = read_record(connection, scope, key)
    except DatabaseError as exc:
        _raise_meaning(BY_VENDOR.get(connection.vendor, STANDARD), exc)
        raise
    if record is None or not record.completed or record.expired:
        return None
    return record


def claim(
    using: str,
    new: NewClaim,
    wait: float,
    *,
    take_over_abandoned: bool = True,
    opening: ExitStack | None = None,
    connection: BaseDatabaseWrapper | None = None,
) -> Claim:
    """Claim the key, or find the live record that holds it.

    Inside the caller's ``atomic`` or one entered on ``opening``, left open for the body.
    SQLite waits at ``BEGIN IMMEDIATE``, under a busy timeout set first and put back after;
    an error at ``BEGIN`` means what it would mean in the claim. A live record is committed
    and changes only when it expires or its owner ends it, so it is read without a lock: a
    replay writes nothing. An expired record is taken over in the same statement
    (``Record.free_to_take``; without ``take_over_abandoned`` an abandoned claim is left to
    a recovery policy), a takeover by the same request carrying its attempt and checkpoints.

    Raises :class:`Busy` when the wait runs out, :class:`Retry` to start over,
    ``ImproperlyConfigured`` when the table is missing.
    """
    if connection is None:
        connection = connections[using]
    backend = BY_VENDOR.get(connection.vendor, STANDARD)
    if backend.waits_at_begin:
        backend.prepare(connection, wait)
    try:
        if opening is not None:
            opening.enter_context(transaction.atomic(using=using))
        found = _claim(backend, connection, new, wait, take_over_abandoned)
    except DatabaseError as exc:
        _raise_meaning(backend, exc)
        raise
    finally:
        if backend.waits_at_begin:
            backend.restore(connection)
    if found is None:
        # Changed between our statements (a purge, a takeover): a new transaction sees it.
        raise Retry("The idempotency record changed during the claim.", transaction_lost=False)
    return found


def _claim(
    backend: Backend,
    connection: BaseDatabaseWrapper,
    new: NewClaim,
    wait: float,
    take_over_abandoned: bool,
) -> Claim | None:
    claimed = backend.claim(connection, new, wait, take_over_abandoned)
    if isinstance(claimed, Claim):
        return claimed
    if claimed is None:
        return None  # gone, as after a purge
    if claimed.free_to_take(new.fingerprint, take_over_abandoned):
        # Seen as it was before another request took it over.
        return None
    return Claim(claimed.id, claimed)


def complete(
    using: str,
    record_id: int,
    response: StoredResponse,
    *,
    owner_token: str | None,
    ttl: timedelta,
    grace: timedelta | None = None,
    connection: BaseDatabaseWrapper | None = None,
    fence: str | None = None,
) -> bool:
    """Store the response for ``ttl``; ``False`` if the claim is no longer ours (lease lost).

    ``grace``: keep the claim's expiry if the claim is younger than that by the database's
    clock (``Call._atomic``). ``fence``: by default the owner's token, or without one the
    writer's transaction.
    """
    if connection is None:
        connection = connections[using]
    vendor = connection.vendor
    if fence is None:
        fence = OWNER if owner_token is not None else OWN_TRANSACTION
    with_grace = grace is not None
    name = ("complete", fence, with_grace)
    sql = STATEMENTS.get((vendor, name)) or cached_sql(
        connection, name, lambda c: complete_sql(c, fence, with_grace=with_grace)
    )
    # The fields' own conversions, without compiling an ORM query per request.
    params: list[Any] = [
        STATE_COMPLETED,
        response.status_code,
        HEADERS_FIELD.get_db_prep_save(response.headers, connection),
        BODY_FIELD.get_db_prep_save(response.body, connection),
    ]
    seconds = clock.SECONDS[vendor]  # a C call where the driver takes a number
    if grace is not None:
        params.append(seconds(-grace))
    params.append(seconds(ttl))
    params.append(record_id)
    if owner_token is not None:
        params.append(owner_token)
    with connection.cursor() as cursor:  # not _write: the hot path's one frame less
        cursor.execute(sql, params)
        return cursor.rowcount == 1


def release(
    using: str,
    record_id: int,
    owner_token: str,
    *,
    keep_progress: bool = False,
    checkpoints: dict[str, Any] | None = None,
    ttl: timedelta | None = None,
) -> bool:
    """Give an in-progress claim back so a retry can run; only its owner may.

    ``keep_progress`` keeps the claim, free to take at once, with its attempt and
    ``checkpoints`` (if given: those that committed), retained ``ttl`` from now by the
    database's clock.
    """
    connection = connections[using]
    if keep_progress:
        corrected, retained = checkpoints is not None, ttl is not None
        sql = cached_sql(
            connection,
            ("release keeping progress", corrected, retained),
            lambda c: _release_keeping_progress_sql(c, corrected, retained),
        )
        params = [CHECKPOINTS_FIELD.get_db_prep_save(checkpoints, connection)] if corrected else []
        if retained:
            params.append(clock.seconds(connection, ttl))
        return _write(connection, sql, [*params, record_id, owner_token])
    sql = cached_sql(connection, "release", lambda c: delete_sql(c, OWNER))
    return _write(connection, sql, [record_id, owner_token])


def release_on_behalf(using: str, record_id: int, owner_token: str, *, unless_held: bool) -> bool:
    """An operator's release for the claim's owner, keeping its progress and ``retained_until``.

    Fenced by the token the operator read (``False``: changed since). An owned claim's
    release counts its owner's attempt, as the retry's takeover then will not. ``unless_held``
    leaves alone a lease still running by the database's clock: its request may be too.
    """
    connection = connections[using]
    counted = leases.owned(owner_token)
    sql = cached_sql(
        connection,
        ("release on behalf", counted, unless_held),
        lambda c: _release_keeping_progress_sql(
            c, corrected=False, counted=counted, unless_held=unless_held
        ),
    )
    return _write(connection, sql, [record_id, owner_token])


def _release_keeping_progress_sql(
    connection: BaseDatabaseWrapper,
    corrected: bool,
    retained: bool = False,
    *,
    counted: bool = False,
    unless_held: bool = False,
) -> str:
    """Give a claim back (:data:`~leases.RELEASED`), keeping its progress.

    ``corrected``/``retained``: set checkpoints/``retained_until`` from parameters;
    ``counted``: attempt + 1; ``unless_held``: leave a held lease alone.
    """
    assigned = {"checkpoints": "%s"} if corrected else {}
    if retained:
        assigned["retained_until"] = clock.later_sql(connection)
    if counted:
        assigned["attempt"] = f"{connection.ops.quote_name(column_names()['attempt'])} + 1"
    sql = update_sql(connection, OWNER, **assigned, **leases.given_back_sql(connection))
    return f"{sql} AND NOT {leases.sql(leases.HELD, connection)}" if unless_held else sql


def is_refusal(state: str, status_code: int | None) -> bool:
    """Whether a record is a refusal: completed with a result that could not be kept (SPEC 4.6)."""
    return state == STATE_COMPLETED and status_code is not None and status_code >= REFUSAL_STATUS


def release_refusal(using: str, record_id: int, owner_token: str) -> bool:
    """An operator's release of a refusal: the next retry runs the body again, resuming.

    Leaves what :func:`release_on_behalf` leaves of an owned claim, retained at least as long
    as the refusal was. Fenced by the refusal as read (id and owner's token): ``False`` if it
    changed since, or is past its expiry by the database's clock in the statement (its key
    already free).
    """
    connection = connections[using]
    sql = cached_sql(connection, "release refusal", _release_refusal_sql)
    return _write(connection, sql, [record_id, owner_token])


def _release_refusal_sql(connection: BaseDatabaseWrapper) -> str:
    quote = connection.ops.quote_name
    columns = column_names()
    retained, expires = quote(columns["retained_until"]), quote(columns["expires_at"])
    sql = update_sql(
        connection,
        REFUSED,
        # First: MySQL assigns left to right, and here still reads the refusal's expiry.
        retained_until=f"CASE WHEN {retained} > {expires} THEN {retained} ELSE {expires} END",
        state=f"'{State.IN_PROGRESS}'",
        status_code="NULL",
        response_headers="NULL",
        response_body="NULL",
        attempt=f"{quote(columns['attempt'])} + 1",
        **leases.given_back_sql(connection),
    )
    return f"{sql} AND {leases.expiry_sql(False, connection)}"


def take_over(using: str, abandoned: Record, new: NewClaim) -> Claim | None:
    """Take an abandoned claim over as its next attempt; ``None`` if another request did first.

    Fenced by the dead owner's token and its run-out lease (``ABANDONED``): one of two racers
    wins, and an owner that renewed meanwhile keeps it.
    """
    connection = connections[using]
    leased = new.lease is not None
    sql = cached_sql(connection, ("take over", leased), lambda c: _take_over_sql(c, leased))
    params = [new.owner_token, abandoned.attempt + 1, clock.seconds(connection, new.expires_in)]
    if leased:
        params.append(clock.seconds(connection, new.lease))
    params.append(clock.seconds(connection, new.retained_for))
    if not _write(connection, sql, [*params, abandoned.id, abandoned.owner_token]):
        return None
    return Claim(abandoned.id, attempt=abandoned.attempt + 1, checkpoints=abandoned.checkpoints)


def _take_over_sql(connection: BaseDatabaseWrapper, leased: bool) -> str:
    later = clock.later_sql(connection)
    return update_sql(
        connection,
        ABANDONED,
        owner_token="%s",
        attempt="%s",
        created_at=clock.now_sql(connection),
        expires_at=later,
        locked_until=later if leased else "NULL",
        retained_until=later,
    )


def settle(using: str, abandoned: Record, response: StoredResponse, *, ttl: timedelta) -> bool:
    """Complete an abandoned claim with a recovery policy's answer, fenced as :func:`take_over`."""
    return complete(
        using, abandoned.id, response, owner_token=abandoned.owner_token, ttl=ttl, fence=ABANDONED
    )


def record_progress(
    using: str,
    record_id: int,
    *,
    owner_token: str | None,
    checkpoints: dict[str, Any] | None = None,
    lease: timedelta | None = None,
    ttl: timedelta | None = None,
) -> bool:
    """Write a claim's checkpoints, renew its lease, or both; ``False`` if no longer this owner's.

    With ``ttl``, the claim is retained ``ttl`` past the renewed lease, by the database's
    clock, so a handler that outlives its first lease still leaves its progress. No token:
    atomic mode's own claim. Callers pass ``checkpoints``, ``lease`` or both.
    """
    connection = connections[using]
    fence = OWN_TRANSACTION if owner_token is None else OWNER
    retained = lease is not None and ttl is not None
    shape = (fence, checkpoints is not None, lease is not None, retained)
    sql = cached_sql(connection, ("progress", *shape), lambda c: _progress_sql(c, *shape))
    params: list[Any] = []
    if checkpoints is not None:
        params.append(CHECKPOINTS_FIELD.get_db_prep_save(checkpoints, connection))
    if lease is not None:
        params += [clock.seconds(connection, lease)] * 2
    if lease is not None and ttl is not None:
        params.append(clock.seconds(connection, lease + ttl))
    params.append(record_id)
    if fence == OWNER:
        params.append(owner_token)
    return _write(connection, sql, params)


def _progress_sql(
    connection: BaseDatabaseWrapper, fence: str, checkpoints: bool, renewed: bool, retained: bool
) -> str:
    assigned = {"checkpoints": "%s"} if checkpoints else {}
    if renewed:
        later = clock.later_sql(connection)
        assigned.update(locked_until=later, expires_at=later)
    if retained:
        assigned["retained_until"] = clock.later_sql(connection)
    return update_sql(connection, fence, **assigned)


def restore_progress(
    using: str, record_id: int, owner_token: str, checkpoints: dict[str, Any]
) -> bool:
    """Put a claim's checkpoints back after their transaction rolled back.

    Fenced by the recording owner's token (or its release or refusal), so that a new
    owner's progress is never touched.
    """
    connection = connections[using]
    value = CHECKPOINTS_FIELD.get_db_prep_save(checkpoints or None, connection)
    for fence in (OWNER_OR_RELEASED, REFUSED):
        sql = cached_sql(
            connection,
            ("restore progress", fence),
            lambda c, fence=fence: update_sql(c, fence, checkpoints="%s"),
        )
        if _write(connection, sql, [value, record_id, owner_token]):
            return True
    return False


def _write(connection: BaseDatabaseWrapper, sql: str, params: list[Any]) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount == 1


def lost_race(using: str, exc: DatabaseError) -> bool:
    """Whether ``exc`` in an atomic-mode attempt means: start the claim over.

    A MySQL 1213 (a deadlock or a lost Galera certification, up to ``COMMIT``) rolled the
    whole attempt back.
    """
    # The 1213 may be another alias's, rolled back behind Django's back: starting over
    # would let the caller commit the rest of it.
    return lost_transaction(using, exc) and not _other_transaction_open(using)


def lost_transaction(using: str, exc: DatabaseError) -> bool:
    """Whether ``exc`` rolled back ``using``'s whole transaction: a MySQL 1213."""
    return connections[using].vendor == "mysql" and errno(exc) == ER_LOCK_DEADLOCK


def _other_transaction_open(using: str) -> bool:
    """Whether another alias has a transaction open: ``atomic()``, or autocommit turned off."""
    return any(
        connection.alias != using
        and (
            connection.in_atomic_block
            or (connection.connection is not None and not connection.autocommit)
        )
        for connection in connections.all(initialized_only=True)
    )


@contextmanager
def explained(using: str) -> Iterator[None]:
    """Raise what a database error on the key table means, where it is known.

    A lock wait run out :class:`Busy`, a deadlock :class:`Retry`, a missing table
    ``ImproperlyConfigured``; others propagate.
    """
    try:
        yield
    except DatabaseError as exc:
        _raise_meaning(BY_VENDOR.get(connections[using].vendor, STANDARD), exc)
        raise


def _raise_meaning(backend: Backend, exc: DatabaseError) -> None:
    if isinstance(exc, (Busy, Retry)):
        return
    meaning = backend.meaning(exc)
    if meaning is not None:
        raise meaning from exc
