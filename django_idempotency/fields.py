"""The key table's column types, and the widths that code fitting values into them reads."""

from __future__ import annotations

import hashlib
from typing import Any

from django.db import models
from django.db.backends.base.base import BaseDatabaseWrapper

#: Width of the scope and key columns. Keys are refused beyond it; scopes
#: and task names beyond it are stored as their digest.
KEY_COLUMN_LENGTH = 255
#: Width of the fingerprint column: a SHA-256 hex digest.
FINGERPRINT_COLUMN_LENGTH = 64


DIGEST_PREFIX = "sha256:"


def fit_key_column(value: str) -> str:
    """``value``, or its digest when the scope or key column cannot hold it.

    A digest keeps a long value (a tenant name, a JWT subject, a task's
    name) exact and unique, where truncating it would let two collide. A
    value that looks like a digest is digested too, so that no value can
    be stored as another's: a scope of a tenant's own choosing that spells
    another scope's digest gets a digest of its own.
    """
    if len(value) <= KEY_COLUMN_LENGTH and not value.startswith(DIGEST_PREFIX):
        return value
    return DIGEST_PREFIX + hashlib.sha256(value.encode()).hexdigest()


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
