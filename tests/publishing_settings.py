"""Settings for uvicorn processes whose views publish Celery tasks.

The ASGI settings, plus ``CELERY_*`` settings that point at the broker and
queue the test's worker listens on (from the environment), read by a
project-style Celery app (:mod:`tests.celery_project`) loaded with the
settings, as a project's ``celery.py`` is. Every Celery app the process
loads from the Django settings (the example project's too, which the test
settings install) publishes there, whichever of them is current in the
thread that publishes: an async view looks its task up in the event loop's
thread and publishes from the request's.
"""

from __future__ import annotations

import os

from kombu import Queue

from tests.asgi_settings import *  # noqa: F403
from tests.celery_app import BROKER_ENV, QUEUE_ENV

CELERY_BROKER_URL = os.environ[BROKER_ENV]
CELERY_RESULT_BACKEND = CELERY_BROKER_URL if CELERY_BROKER_URL.startswith("redis") else "rpc://"
CELERY_TASK_DEFAULT_QUEUE = os.environ[QUEUE_ENV]
# Declared as the worker's side (tests.celery_app) declares it.
CELERY_TASK_QUEUES = [Queue(CELERY_TASK_DEFAULT_QUEUE, expires=600.0)]

import tests.celery_project  # noqa: E402, F401  the project's Celery app, loaded with its settings
