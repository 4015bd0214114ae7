"""System checks for the database that holds the key table.

What a backend cannot do, or a configuration that turns a duplicate's 409
into a 500, is reported at start-up rather than on every request. See
docs/backends.rst; what a Galera cluster needs (a check that connects, so
it runs with the database checks: ``migrate``, ``check --database``) is in
docs/scaling.rst.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_idempotency.conf import DEFAULTS, SETTING_NAME
from django_idempotency.store import galera_sync_wait

#: SQLite 3.35 added ``RETURNING``, which the claim statement uses.
SQLITE_MIN_VERSION = (3, 35)


def _linked_sqlite_version(connection: BaseDatabaseWrapper) -> tuple[int, ...]:
    """The version of the SQLite library the connection's driver is linked with."""
    return tuple(connection.Database.sqlite_version_info)  # type: ignore[attr-defined]


def _alias() -> str | None:
    """The alias holding the records, if the setting names a configured database."""
    user = getattr(settings, SETTING_NAME, {})
    alias = user.get("DATABASE", DEFAULTS["DATABASE"]) if isinstance(user, dict) else None
    if not isinstance(alias, str) or alias not in settings.DATABASES:
        return None
    return alias


def check_backend(
    app_configs: Any = None,
    *,
    sqlite_version: Callable[[BaseDatabaseWrapper], tuple[int, ...]] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """Report what the idempotency database cannot do; ``sqlite_version`` is for tests."""
    alias = _alias()
    if alias is None:
        return []  # reported by check_settings
    connection = connections[alias]  # no connection is opened
    messages: list[CheckMessage] = _naive_clock(alias, connection)
    if connection.vendor != "sqlite":
        return messages
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


def _naive_clock(alias: str, connection: BaseDatabaseWrapper) -> list[CheckMessage]:
    """Refuse datetimes the database's UTC clock cannot be compared with.

    Leases and expiries are decided by the database's clock, in UTC
    (SPEC 4.2). PostgreSQL stores instants, whatever Django's settings;
    SQLite and MySQL/MariaDB store the wall time Django hands them, which
    is UTC only with ``USE_TZ = True`` and no other ``TIME_ZONE`` for the
    database.
    """
    if connection.vendor not in ("sqlite", "mysql"):
        return []
    zone = connection.settings_dict.get("TIME_ZONE")
    if settings.USE_TZ and zone in (None, "UTC"):
        return []
    why = "USE_TZ is False" if not settings.USE_TZ else f"its TIME_ZONE is {zone!r}"
    return [
        Error(
            f"Database {alias!r} stores datetimes as local wall time ({why}), but "
            "django-idempotency compares expiries and leases with the database's clock "
            "in UTC: records would expire, and leases run out, hours early or late.",
            hint="Set USE_TZ = True (Django's default) and leave this database's "
            "TIME_ZONE unset (or 'UTC'), or keep the records in a PostgreSQL database "
            "(IDEMPOTENCY['DATABASE']).",
            id="django_idempotency.E203",
        )
    ]


def check_galera(
    app_configs: Any = None, *, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """On a MariaDB Galera node: what holds across its nodes, and ``ATOMIC_REQUESTS`` refused.

    A database check: it asks the server (``wsrep_on``), so Django runs it
    only where the databases are checked (``migrate``, ``check --database``).
    """
    alias = _alias()
    if alias is None or not databases or alias not in databases:
        return []
    connection = connections[alias]
    if connection.vendor != "mysql" or not connection.mysql_is_mariadb:  # type: ignore[attr-defined]
        return []
    if not galera_sync_wait(connection):
        return []
    messages: list[CheckMessage] = [
        Warning(
            f"Database {alias!r} is a node of a MariaDB Galera cluster. Claims wait until "
            "the node has applied what other nodes committed, and a request that loses "
            "its key to another node is rolled back and answered as a duplicate; but "
            "duplicates that reach two nodes at the same moment can both run an "
            "atomic-mode handler (one commits), so anything it does outside the database "
            "happens twice.",
            hint="For one run per key, send this database's writes to one node (a proxy "
            "in single-writer mode), or use lease mode (atomic=False). Leave "
            "wsrep_sync_wait as it is. See 'Scaling past one database' in the docs.",
            id="django_idempotency.W202",
        )
    ]
    if connection.settings_dict.get("ATOMIC_REQUESTS"):
        messages.append(
            Error(
                f"Database {alias!r} is a Galera node with ATOMIC_REQUESTS: the request's "
                "COMMIT is Django's, so a duplicate that loses its key to another node "
                "fails there (error 1213) with a 500 that django-idempotency cannot answer.",
                hint="Turn ATOMIC_REQUESTS off for this database: atomic mode already "
                "commits a protected view's effect together with its record, and rolls "
                "back and answers a lost race itself.",
                id="django_idempotency.E202",
            )
        )
    return messages
