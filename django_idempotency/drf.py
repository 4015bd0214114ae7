"""Re-exports :mod:`django_idempotency.contrib.drf`, where the DRF integration lives.

Kept so that ``from django_idempotency.drf import IdempotentMixin`` goes on
working; new code imports from ``django_idempotency.contrib.drf``.
"""

from __future__ import annotations

from django_idempotency.contrib.drf import (
    FingerprintMismatch,
    IdempotencyKeyRequired,
    IdempotentMixin,
    InvalidIdempotencyKey,
    RequestInFlight,
    to_api_exception,
)

__all__ = [
    "FingerprintMismatch",
    "IdempotencyKeyRequired",
    "IdempotentMixin",
    "InvalidIdempotencyKey",
    "RequestInFlight",
    "to_api_exception",
]
