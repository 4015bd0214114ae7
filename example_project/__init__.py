"""The example shop; its Celery app loads with Django when Celery is installed."""

from __future__ import annotations

try:
    from example_project.celery import app as celery_app
except ModuleNotFoundError as exc:  # pragma: no cover - exercised in a subprocess
    # Celery is optional: without it the project still serves requests.
    if exc.name != "celery":
        raise
    celery_app = None

__all__ = ["celery_app"]
