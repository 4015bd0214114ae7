"""A Celery app set up as a Django project's ``celery.py`` usually is.

Its configuration comes from the Django settings (``CELERY_*``), and
everything else is Celery's default, ``worker_hijack_root_logger`` included,
unlike :mod:`tests.celery_app`, which leaves the root logger alone.
"""

from __future__ import annotations

from celery import Celery

app = Celery("project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["tests"])
