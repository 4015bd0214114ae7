"""Releasing a lease whose stored response rolled back with the request.

On its own connection (see :mod:`django_idempotency.lease_connection`),
lease mode stores the response inside the request's transaction, so that
the record and the view's writes commit together. If that transaction
rolls back after the view returned (a deferred constraint failing at
``COMMIT``, an exception later in the request), the record is still the
claim committed before the view ran: it is released when Django closes the
request, so that a retry runs again rather than get 409 until the lease
runs out (see ``docs/decorator.rst``).

The release is tied to the request object itself, not to a thread or a
context: under ASGI, Django runs the view in a task of its own and closes
the request from another, and each sees a different context.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db import connections, transaction

from django_idempotency.body import django_request, when_closed

Release = Callable[[], None]


def release_unless_committed(using: str, release: Release, request: Any) -> None:
    """Call ``release`` when ``request`` is closed, unless ``using``'s transaction committed.

    Without a request (a function or a task called in a transaction of its
    caller's) nothing calls it: the key stays claimed until its lease runs
    out.
    """
    if request is None:
        return
    committed: list[bool] = []
    transaction.on_commit(lambda: committed.append(True), using=using)

    def release_if_rolled_back() -> None:
        if committed or connections[using].in_atomic_block:
            # Committed with the request's transaction; or it is still open
            # (a test wrapping the request): not this request's to decide.
            return
        release()

    when_closed(django_request(request), release_if_rolled_back)
