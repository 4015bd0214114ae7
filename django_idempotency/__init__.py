"""Make unsafe HTTP requests safe to retry: one effect per ``Idempotency-Key``."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # What __getattr__ below gives, for type checkers and editors.
    from django_idempotency.decorators import idempotent
    from django_idempotency.functions import idempotent_function
    from django_idempotency.marks import idempotency_exempt

__all__ = ["__version__", "idempotency_exempt", "idempotent", "idempotent_function"]

try:
    # The version is declared once, in pyproject.toml.
    __version__ = version("django-idempotency")
except PackageNotFoundError:  # pragma: no cover - imported from a checkout that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str) -> Any:
    # Imported lazily so that listing the app in INSTALLED_APPS never imports
    # the model before the app registry is ready.
    if name == "idempotent":
        from django_idempotency.decorators import idempotent

        return idempotent
    if name == "idempotent_function":
        from django_idempotency.functions import idempotent_function

        return idempotent_function
    if name == "idempotency_exempt":
        from django_idempotency.marks import idempotency_exempt

        return idempotency_exempt
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
