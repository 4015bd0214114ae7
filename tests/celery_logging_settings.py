"""Settings for a worker of :mod:`tests.celery_project`: the suite's, with a project's LOGGING.

The environment picks where the project puts its handler
(:data:`~tests.worker_logging.LOGGING_ENV`): ``package``, on the
``django_idempotency`` logger (at DEBUG), or ``root``, on the root logger
with ``django_idempotency`` at DEBUG propagating to it, as many projects
write it; and whether Celery hijacks the root logger
(:data:`~tests.worker_logging.HIJACK_ENV`).
"""

from __future__ import annotations

import os

from kombu import Queue

from tests.celery_app import BROKER_ENV, QUEUE_ENV
from tests.celery_settings import *  # noqa: F403
from tests.worker_logging import HIJACK_ENV, LOGGING_ENV

CELERY_BROKER_URL = os.environ[BROKER_ENV]
CELERY_RESULT_BACKEND = CELERY_BROKER_URL if CELERY_BROKER_URL.startswith("redis") else "rpc://"
CELERY_TASK_DEFAULT_QUEUE = os.environ[QUEUE_ENV]
# Declared as the publishing side (tests.celery_app) declares it.
CELERY_TASK_QUEUES = [Queue(CELERY_TASK_DEFAULT_QUEUE, expires=600.0)]
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = False
if os.environ.get(HIJACK_ENV) == "0":
    CELERY_WORKER_HIJACK_ROOT_LOGGER = False

_handler = {"class": "logging.StreamHandler", "formatter": "json"}
_formatters = {"json": {"()": "tests.worker_logging.JsonFieldsFormatter"}}
if os.environ.get(LOGGING_ENV, "package") == "package":
    LOGGING = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": _formatters,
        "handlers": {"json": _handler},
        "loggers": {"django_idempotency": {"handlers": ["json"], "level": "DEBUG"}},
    }
else:
    LOGGING = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": _formatters,
        "handlers": {"json": _handler},
        "root": {"handlers": ["json"], "level": "INFO"},
        "loggers": {"django_idempotency": {"level": "DEBUG"}},
    }
