"""The suite's ``flush``: what Django runs after each transactional test, without the rewrite.

Django's ``flush`` empties every table and then sends ``post_migrate``, so that contenttypes
and auth write their rows again: dozens of queries after every one of the suite's
transactional tests. This one leaves those two tables alone and sends nothing while they
still hold as many rows as after the last full flush; a test that added or removed one gets
Django's own flush.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.core.management.color import no_style
from django.core.management.commands import flush
from django.db import connections
from django.db.models import Count, Max
from django.db.models.base import ModelBase

#: Rows that ``post_migrate`` writes, and the suite only reads.
WRITTEN_BY_MIGRATE: tuple[ModelBase, ...] = (ContentType, Permission)

#: Per database: what those tables held after the last full flush.
_after_full_flush: dict[str, tuple[Any, ...]] = {}


def _held(database: str) -> tuple[Any, ...]:
    return tuple(
        tuple(model.objects.using(database).aggregate(n=Count("pk"), top=Max("pk")).values())
        for model in WRITTEN_BY_MIGRATE
    )


class Command(flush.Command):
    def handle(self, **options: Any) -> None:
        database = options["database"]
        if options["interactive"] or _after_full_flush.get(database) != _held(database):
            super().handle(**options)
            _after_full_flush[database] = _held(database)
            return
        connection = connections[database]
        kept = {model._meta.db_table for model in WRITTEN_BY_MIGRATE}
        tables = [
            table
            for table in connection.introspection.django_table_names(
                only_existing=True, include_views=False
            )
            if table not in kept
        ]
        if connection.vendor == "postgresql" and not options.get("reset_sequences", True):
            # DELETE, not TRUNCATE: a few rows go faster than new files for every table.
            # Django's foreign keys there are checked at COMMIT, so the order is free.
            quote = connection.ops.quote_name
            statements = [f"DELETE FROM {quote(table)}" for table in tables]
        else:
            statements = connection.ops.sql_flush(
                no_style(),
                tables,
                reset_sequences=options.get("reset_sequences", True),
                allow_cascade=options.get("allow_cascade", False),
            )
        connection.ops.execute_sql_flush(statements)
