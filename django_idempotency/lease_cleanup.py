"""Releasing a lease whose stored response rolled back with the request.

On its own connection (see :mod:`django_idempotency.lease_connection`),
lease mode stores the response inside the request's transaction, so that
the record and the view's writes commit together. If that transaction
rolls back after the view returned (a deferred constraint failing at
``COMMIT``, an exception later in the request), the record is still the
claim committed before the view ran: it is released when the request
finishes, so that a retry runs again rather than get 409 until the lease
runs out (see ``docs/decorator.rst``).

An entry is dropped as soon as its transaction commits, so a process
that never sends ``request_started`` or ``request_finished`` (a Celery
worker, a message consumer) keeps nothing for the completions it commits.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.core.signals import request_finished, request_started
from django.db import connections, transaction

Release = Callable[[], None]


# Compared by identity: a committed entry removes itself, not an equal one.
@dataclass(eq=False)
class _Pending:
    using: str
    release: Release


# A context variable rather than a thread-local: under ASGI a request's
# view and its end may run on different threads, but in one context.
_pending: contextvars.ContextVar[list[_Pending] | None] = contextvars.ContextVar(
    "django_idempotency_pending_leases", default=None
)


def release_unless_committed(using: str, release: Release) -> None:
    """Call ``release`` at the end of this request unless ``using``'s transaction commits.

    Outside a request cycle (a view called in a script's own
    ``transaction.atomic``, a function in a worker's) nothing calls it:
    the key stays claimed until its lease runs out.
    """
    entries = _pending.get()
    if entries is None:
        # Under ASGI request_started is sent in a copy of the request's
        # context, so the list is made here, in the view's.
        entries = []
        _pending.set(entries)
    pending = _Pending(using, release)
    entries.append(pending)

    def committed() -> None:
        # Committed with the request's transaction: nothing left to release.
        if pending in entries:
            entries.remove(pending)

    transaction.on_commit(committed, using=using)


def _request_started(**kwargs: Any) -> None:
    # Entries left by a request that never finished are not this one's to release.
    _pending.set([])


def _request_finished(**kwargs: Any) -> None:
    entries = _pending.get()
    _pending.set(None)
    for pending in entries or ():
        if connections[pending.using].in_atomic_block:
            # The transaction is still open (a test wrapping the request):
            # not this request's to decide.
            continue
        # Rolled back: on_commit never ran, and the claim is still committed.
        pending.release()


request_started.connect(_request_started, dispatch_uid="django_idempotency.lease_cleanup.started")
request_finished.connect(
    _request_finished, dispatch_uid="django_idempotency.lease_cleanup.finished"
)
