"""Settings for the gunicorn a browser drives the admin on: the browser servers', with the admin.

The admin's own stylesheets and scripts are served too (``tests.admin_urls``),
so that the browser runs the change list as an operator's does.
"""

from __future__ import annotations

from tests.browser_server_settings import *  # noqa: F403

ROOT_URLCONF = "tests.admin_urls"
STATIC_URL = "/static/"
