"""The statements each database needs, behind one small interface (:class:`.base.Backend`).

``BY_VENDOR`` maps ``connection.vendor`` to its backend; others get the standard one.
"""

from __future__ import annotations

from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created

from django_idempotency.backends.base import Backend
from django_idempotency.backends.mysql import MySQL
from django_idempotency.backends.postgresql import PostgreSQL
from django_idempotency.backends.sqlite import SQLite

BY_VENDOR: dict[str, Backend] = {"postgresql": PostgreSQL(), "mysql": MySQL(), "sqlite": SQLite()}
STANDARD = Backend()


def _forget_connection_state(sender: Any, connection: BaseDatabaseWrapper, **kwargs: Any) -> None:
    """A new database connection starts with the server's settings, not ours.

    Our state lives on Django's wrapper, which outlives its connections; the raw
    connection's ``id()`` is no identity, since CPython reuses a closed one's address.
    """
    connection._idempotency_restore_busy_timeout = None  # type: ignore[attr-defined]
    connection._idempotency_lock_wait = None  # type: ignore[attr-defined]


connection_created.connect(_forget_connection_state, dispatch_uid="django_idempotency.store")
