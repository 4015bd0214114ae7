"""Settings for ``db_worker`` processes of ``django-tasks-db`` and the commands beside them.

The server settings (the test database, whose name the test passes in the
environment), with the database backend of Django's Tasks framework as the
default backend. On Django 5.2 the framework is the ``django-tasks``
backport, an app of its own.
"""

from __future__ import annotations

from importlib.util import find_spec

from tests.server_settings import *  # noqa: F403
from tests.server_settings import INSTALLED_APPS as _INSTALLED_APPS

_BACKPORT = [] if find_spec("django.tasks") else ["django_tasks"]
INSTALLED_APPS = [*_INSTALLED_APPS, *_BACKPORT, "django_tasks_db"]
TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}
