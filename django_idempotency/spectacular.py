"""Re-exports :mod:`django_idempotency.contrib.spectacular` (OpenAPI through drf-spectacular).

Kept so that code naming the old path goes on working; the app's
``ready()`` imports the new one, which registers the schema extension.
"""

from __future__ import annotations

from django_idempotency.contrib.spectacular import IdempotencyViewExtension

__all__ = ["IdempotencyViewExtension"]
