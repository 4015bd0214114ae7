"""Leave room on each PostgreSQL page for the update that stores the response.

The response is written by an update of the row the claim inserted. With
free space on the page and no indexed column changed, PostgreSQL makes that
a heap-only (HOT) update, which skips writing new index entries.
"""

from django.apps.registry import Apps
from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor


def _alter(apps: Apps, schema_editor: BaseDatabaseSchemaEditor, change: str) -> None:
    if schema_editor.connection.vendor == "postgresql":
        table = apps.get_model("django_idempotency", "IdempotencyKey")._meta.db_table
        schema_editor.execute(f"ALTER TABLE {schema_editor.quote_name(table)} {change}")


def set_fillfactor(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    _alter(apps, schema_editor, "SET (fillfactor = 90)")


def reset_fillfactor(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    _alter(apps, schema_editor, "RESET (fillfactor)")


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0001_initial")]

    operations = [migrations.RunPython(set_fillfactor, reset_fillfactor)]
