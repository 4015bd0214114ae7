"""The Celery task: the same purge as the management command, on a schedule.

This is the only module that imports Celery, so the app works without it.
Schedule it hourly with ``CELERY_BEAT_SCHEDULE`` or django-celery-beat.
"""

from __future__ import annotations

from celery import shared_task

from django_idempotency.purge import DEFAULT_BATCH_SIZE, purge_expired


@shared_task(name="django_idempotency.tasks.purge_expired_keys")
def purge_expired_keys(batch_size: int = DEFAULT_BATCH_SIZE, database: str | None = None) -> int:
    """Delete expired idempotency records; return how many were deleted.

    ``database`` defaults to ``IDEMPOTENCY["DATABASE"]``. Running it on
    several workers at once is safe: each record is deleted, and counted,
    once.
    """
    return purge_expired(using=database, batch_size=batch_size)
