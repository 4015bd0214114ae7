"""How long a lease-mode claim left in progress is kept for the retry that resumes it."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("django_idempotency", "0003_recovery_progress")]

    operations = [
        migrations.AddField(
            model_name="idempotencykey",
            name="retained_until",
            field=models.DateTimeField(blank=True, null=True, verbose_name="retained until"),
        ),
    ]
