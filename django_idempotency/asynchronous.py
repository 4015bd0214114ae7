"""Run the engine from async code, around a coroutine body, to its end even when cancelled.

For ``async def`` views (the decorator, the DRF mixin on adrf views, the
async middleware) and ``async def`` functions under ``idempotent_function``.
``docs/async.rst`` has the details and what a handler must not do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from asgiref.sync import async_to_sync, sync_to_async

T = TypeVar("T")


async def run_async(
    run: Callable[[Callable[[], T]], T],
    body: Callable[[], Awaitable[T]],
    dropped: Callable[[T], object] | None = None,
) -> T:
    """``run(body)`` from async code, for a coroutine ``body``, finishing even when cancelled.

    Django ties a transaction to a thread's connection, so the engine runs
    synchronously in the thread that Django's ASGI handler keeps for this
    request's ``thread_sensitive`` calls, and the coroutine is handed back
    to the event loop with ``async_to_sync``: while it runs, that thread
    serves its ``thread_sensitive`` calls (the async ORM, ``sync_to_async``)
    on the same connection, inside the same transaction.

    A cancellation (the client went away) must not stop a body that may
    already have acted, nor make the engine treat it as a failure and give
    the key back: the call is shielded and runs to its end, its result is
    stored, and only then is the cancellation passed on; ``dropped`` is given
    the result no one will receive (a response to close), in the same thread,
    as Django closes a response: what it runs may be sync-only.
    """

    async def coroutine() -> T:
        return await body()

    def call() -> T:
        return run(async_to_sync(coroutine))

    task = asyncio.ensure_future(sync_to_async(call, thread_sensitive=True)())
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if await _to_its_end(task) is None and dropped is not None:
            release = sync_to_async(dropped, thread_sensitive=True)(task.result())
            await _to_its_end(asyncio.ensure_future(release))
        raise


async def _to_its_end(task: asyncio.Future[Any]) -> BaseException | None:
    """Wait for ``task`` however often the waiter is cancelled; what ended it, if not a result."""
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            continue
        except BaseException:
            break
    if not task.done() or task.cancelled():
        return asyncio.CancelledError()
    return task.exception()
