"""The purge as a task of Django's Tasks framework, for projects without Celery.

``django.tasks`` is built into Django 6.0 and later; on Django 5.2 the
``django-tasks`` backport (the ``tasks`` extra) provides the same API. This
module imports whichever is there, so nothing else in the package needs
either. Enqueue it from your scheduler of choice; see the purge page of the
docs.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the backport
    try:
        from django_tasks import task  # type: ignore[no-redef,import-not-found,unused-ignore]
    except ImportError as exc:
        raise ImproperlyConfigured(
            "django_idempotency.django_tasks needs Django's Tasks framework: Django 6.0 "
            "or later, or on Django 5.2 the backport: "
            "pip install 'django-idempotency[tasks]'."
        ) from exc

from django_idempotency.purge import DEFAULT_BATCH_SIZE, purge_expired


@task
def purge_expired_keys(batch_size: int = DEFAULT_BATCH_SIZE, database: str | None = None) -> int:
    """Delete expired idempotency records; return how many were deleted.

    The same purge as the management command and the Celery task:
    ``database`` defaults to ``IDEMPOTENCY["DATABASE"]``, and several runs
    at once are safe.
    """
    return purge_expired(using=database, batch_size=batch_size)
