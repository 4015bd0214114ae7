"""What lease mode keeps of a key's progress: how many owners it had, and their checkpoints."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0002_postgresql_fillfactor")]

    operations = [
        migrations.AddField(
            model_name="idempotencykey",
            name="attempt",
            field=models.PositiveIntegerField(default=1, verbose_name="attempt"),
        ),
        migrations.AddField(
            model_name="idempotencykey",
            name="checkpoints",
            field=models.JSONField(blank=True, null=True, verbose_name="checkpoints"),
        ),
    ]
