"""Errors a protected request, function or task can end in, one class per outcome.

Plain views answer them as RFC 9457 ``application/problem+json``; DRF views
hand the matching :mod:`django_idempotency.contrib.drf` exceptions to the
project's exception handler. Functions and tasks raise :data:`CALL_ERRORS`
(and, in lease mode, ``LeaseLost``), which are no HTTP answers.
"""

from __future__ import annotations

import math

from django_idempotency.conf import idempotency_settings
from django_idempotency.fields import KEY_COLUMN_LENGTH

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
        """The problem ``type``: a stable URN, or a page under ``PROBLEM_TYPE_BASE_URL``."""
        base = idempotency_settings.problem_type_base_url
        return (base or PROBLEM_TYPE_BASE) + self.code.replace("_", "-")

    def headers(self) -> dict[str, str]:
        # A URN names nothing to fetch; the IETF draft's examples link a URL this way.
        if idempotency_settings.problem_type_base_url is None:
            return {}
        return {"Link": f'<{self.type_uri}>; rel="describedby"'}


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
        f"The Idempotency-Key header must hold 1 to {KEY_COLUMN_LENGTH} visible ASCII characters, "
        'bare or as a quoted string ("key").'
    )


class InFlight(IdempotencyError):
    """The original with this key is still running; ``retry_after`` says when to come back."""

    status = 409

    def __init__(self, detail: str | None = None, retry_after: float = 1) -> None:
        super().__init__(detail)
        #: Whole seconds, at least 1.
        self.retry_after = max(1, math.ceil(retry_after))

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "Retry-After": str(self.retry_after)}


class RequestInFlight(InFlight):
    title = "Request in progress"
    code = "request_in_flight"
    default_detail = (
        "A request with this idempotency key is still being processed. "
        "Retry after the number of seconds in Retry-After."
    )


class LeaseLost(InFlight):
    """The claim is no longer this request's: its lease ran out and another took it over.

    Raised in lease mode by ``request.idempotency.checkpoint()`` and
    ``heartbeat()``, before the handler's next effect. Let it propagate: the request answers
    409 and the new owner's result is the one stored.
    """

    title = "Lease lost"
    code = "lease_lost"
    default_detail = (
        "This request's claim on its idempotency key ran out and another request took "
        "the key over; that request's answer is the one stored. Retry after the number "
        "of seconds in Retry-After to get it."
    )


class RequestAbandoned(InFlight):
    """The original request with this key stopped before it finished, and is held.

    Answered by ``django_idempotency.recovery.hold``: the key stays claimed
    until an operator decides what the abandoned request did.
    """

    title = "Request abandoned"
    code = "request_abandoned"
    default_detail = (
        "The original request with this idempotency key stopped before it finished, "
        "and its outcome is being checked. Retry later; the answer will be the "
        "original's once it is settled."
    )

    def __init__(self, detail: str | None = None, retry_after: float = 60) -> None:
        super().__init__(detail, retry_after)


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


class CallInFlight(InFlight):
    """An ``idempotent_function``'s original call with this key is still running."""

    title = "Call in progress"
    code = "call_in_flight"
    default_detail = (
        "A call with this idempotency key is still running. Call again after retry_after seconds."
    )


class CallAbandoned(CallInFlight):
    """An ``idempotent_function``'s or task's original stopped before it finished, and is held.

    Raised by ``django_idempotency.recovery.hold_call``; Celery retries a task's duplicate.
    """

    title = "Call abandoned"
    code = "call_abandoned"
    default_detail = (
        "The original call with this idempotency key stopped before it finished, and "
        "its outcome is being checked. Call again later."
    )


class ArgumentsMismatch(IdempotencyError):
    """An ``idempotent_function``'s key was already used with different arguments."""

    status = 422
    title = "Idempotency key reused with different arguments"
    code = "arguments_mismatch"
    default_detail = (
        "This idempotency key was already used with different arguments; the "
        "original's result stands. Give different work a different key."
    )


class TaskInFlight(CallInFlight):
    """An idempotent task's original is still running; Celery retries the duplicate."""

    title = "Task in progress"
    code = "task_in_flight"
    default_detail = (
        "A task with this idempotency key is still running. This message is "
        "retried later; raise the task's max_retries if its body runs long."
    )


class TaskArgumentsMismatch(ArgumentsMismatch):
    """An idempotent task's key was already used with different arguments."""

    code = "task_arguments_mismatch"
    default_detail = (
        "This idempotency key was already used by this task with different "
        "arguments. Give different work a different key."
    )


class ResultNotStored(IdempotencyError):
    """Lease mode: the first request with this key ran, but its response could not be kept.

    The key is completed with this answer, since the handler has acted: it
    runs again only if an operator releases or deletes the record.
    """

    status = 500
    title = "Result not stored"
    code = "result_not_stored"
    default_detail = (
        "The first request with this Idempotency-Key ran, but its response could not be "
        "rendered or stored, so it cannot be repeated. The request is not run again for "
        "this key: use a new key for new work, or ask an operator to delete its record "
        "(manage.py idempotency_keys delete)."
    )


class UnstorableResult(IdempotencyError):
    """An idempotent function or task returned a value that cannot be stored as JSON."""

    title = "Result cannot be stored"
    code = "unstorable_result"
    default_detail = (
        "An idempotent function or task must return a JSON-serialisable value "
        "(or None), since duplicates get the stored value back."
    )


#: The errors a view answers with, each a problem ``type`` of its own.
PROBLEM_TYPES: tuple[type[IdempotencyError], ...] = (
    IdempotencyKeyRequired,
    InvalidIdempotencyKey,
    RequestInFlight,
    LeaseLost,
    RequestAbandoned,
    DatabaseBusy,
    FingerprintMismatch,
    ResultNotStored,
)
#: Raised to the caller of an idempotent function or task.
CALL_ERRORS: tuple[type[IdempotencyError], ...] = (
    CallInFlight,
    ArgumentsMismatch,
    UnstorableResult,
)
