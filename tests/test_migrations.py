from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.test import override_settings


class MigrationTests:
    @pytest.mark.django_db
    def test_models_and_migrations_agree(self):
        call_command(
            "makemigrations", "django_idempotency", "--check", "--dry-run", stdout=StringIO()
        )

    @pytest.mark.django_db
    @override_settings(DEFAULT_AUTO_FIELD="django.db.models.BigAutoField")
    def test_project_default_auto_field_does_not_ask_for_a_migration(self):
        call_command(
            "makemigrations", "django_idempotency", "--check", "--dry-run", stdout=StringIO()
        )
