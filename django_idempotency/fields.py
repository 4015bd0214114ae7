"""The key table's column types, and the widths that code fitting values into them reads.

A value too long for the scope or key column is fitted by
:func:`django_idempotency.scopes.fit_key_column`.
"""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.backends.base.base import BaseDatabaseWrapper

#: Width of the scope and key columns. Keys are refused beyond it; scopes
#: and task names beyond it are stored as their digest.
KEY_COLUMN_LENGTH = 255
#: Width of the fingerprint column: a SHA-256 hex digest.
FINGERPRINT_COLUMN_LENGTH = 64


class ExactCharField(models.CharField):
    """Scopes and keys must compare exactly: ``Acme`` is not ``acme``.

    PostgreSQL's deterministic collations and SQLite's ``BINARY`` already do.
    MySQL and MariaDB compare with the table's collation, usually
    case-insensitive and padding trailing spaces, which would let one tenant
    read another's stored response, so there the column gets a binary,
    no-pad collation of its own.
    """

    def db_type(self, connection: BaseDatabaseWrapper) -> str | None:
        if connection.vendor == "mysql":
            return f"varchar({self.max_length}) CHARACTER SET utf8mb4"
        return super().db_type(connection)

    def db_parameters(self, connection: BaseDatabaseWrapper) -> dict[str, Any]:
        params = super().db_parameters(connection)
        if connection.vendor == "mysql":
            mariadb = getattr(connection, "mysql_is_mariadb", False)
            params["collation"] = "utf8mb4_nopad_bin" if mariadb else "utf8mb4_0900_bin"
        return params
