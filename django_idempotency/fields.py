"""A CharField that compares byte for byte on every backend."""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.backends.base.base import BaseDatabaseWrapper


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
