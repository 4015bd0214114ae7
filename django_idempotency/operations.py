"""What an operator does with records: find stuck keys, release them, delete them.

The command and the admin both act through here.
"""

from __future__ import annotations

import contextlib
from datetime import datetime
from typing import Any

from django.db import connections
from django.db.models import Q, QuerySet

from django_idempotency import clock, leases, replay_cache, store
from django_idempotency.conf import idempotency_settings
from django_idempotency.exceptions import InvalidIdempotencyKey
from django_idempotency.keys import parse_key
from django_idempotency.models import IdempotencyKey
from django_idempotency.scopes import DIGEST_PREFIX, fit_key_column


class LeaseStillHeld(Exception):
    """The claim's lease has not run out: its owner may still be running."""

    def __init__(self, until: datetime) -> None:
        super().__init__(until)
        #: When the lease runs out, as the record said after the refusal.
        self.until = until


class RefusalExpired(Exception):
    """The refusal is past its expiry: its key is free already, and nothing is released."""

    def __init__(self, expired_at: datetime) -> None:
        super().__init__(expired_at)
        #: When it expired, as the record said after the refusal.
        self.expired_at = expired_at


def _refuse_if_held(using: str | None, record: IdempotencyKey) -> None:
    """Say why a fenced statement changed nothing, if it was a live lease."""
    held = records(using).filter(lease_held(), pk=record.pk)
    until = held.values_list("expires_at", flat=True).first()
    if until is not None:
        raise LeaseStillHeld(until)


def records(using: str | None = None) -> QuerySet[IdempotencyKey]:
    return IdempotencyKey.objects.using(using or idempotency_settings.database)


def stored_forms(value: str) -> list[str]:
    """A scope (or key) as typed, and as the column stores it when it is long (its digest).

    A digest copied from the list (``sha256:...``) is compared as typed
    only: the value that spells it is stored as a digest of its own, so
    that no value can pass for another's, and a search keeps that rule.
    """
    if value.startswith(DIGEST_PREFIX):
        return [value]
    return list(dict.fromkeys([value, fit_key_column(value)]))


def stored_keys(key: str) -> list[str]:
    """A key as typed, as a header may quote it (``"a\\"b"``), and as a long one is stored."""
    typed = [key]
    # The header's reading of a quoted key; its length rule is the view's.
    with contextlib.suppress(InvalidIdempotencyKey):
        typed.append(parse_key(key, max_length=len(key)))
    return list(dict.fromkeys(stored for value in typed for stored in stored_forms(value)))


def database_now(using: str | None = None) -> datetime:
    """The database's clock now, for display: the statements that act read it themselves."""
    return clock.read(connections[using or idempotency_settings.database])


def lease_held(now: Any = None) -> Q:
    """In progress with its lease still ahead, by the database's clock unless ``now`` is given."""
    return leases.q(leases.HELD, now)


def abandoned(now: Any = None) -> Q:
    """In progress, owned, and its lease run out: its owner stopped before it finished."""
    return leases.q(leases.ABANDONED, now)


def is_refusal(record: IdempotencyKey) -> bool:
    """Completed with a refusal: the body returned, but its result could not be kept.

    A view's ``500`` ``result-not-stored``, a function's or task's ``507``
    (``UnstorableResult``): the one completed record :func:`release` reopens.
    """
    return store.is_refusal(record.state, record.status_code)


def release(record: IdempotencyKey, *, force: bool = False) -> bool:
    """Let the next retry of an in-progress claim, or of a refusal, take it over at once.

    The record keeps its attempt and checkpoints, so the retry resumes where
    its owners got to. ``False`` if it was deleted, taken over or changed
    since it was read. A live
    lease raises :class:`LeaseStillHeld` unless ``force``; the fence is in
    the releasing statement, by the database's clock, so an owner renewing
    its lease meanwhile keeps it.

    A refusal (:func:`is_refusal`) has no running owner: its answer is
    dropped, from the replay cache too, and the next retry runs the body
    again, resuming from its checkpoints. :class:`RefusalExpired` if it is
    past its expiry by the database's clock: its key is free already (the
    next request runs as a new one), and releasing would revive it past
    its ``TTL``.
    """
    using = record._state.db or idempotency_settings.database
    if is_refusal(record):
        return _release_refusal(using, record)
    if store.release_on_behalf(using, record.pk, record.owner_token, unless_held=not force):
        return True
    if not force:
        _refuse_if_held(using, record)
    return False


def _release_refusal(using: str, record: IdempotencyKey) -> bool:
    if not store.release_refusal(using, record.pk, record.owner_token):
        # Say why, if it is the refusal read, now past its expiry.
        read = records(using).filter(
            leases.expiry_q(True),
            pk=record.pk,
            owner_token=record.owner_token,
            state=IdempotencyKey.State.COMPLETED,
            status_code=record.status_code,
        )
        expired_at = read.values_list("expires_at", flat=True).first()
        if expired_at is not None:
            raise RefusalExpired(expired_at)
        return False
    # Else the cache would keep answering with the refusal.
    alias = idempotency_settings.replay_cache
    if alias is not None:
        replay_cache.evict(alias, record.scope, record.key, using)
    return True


def delete(record: IdempotencyKey, *, force: bool = False) -> bool:
    """Delete a record (and its replay-cache entry): the next request with its key runs anew.

    A live lease is refused unless ``force``, as :func:`release` refuses it.
    """
    using = record._state.db
    fenced = records(using).filter(pk=record.pk)
    if not force:
        fenced = fenced.exclude(lease_held())
    # One fenced DELETE: Django's delete() may read the rows first, then delete by pk.
    deleted = fenced._raw_delete(using)
    if not deleted and not force:
        _refuse_if_held(using, record)
    alias = idempotency_settings.replay_cache
    if alias is not None:
        replay_cache.evict(alias, record.scope, record.key, using)
    return deleted == 1
