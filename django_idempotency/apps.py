from __future__ import annotations

from importlib.util import find_spec

from django.apps import AppConfig, apps
from django.core import checks


class DjangoIdempotencyConfig(AppConfig):
    name = "django_idempotency"
    verbose_name = "Idempotency"
    # Pinned so that a project's DEFAULT_AUTO_FIELD never asks for a migration.
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django_idempotency.backend_checks import check_backend, check_galera
        from django_idempotency.checks import (
            check_middleware_order,
            check_middleware_views,
            check_settings,
            check_view_options,
        )

        checks.register(check_settings, checks.Tags.compatibility)
        checks.register(check_middleware_order, checks.Tags.security)
        checks.register(check_backend, checks.Tags.compatibility)
        checks.register(check_galera, checks.Tags.database)
        checks.register(check_view_options, checks.Tags.urls)
        checks.register(check_middleware_views, checks.Tags.urls)
        if find_spec("rest_framework") is not None:
            # Registers DRF's adapter (how DRF requests are answered, which
            # placements it refuses, how its views are protected). A view
            # decorated earlier, in the ready() of an app listed before this
            # one, registered it already (adapters.in_use()).
            import django_idempotency.contrib.drf
        if apps.is_installed("drf_spectacular"):
            # Importing it registers the schema extension: nothing else to configure.
            import django_idempotency.contrib.spectacular  # noqa: F401
