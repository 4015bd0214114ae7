"""Following whether an open transaction commits, through Django's commit hooks.

Django offers no hook for a rollback, only ``on_commit``. A hook is
dropped, never called, when the savepoint or transaction it was registered
in rolls back, and kept among the connection's pending hooks while that
transaction is open. So a hook that was called committed, one still
pending is open, and one that is neither rolled back.

One ambiguity is removed here: when a hook raises, Django skips every hook
after it, so a hook registered after a user's raising hook is never called
although its transaction committed. :func:`on_commit_first` places a hook
before all the others, where nothing can skip it.
"""

from __future__ import annotations

from collections.abc import Callable

from django.db import connections

Hook = Callable[[], None]


def on_commit_first(using: str, hook: Hook) -> bool:
    """Call ``hook`` when ``using``'s transaction commits, before any other hook.

    Whether it waits (for :func:`pending`); ``False`` when no transaction
    is open, and it has been called. The hook is robust: its own error is
    logged, and the hooks after it still run.
    """
    connection = connections[using]
    connection.on_commit(hook, robust=True)
    if not connection.in_atomic_block:
        return False
    hooks = connection.run_on_commit
    hooks.insert(0, hooks.pop())
    return True


def pending(using: str, hook: Hook) -> bool:
    """Whether ``hook`` still waits for its transaction to commit.

    Django keeps each as ``(savepoint ids, hook, robust)``, and builds the
    entries anew when a savepoint rolls back: the hook is what lasts.
    """
    return any(waiting[1] is hook for waiting in connections[using].run_on_commit)
