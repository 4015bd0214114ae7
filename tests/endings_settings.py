"""Settings for the servers and callers of the endings table: gunicorn and uvicorn on one URLconf.

The server settings (the test database, whose name the test passes in the
environment), with the middleware installed, a middleware after it that can
hold a response, Django's tasks run at once, a short lease and a short wait,
so that a cell waits seconds, not minutes. On SQLite the servers share the test database's file:
the busy timeout is generous, so that a write waits for another process's
rather than fail.
"""

from __future__ import annotations

from importlib.util import find_spec

from tests.server_settings import *  # noqa: F403
from tests.server_settings import DATABASES as _SERVER_DATABASES
from tests.server_settings import MIDDLEWARE as _MIDDLEWARE

ROOT_URLCONF = "tests.endings_urls"
MIDDLEWARE = [
    *_MIDDLEWARE,
    "django_idempotency.middleware.IdempotencyMiddleware",
    "tests.endings_views.SlowResponseMiddleware",
]
#: Seconds. A dead owner's claim holds this long; a duplicate waits WAIT at most.
LEASE_SECONDS = 2
IDEMPOTENCY = {"LEASE": LEASE_SECONDS, "WAIT": 1}
# The calling processes enqueue tasks of Django's Tasks framework (or, on
# Django 5.2, of its backport) and run them at once.
_TASKS = "django.tasks" if find_spec("django.tasks") else "django_tasks"
TASKS = {"default": {"BACKEND": f"{_TASKS}.backends.immediate.ImmediateBackend"}}

_default = _SERVER_DATABASES["default"]
if _default["ENGINE"] == "django.db.backends.sqlite3":
    _default = {**_default, "OPTIONS": {**_default["OPTIONS"], "timeout": 20}}
DATABASES = {"default": _default}
