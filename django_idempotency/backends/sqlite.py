"""SQLite: one write lock for the whole database, taken at ``BEGIN IMMEDIATE``.

So the claim's wait (the busy timeout) is set before the transaction opens and put back
after.
"""

from __future__ import annotations

from django.db import DatabaseError
from django.db.backends.base.base import BaseDatabaseWrapper

import django_idempotency.backends.base as base


class SQLite(base.Backend):
    waits_at_begin = True

    def prepare(self, connection: BaseDatabaseWrapper, wait: float) -> None:
        """Set the busy timeout to ``wait`` unless it is the connection's (5 s both by default)."""
        connection.ensure_connection()
        # The busy timeout, in ms, that Django opened the connection with.
        own = round(connection.settings_dict.get("OPTIONS", {}).get("timeout", 5.0) * 1000)
        target = max(1, round(wait * 1000))
        if target != own:
            _set_busy_timeout(connection, target)
            connection._idempotency_restore_busy_timeout = own  # type: ignore[attr-defined]

    def restore(self, connection: BaseDatabaseWrapper) -> None:
        own = getattr(connection, "_idempotency_restore_busy_timeout", None)
        if own is None:
            return
        connection._idempotency_restore_busy_timeout = None  # type: ignore[attr-defined]
        if connection.connection is not None:
            _set_busy_timeout(connection, own)

    def meaning(self, exc: DatabaseError) -> Exception | None:
        message = str(exc)
        if "is locked" in message:
            return base.DatabaseLocked(
                "The SQLite database is locked: another connection holds its one write lock."
            )
        return base.missing_table() if "no such table" in message else None


def _set_busy_timeout(connection: BaseDatabaseWrapper, milliseconds: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"PRAGMA busy_timeout = {int(milliseconds)}")
