"""What an operator does with records: find stuck keys, release them, delete them.

``manage.py idempotency_keys`` and the admin both act through here, so a
live lease is refused the same way by each. See the operations page of the
docs for when to release and when to delete.
"""

from __future__ import annotations

from datetime import datetime

from django.db.models import Q, QuerySet
from django.utils import timezone

from django_idempotency import replay_cache
from django_idempotency.conf import idempotency_settings
from django_idempotency.models import IdempotencyKey

State = IdempotencyKey.State


class LeaseStillHeld(Exception):
    """The claim's lease has not run out: its owner may still be running."""


def records(using: str | None = None) -> QuerySet[IdempotencyKey]:
    return IdempotencyKey.objects.using(using or idempotency_settings.database)


def lease_held(now: datetime) -> Q:
    """In progress with its lease (or, without one, its expiry) still ahead."""
    return Q(state=State.IN_PROGRESS) & (
        Q(locked_until__gt=now) | Q(locked_until__isnull=True, expires_at__gt=now)
    )


def abandoned(now: datetime) -> Q:
    """In progress, owned, and its lease run out: its owner stopped before it finished."""
    return Q(state=State.IN_PROGRESS, expires_at__lte=now) & ~Q(owner_token="")


def release(record: IdempotencyKey, *, force: bool = False) -> bool:
    """Let the next retry of an in-progress claim take it over at once.

    The record is kept, with its attempt and checkpoints, so that the retry
    resumes where its owners got to (``request.idempotency.checkpoints``);
    ``False`` if it completed or changed since it was read. A live lease is
    refused unless ``force``: its request may still be running.
    """
    now = timezone.now()
    if not force and records(record._state.db).filter(lease_held(now), pk=record.pk).exists():
        raise LeaseStillHeld
    changed = (
        records(record._state.db)
        .filter(pk=record.pk, state=State.IN_PROGRESS, owner_token=record.owner_token)
        .update(owner_token="", locked_until=now, expires_at=now)
    )
    return changed == 1


def delete(record: IdempotencyKey, *, force: bool = False) -> bool:
    """Delete a record: the next request with its key runs as a new one.

    A completed record's stored answer is gone (and evicted from the replay
    cache); a live lease is refused unless ``force``.
    """
    using = record._state.db
    if not force and records(using).filter(lease_held(timezone.now()), pk=record.pk).exists():
        raise LeaseStillHeld
    deleted, _ = records(using).filter(pk=record.pk).delete()
    alias = idempotency_settings.replay_cache
    if alias is not None:
        replay_cache.evict(alias, record.scope, record.key, using)
    return deleted == 1
