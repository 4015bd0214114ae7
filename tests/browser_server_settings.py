"""Settings for the servers a browser drives: the test database, CSRF on, POSTs counted."""

from __future__ import annotations

from tests.server_settings import *  # noqa: F403
from tests.server_settings import DATABASES as _SERVER_DATABASES
from tests.server_settings import MIDDLEWARE as _MIDDLEWARE

ROOT_URLCONF = "tests.browser_urls"
MIDDLEWARE = [
    "tests.browser_views.CountPosts",
    *_MIDDLEWARE,
    "django.middleware.csrf.CsrfViewMiddleware",
]

_default = _SERVER_DATABASES["default"]
if _default["ENGINE"] == "django.db.backends.sqlite3":
    # The workers share the test database's file: a write waits for another's.
    _default = {**_default, "OPTIONS": {**_default["OPTIONS"], "timeout": 20}}
DATABASES = {"default": _default}
