from __future__ import annotations

from django.apps import AppConfig


class BenchConfig(AppConfig):
    name = "benchmarks.bench"
    label = "bench"
    default_auto_field = "django.db.models.BigAutoField"
