"""Settings for the gunicorn that the recovery tests kill: the server settings, on every backend.

On SQLite the workers share the test database's file, with a generous busy
timeout, so that a write waits for another process's rather than fail.
"""

from __future__ import annotations

from tests.server_settings import *  # noqa: F403
from tests.server_settings import DATABASES as _SERVER_DATABASES

_default = _SERVER_DATABASES["default"]
if _default["ENGINE"] == "django.db.backends.sqlite3":
    _default = {**_default, "OPTIONS": {**_default["OPTIONS"], "timeout": 20}}
DATABASES = {"default": _default}
