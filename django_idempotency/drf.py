"""The DRF integration's public names, where the contract puts them.

``from django_idempotency.drf import IdempotentMixin`` is the documented
import; the integration itself lives in :mod:`django_idempotency.contrib.drf`,
the only module that imports DRF.
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
