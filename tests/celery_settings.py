"""Settings for the test suite's Celery worker: the suite's, on its test database.

pytest-django creates the test database (``test_<NAME>``, or a per-process
SQLite file) in the test process; the worker fixture passes its name here so
the worker reads and deletes the same rows the test wrote.
"""

from __future__ import annotations

import os

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES

DATABASES["default"]["NAME"] = os.environ["IDEMPOTENCY_TEST_DATABASE_NAME"]
