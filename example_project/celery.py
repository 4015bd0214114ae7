"""The example project's Celery app; ``celery -A example_project worker -B`` runs it.

Defining the app never connects to the broker, so the web server runs with
no broker at all; only a worker, beat or a ``.delay()`` call needs one.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")

app = Celery("example_project")
# Every CELERY_* Django setting configures the app (CELERY_BROKER_URL,
# CELERY_BEAT_SCHEDULE, ...).
app.config_from_object("django.conf:settings", namespace="CELERY")
# Finds django_idempotency.tasks (which re-exports django_idempotency.contrib.celery)
# through INSTALLED_APPS.
app.autodiscover_tasks()
