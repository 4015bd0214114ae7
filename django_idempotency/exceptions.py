"""Errors a protected request can end in, one class per HTTP outcome.

Plain Django views answer them as RFC 9457 ``application/problem+json``;
DRF views get the matching :mod:`django_idempotency.drf` exceptions so the
project's own exception handler renders them.
"""

from __future__ import annotations

import math

PROBLEM_TYPE_BASE = "urn:django-idempotency:problem:"


class IdempotencyError(Exception):
    """Base class; ``status``, ``title`` and ``code`` describe the HTTP answer."""

    status: int = 400
    title: str = "Idempotency error"
    code: str = "idempotency_error"
    default_detail: str = ""

    def __init__(self, detail: str | None = None) -> None:
        self.detail = detail or self.default_detail
        super().__init__(self.detail)

    @property
    def type_uri(self) -> str:
        return PROBLEM_TYPE_BASE + self.code.replace("_", "-")

    def headers(self) -> dict[str, str]:
        return {}


class IdempotencyKeyRequired(IdempotencyError):
    status = 400
    title = "Idempotency key required"
    code = "idempotency_key_required"
    default_detail = "This endpoint requires an Idempotency-Key header."


class InvalidIdempotencyKey(IdempotencyError):
    status = 400
    title = "Invalid idempotency key"
    code = "invalid_idempotency_key"
    default_detail = (
        "The Idempotency-Key header must hold 1 to 255 visible ASCII characters, "
        'bare or as a quoted string ("key").'
    )


class RequestInFlight(IdempotencyError):
    status = 409
    title = "Request in progress"
    code = "request_in_flight"
    default_detail = (
        "A request with this idempotency key is still being processed. "
        "Retry after the number of seconds in Retry-After."
    )

    def __init__(self, detail: str | None = None, retry_after: float = 1) -> None:
        super().__init__(detail)
        self.retry_after = max(1, math.ceil(retry_after))

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class DatabaseBusy(RequestInFlight):
    """SQLite's one write lock was held by another request for longer than ``WAIT``.

    A 409 like :class:`RequestInFlight`, which clients already retry after
    ``Retry-After``: on SQLite the lock's holder may be this key's original
    or a request for any other key, and the two cannot be told apart.
    """

    title = "Database busy"
    code = "database_busy"
    default_detail = (
        "The database is busy with another request and this one was not processed. "
        "Retry after the number of seconds in Retry-After."
    )


class FingerprintMismatch(IdempotencyError):
    status = 422
    title = "Idempotency key reused"
    code = "idempotency_key_reused"
    default_detail = (
        "This idempotency key was already used for a different request. "
        "Send a new key for a new request."
    )
