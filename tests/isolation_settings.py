"""Settings for the servers of the isolation table: gunicorn and uvicorn with the middleware.

The server settings (the test database, whose name the test passes in the
environment) on the isolation URLconf, with ``IdempotencyMiddleware`` last.
The default scope applies (``tests.isolation_session_settings`` has
``session_scope``). On SQLite the servers share the test database's file:
the busy timeout is generous, so that a write waits for another process's
rather than fail.
"""

from __future__ import annotations

from tests.server_settings import *  # noqa: F403
from tests.server_settings import DATABASES as _SERVER_DATABASES
from tests.server_settings import MIDDLEWARE as _MIDDLEWARE

ROOT_URLCONF = "tests.isolation_urls"
MIDDLEWARE = [*_MIDDLEWARE, "django_idempotency.middleware.IdempotencyMiddleware"]

_default = _SERVER_DATABASES["default"]
if _default["ENGINE"] == "django.db.backends.sqlite3":
    _default = {**_default, "OPTIONS": {**_default["OPTIONS"], "timeout": 20}}
DATABASES = {"default": _default}
