"""Re-exports :mod:`django_idempotency.contrib.celery`, where the Celery integration lives.

Kept so that ``from django_idempotency.tasks import idempotent_task`` goes on
working, and so that Celery's autodiscovery, which imports each installed
app's ``tasks`` module, registers the purge task: its name,
``django_idempotency.tasks.purge_expired_keys``, is the one beat schedules
name. These are the documented imports; the integration itself lives in
:mod:`django_idempotency.contrib.celery`, the only module that imports Celery.
"""

from __future__ import annotations

from django_idempotency.contrib.celery import idempotent_task, purge_expired_keys

__all__ = ["idempotent_task", "purge_expired_keys"]
