"""Re-exports :mod:`django_idempotency.contrib.django_tasks` (Django's Tasks framework).

Kept so that ``from django_idempotency.django_tasks import idempotent_task``
goes on working, and because the purge task is enqueued under this
module's path, ``django_idempotency.django_tasks.purge_expired_keys``, as it
was before the move: a worker imports it from here. These are the
documented imports; the integration itself lives in
:mod:`django_idempotency.contrib.django_tasks`.
"""

from __future__ import annotations

from django_idempotency.contrib.django_tasks import (
    TaskOptions,
    idempotent_task,
    purge_expired_keys,
)

__all__ = ["TaskOptions", "idempotent_task", "purge_expired_keys"]
