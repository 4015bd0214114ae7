"""System checks for the database that holds the key table.

What a backend cannot do, or a configuration that turns a duplicate's 409
into a 500, is reported at start-up rather than on every request. See
docs/backends.rst.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_idempotency.conf import DEFAULTS, SETTING_NAME

#: SQLite 3.35 added ``RETURNING``, which the claim statement uses.
SQLITE_MIN_VERSION = (3, 35)


def _linked_sqlite_version(connection: BaseDatabaseWrapper) -> tuple[int, ...]:
    """The version of the SQLite library the connection's driver is linked with."""
    return tuple(connection.Database.sqlite_version_info)  # type: ignore[attr-defined]


def check_backend(
    app_configs: Any = None,
    *,
    sqlite_version: Callable[[BaseDatabaseWrapper], tuple[int, ...]] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """Report what the idempotency database cannot do; ``sqlite_version`` is for tests."""
    user = getattr(settings, SETTING_NAME, {})
    alias = user.get("DATABASE", DEFAULTS["DATABASE"]) if isinstance(user, dict) else None
    if not isinstance(alias, str) or alias not in settings.DATABASES:
        return []  # reported by check_settings
    connection = connections[alias]  # no connection is opened
    if connection.vendor != "sqlite":
        return []
    messages: list[CheckMessage] = []
    version = (sqlite_version or _linked_sqlite_version)(connection)
    if version < SQLITE_MIN_VERSION:
        found = ".".join(str(part) for part in version)
        messages.append(
            Error(
                f"Database {alias!r} runs SQLite {found}; django-idempotency needs "
                "SQLite 3.35 or later (for INSERT ... RETURNING).",
                hint="Upgrade the SQLite library Python is linked with, or keep the "
                "idempotency records in another database (IDEMPOTENCY['DATABASE']).",
                id="django_idempotency.E201",
            )
        )
    settings_dict = connection.settings_dict
    mode = str(settings_dict.get("OPTIONS", {}).get("transaction_mode") or "").upper()
    if settings_dict.get("ATOMIC_REQUESTS") and mode == "IMMEDIATE":
        messages.append(
            Warning(
                f"Database {alias!r} is SQLite with ATOMIC_REQUESTS and "
                "transaction_mode 'IMMEDIATE': every request takes the database's one "
                "write lock before any view runs, so a duplicate (or any concurrent "
                "request) waits the connection's timeout and then fails with a 500 "
                "'database is locked' instead of a 409 after WAIT.",
                hint="Turn ATOMIC_REQUESTS off for this database (atomic mode already "
                "commits a protected view's effect with its record), or accept the "
                "500s. See the SQLite section of the backends page in the docs.",
                id="django_idempotency.W201",
            )
        )
    return messages
