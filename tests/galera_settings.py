"""Settings for the gunicorn servers of the Galera tests: one node of the cluster each.

The node's SQL port and the database's name come from the environment,
which the test sets per server.
"""

from __future__ import annotations

import os

from tests.galera import ATOMIC_REQUESTS_ENV, NODE_ENV
from tests.server import DATABASE_NAME_ENV
from tests.settings import *  # noqa: F403

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.mysql",
        "NAME": os.environ[DATABASE_NAME_ENV],
        "HOST": os.environ.get("TEST_GALERA_HOST", "127.0.0.1"),
        "PORT": os.environ[NODE_ENV],
        "USER": os.environ.get("TEST_GALERA_USER", "root"),
        "PASSWORD": os.environ.get("TEST_GALERA_PASSWORD", ""),
        "OPTIONS": {"charset": "utf8mb4"},
        "ATOMIC_REQUESTS": os.environ.get(ATOMIC_REQUESTS_ENV) == "1",
    }
}
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_idempotency",
    "tests",
]
# It protects the views at middleware/ and function-in-middleware/: the others protect
# themselves, or (function/) are exempt.
MIDDLEWARE = ["django_idempotency.middleware.IdempotencyMiddleware"]
ROOT_URLCONF = "tests.galera_views"
# The DRF views take anyone, and answer JSON alone.
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.AllowAny"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
}
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
}
