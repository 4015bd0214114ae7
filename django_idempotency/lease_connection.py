"""Lease mode's own database connection, for when the request's cannot commit.

Lease mode commits its claim before the view runs and its result or release after. Inside
the request's transaction (``ATOMIC_REQUESTS`` through ``method_decorator``, DRF's
``@api_view``), or once that connection died, they run on a second connection: one per
thread and alias, kept only as ``CONN_MAX_AGE`` keeps Django's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import Error, connections
from django.db.backends.base.base import BaseDatabaseWrapper

T = TypeVar("T")

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
    """Point the alias ``using`` at this thread's own connection for the block.

    The store's statements name an alias; nothing else runs on this thread meanwhile.
    ``fresh``: a new connection.
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
        # With CONN_MAX_AGE = 0 this closes it: a long view holds no second connection.
        wrapper.close_if_unusable_or_obsolete()


def is_usable(connection: BaseDatabaseWrapper) -> bool:
    """Whether ``connection`` is open and still answers."""
    return connection.connection is not None and connection.is_usable()


def needs_own_connection(using: str) -> bool:
    """Whether the request's connection is inside a transaction lease mode cannot commit.

    Not a ``TestCase``'s, nor on SQLite, whose one writer is the request (docs/backends.rst).
    """
    connection = connections[using]
    blocks = connection.atomic_blocks
    if not blocks or connection.vendor == "sqlite":
        return False
    return not any(getattr(block, "_from_testcase", False) for block in blocks)


@dataclass(frozen=True)
class LeaseConnection:
    """Where one lease's statements run: the request's connection, or one of their own.

    ``own`` is decided at the claim.
    """

    using: str
    own: bool

    @classmethod
    def for_alias(cls, using: str) -> LeaseConnection:
        return cls(using, needs_own_connection(using))

    def statements(self, *, fresh: bool = False, own: bool = False) -> AbstractContextManager[Any]:
        """Route the alias for the block: to the lease's own (or a fresh) connection, if any."""
        if self.own or fresh or own:
            return own_connection(self.using, fresh=fresh)
        return nullcontext()

    def run(self, step: Callable[[], T], *, at_once: bool = False) -> T:
        """Run a lease statement; if it fails, again on a fresh connection.

        A handler can outlive its connection, and the statements ending its lease must not
        die with it; unless the claim lives in the request's transaction, which they cannot
        leave. ``at_once``: commit now even inside the handler's transaction (a checkpoint).
        """
        try:
            with self.statements(own=at_once and needs_own_connection(self.using)):
                return step()
        except Error:
            # Any driver error (psycopg2's InterfaceError is no DatabaseError): whether the
            # connection died cannot be told reliably, and statements fenced by token repeat safely.
            if self.shares_request_transaction():
                raise
        with self.statements(fresh=True):
            return step()

    def shares_request_transaction(self) -> bool:
        """Whether the claim lives in the request's open transaction (a test's, or SQLite's).

        Then it is invisible to other connections, and commits or rolls back with it.
        """
        return not self.own and connections[self.using].in_atomic_block

    def request_transaction_will_roll_back(self) -> bool:
        connection = connections[self.using]
        return connection.needs_rollback or not is_usable(connection)
