"""A demo user and API token, so the walkthrough and curl lines work at once."""

from django.contrib.auth.hashers import make_password
from django.db import migrations

DEMO_TOKEN = "demo" + "0" * 36  # the walkthrough and the README use it


def create_demo_user(apps, schema_editor):
    User = apps.get_model("auth", "User")
    Token = apps.get_model("authtoken", "Token")
    user, _ = User.objects.get_or_create(
        username="demo", defaults={"password": make_password("demo")}
    )
    Token.objects.get_or_create(user=user, defaults={"key": DEMO_TOKEN})


class Migration(migrations.Migration):
    dependencies = [
        ("shop", "0002_booking_payment"),
        ("authtoken", "0003_tokenproxy"),
        ("auth", "0012_alter_user_first_name_max_length"),
    ]

    operations = [migrations.RunPython(create_demo_user, migrations.RunPython.noop)]
