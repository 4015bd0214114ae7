"""Settings for the gunicorn processes the server tests start.

The same as the test settings, pointed at the database pytest-django
created for the run, whose name the test passes in the environment. The
processes are separate, so they cannot learn the name any other way.
"""

from __future__ import annotations

import os

from tests.server import DATABASE_NAME_ENV
from tests.settings import *  # noqa: F403
from tests.settings import DATABASES as _TEST_DATABASES

DATABASES = {"default": {**_TEST_DATABASES["default"], "NAME": os.environ[DATABASE_NAME_ENV]}}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
}
