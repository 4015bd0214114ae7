"""Lease mode's own database connection, for when the request's cannot commit.

Lease mode must commit its claim before the view runs and its stored
response or release when the view is done. That is impossible on the
request's connection while it is inside a transaction (``ATOMIC_REQUESTS``
reaching a class-based view through ``method_decorator``, or a DRF
``@api_view``), and useless once that connection has died. Those
statements then run on a second connection to the same database: one per
thread and alias, kept between uses only as ``CONN_MAX_AGE`` keeps Django's
own (see ``docs/decorator.rst``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

_local = threading.local()


def _wrappers() -> dict[str, BaseDatabaseWrapper]:
    wrappers: dict[str, BaseDatabaseWrapper] | None = getattr(_local, "wrappers", None)
    if wrappers is None:
        wrappers = _local.wrappers = {}
    return wrappers


def _own_wrapper(using: str) -> BaseDatabaseWrapper:
    wrappers = _wrappers()
    wrapper = wrappers.get(using)
    if wrapper is None:
        wrapper = wrappers[using] = connections.create_connection(using)
    return wrapper


@contextmanager
def own_connection(using: str, *, fresh: bool = False) -> Iterator[BaseDatabaseWrapper]:
    """Route ``using`` to this thread's own connection for the block.

    The store's statements name an alias, not a connection, so the alias is
    pointed at the second connection while they run and back afterwards;
    nothing else runs on this thread in between. ``fresh`` first closes the
    connection, so that the next statement runs on a new one.
    """
    wrapper = _own_wrapper(using)
    if fresh:
        wrapper.close()
    request_connection = connections[using]
    connections[using] = wrapper
    try:
        yield wrapper
    finally:
        connections[using] = request_connection
        # With the default CONN_MAX_AGE = 0 this closes it: a long view
        # does not hold a second connection while it runs.
        wrapper.close_if_unusable_or_obsolete()


def is_usable(connection: BaseDatabaseWrapper) -> bool:
    """Whether ``connection`` is open and still answers (a closed one is not)."""
    return connection.connection is not None and connection.is_usable()


def needs_own_connection(using: str) -> bool:
    """Whether the request's connection is inside a transaction lease mode cannot commit.

    The transaction Django's ``TestCase`` wraps each test in is tolerated,
    so lease-mode views stay testable there: on one connection the claim
    simply commits with the test's transaction. SQLite lets one connection
    write at a time, so a second connection would wait for the request's
    own transaction; there the lease stays on the request's connection and
    commits with it (see ``docs/backends.rst``).
    """
    connection = connections[using]
    blocks = connection.atomic_blocks
    if not blocks or connection.vendor == "sqlite":
        return False
    return not any(getattr(block, "_from_testcase", False) for block in blocks)
