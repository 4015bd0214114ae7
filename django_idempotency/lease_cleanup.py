"""Releasing a lease whose stored response rolled back with the request.

On its own connection (see :mod:`django_idempotency.lease_connection`),
lease mode stores the response inside the request's transaction, so that
the record and the view's writes commit together. If that transaction
rolls back after the view returned (a deferred constraint failing at
``COMMIT``, an exception later in the request), the record is still the
claim committed before the view ran: it is released when the request
ends, so that a retry runs again rather than get 409 until the lease runs
out (see ``docs/decorator.rst``).

A view's release is tied to its request object, and runs when Django
closes it: under ASGI, Django runs the view in a task of its own and closes
the request from another, and each sees a different context. A function
has no request of its own: when it is called inside a request cycle under
WSGI, its release runs when that cycle ends (``request_finished``).
Outside a request cycle (a worker, a consumer, a script) nothing would ask:
nothing is kept, and the key stays claimed until its lease runs out.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

from django.core.signals import request_finished, request_started
from django.db import connections, transaction

from django_idempotency.body import django_request, when_closed

Release = Callable[[], None]

# The releases of the functions called in this request cycle; ``None``
# outside one. A context variable, set by request_started in the request's
# thread under WSGI. Under ASGI Django sends request_started in a copy of
# the request's context, which the view does not see: there a function's
# key stays claimed until its lease runs out.
_pending: contextvars.ContextVar[list[Release] | None] = contextvars.ContextVar(
    "django_idempotency_pending_leases", default=None
)


def release_unless_committed(using: str, release: Release, request: Any) -> None:
    """Call ``release`` when the request ends, unless ``using``'s transaction committed.

    ``request`` is the view's request, or ``None`` for a function's call.
    """
    if not in_request_cycle(request):
        return  # nothing would ask
    committed: list[bool] = []
    transaction.on_commit(lambda: committed.append(True), using=using)

    def release_if_rolled_back() -> None:
        if not committed:
            release()

    at_request_end(using, release_if_rolled_back, request)


def in_request_cycle(request: Any) -> bool:
    """Whether :func:`at_request_end` has a request cycle to wait for."""
    return request is not None or _pending.get() is not None


def at_request_end(using: str, then: Release, request: Any) -> None:
    """Call ``then`` when the request ends, if ``using``'s transactions have ended by then.

    A transaction still open then (a test wrapping the request) is not this
    request's to decide about. Outside a request cycle, nothing is called.
    """
    pending = _pending.get() if request is None else None
    if request is None and pending is None:
        return

    def when_ended() -> None:
        if not connections[using].in_atomic_block:
            then()

    if pending is not None:
        pending.append(when_ended)
    else:
        when_closed(django_request(request), when_ended)


def _request_started(**kwargs: Any) -> None:
    _pending.set([])


def _request_finished(**kwargs: Any) -> None:
    pending = _pending.get()
    _pending.set(None)
    for release in pending or ():
        release()


request_started.connect(_request_started, dispatch_uid="django_idempotency.lease_cleanup.started")
request_finished.connect(
    _request_finished, dispatch_uid="django_idempotency.lease_cleanup.finished"
)
