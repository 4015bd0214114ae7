"""Make unsafe HTTP requests safe to retry: one effect per ``Idempotency-Key``."""

from __future__ import annotations

from typing import Any

__all__ = ["idempotency_exempt", "idempotent"]


def __getattr__(name: str) -> Any:
    # Imported lazily so that listing the app in INSTALLED_APPS never imports
    # the model before the app registry is ready.
    if name == "idempotent":
        from django_idempotency.decorators import idempotent

        return idempotent
    if name == "idempotency_exempt":
        from django_idempotency.middleware import idempotency_exempt

        return idempotency_exempt
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
