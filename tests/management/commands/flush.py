"""The suite's ``flush``: what Django runs after each transactional test, without the rewrite.

Django's ``flush`` empties every table and then sends ``post_migrate``, so that contenttypes
and auth write their rows again: dozens of queries after every one of the suite's
transactional tests. This one leaves those two tables alone and sends nothing while they
hold exactly the rows ``post_migrate`` wrote at the last full flush; a test that changed
them, or a flush asked for anything but the plain case, gets Django's own.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.core.management.color import no_style
from django.core.management.commands import flush
from django.db import connections

#: What ``post_migrate`` writes, and the suite only reads: each model with its columns.
WRITTEN_BY_MIGRATE = (
    (ContentType, ("pk", "app_label", "model")),
    (Permission, ("pk", "content_type_id", "codename", "name")),
)

#: Per database: the rows ``post_migrate`` wrote at the last full flush.
_after_post_migrate: dict[str, tuple[Any, ...]] = {}


def _rows(database: str) -> tuple[Any, ...]:
    return tuple(
        tuple(model.objects.using(database).order_by("pk").values_list(*columns))
        for model, columns in WRITTEN_BY_MIGRATE
    )


class Command(flush.Command):
    def handle(self, **options: Any) -> None:
        database = options["database"]
        plain = not (
            options["interactive"]
            or options.get("reset_sequences", True)
            or options.get("allow_cascade", False)
            or options.get("inhibit_post_migrate", False)
        )
        if not plain or _after_post_migrate.get(database) != _rows(database):
            _after_post_migrate.pop(database, None)
            super().handle(**options)
            if plain:
                _after_post_migrate[database] = _rows(database)
            return
        connection = connections[database]
        kept = {model._meta.db_table for model, _ in WRITTEN_BY_MIGRATE}
        tables = [
            table
            for table in connection.introspection.django_table_names(
                only_existing=True, include_views=False
            )
            if table not in kept
        ]
        if connection.vendor == "postgresql":
            # DELETE, not TRUNCATE: a few rows go faster than new files for every table.
            # Django's foreign keys there are checked at COMMIT, so the order is free.
            quote = connection.ops.quote_name
            statements = [f"DELETE FROM {quote(table)}" for table in tables]
        else:
            statements = connection.ops.sql_flush(no_style(), tables)
        connection.ops.execute_sql_flush(statements)
