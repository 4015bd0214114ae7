from django.apps import AppConfig


class ProviderConfig(AppConfig):
    name = "example_project.provider"
    verbose_name = "Fake payment provider"
    default_auto_field = "django.db.models.BigAutoField"
