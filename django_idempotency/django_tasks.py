"""Re-exports :mod:`django_idempotency.contrib.django_tasks` (Django's Tasks framework).

Kept so that ``from django_idempotency.django_tasks import idempotent_task``
goes on working, and so that a purge enqueued under this module's path
before the move still finds its task; new code imports from
``django_idempotency.contrib.django_tasks``.
"""

from __future__ import annotations

from django_idempotency.contrib.django_tasks import (
    TaskOptions,
    idempotent_task,
    purge_expired_keys,
)

__all__ = ["TaskOptions", "idempotent_task", "purge_expired_keys"]
