"""Settings for the test suite; ``TEST_DATABASE`` picks the backend.

``sqlite`` (the default), ``postgresql`` or ``mariadb``. Server backends
read ``TEST_DATABASE_HOST``/``_PORT``/``_USER``/``_PASSWORD``/``_NAME`` and
default to the local services on 127.0.0.1. ``TEST_POSTGRESQL_PREPARED=1``
runs PostgreSQL with server-side binding and prepared statements.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

BACKEND = os.environ.get("TEST_DATABASE", "sqlite")
HOST = os.environ.get("TEST_DATABASE_HOST", "127.0.0.1")
# Django prefixes "test_"; a distinct name lets several runs share a server.
NAME = os.environ.get("TEST_DATABASE_NAME", "idempotency")


def _database(suffix: str = "") -> dict:
    if BACKEND == "sqlite":
        # A file, not :memory:, so that concurrent tests use real connections
        # and SQLite's real locking. Django removes it after the run.
        name = f"django-idempotency-test-{os.getpid()}{suffix}.sqlite3"
        path = Path(tempfile.gettempdir()) / name
        options: dict[str, object] = {"timeout": 5, "transaction_mode": "IMMEDIATE"}
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(path),
            "OPTIONS": options,
            "TEST": {"NAME": str(path)},
        }
    if BACKEND == "postgresql":
        database: dict[str, object] = {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": NAME + suffix,
            "HOST": HOST,
            "PORT": os.environ.get("TEST_DATABASE_PORT", "5432"),
            "USER": os.environ.get("TEST_DATABASE_USER", "postgres"),
            "PASSWORD": os.environ.get("TEST_DATABASE_PASSWORD", ""),
        }
        if os.environ.get("TEST_POSTGRESQL_PREPARED") == "1":
            # Server-side binding, every statement prepared from its first use
            # (see "Performance" in docs/backends.rst).
            database["OPTIONS"] = {"server_side_binding": True, "prepare_threshold": 0}
        return database
    if BACKEND == "mariadb":
        return {
            "ENGINE": "django.db.backends.mysql",
            "NAME": NAME + suffix,
            "HOST": HOST,
            "PORT": os.environ.get("TEST_DATABASE_PORT", "3306"),
            "USER": os.environ.get("TEST_DATABASE_USER", "root"),
            "PASSWORD": os.environ.get("TEST_DATABASE_PASSWORD", ""),
            "OPTIONS": {"charset": "utf8mb4"},
            # The usual case-insensitive default, so the suite proves that
            # keys and scopes still compare exactly.
            "TEST": {"CHARSET": "utf8mb4", "COLLATION": "utf8mb4_unicode_ci"},
        }
    raise ValueError(f"TEST_DATABASE must be sqlite, postgresql or mariadb, not {BACKEND!r}")


SECRET_KEY = "tests-only-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
TIME_ZONE = "UTC"
# "other" is created only for tests that ask for it: IDEMPOTENCY["DATABASE"]
# pointing away from "default".
DATABASES = {"default": _database(), "other": _database("_other")}
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
ROOT_URLCONF = "tests.urls"
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.admin",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "django_idempotency",
    "tests",
    # The example shop's fake payment provider, which the recovery tests charge.
    "example_project.provider",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}
