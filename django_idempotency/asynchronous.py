"""Run :func:`core.protect` around a coroutine, for async views and the async middleware.

Django ties a transaction to a thread's connection, so the protocol (claim,
handler, stored response) runs synchronously in the thread that Django's
ASGI handler keeps for this request's ``thread_sensitive`` calls. The
coroutine itself is handed back to the event loop with ``async_to_sync``;
while it runs, that thread serves the coroutine's ``thread_sensitive``
calls (the async ORM, ``sync_to_async``), on the same connection and so
inside the same transaction. A duplicate waiting for a row lock blocks its
own request's thread, never the event loop. ``docs/async.rst`` has the
details and what a handler must not do.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from asgiref.sync import async_to_sync, sync_to_async
from django.http import HttpRequest, HttpResponseBase

from django_idempotency.conf import idempotency_settings
from django_idempotency.core import protect
from django_idempotency.options import ViewOptions, resolve_options

AsyncHandler = Callable[[], Awaitable[HttpResponseBase]]
Overrides = Mapping[str, Any] | ViewOptions


async def protect_async(
    request: HttpRequest, handler: AsyncHandler, overrides: Overrides, **keywords: Any
) -> HttpResponseBase:
    """:func:`core.protect` for a coroutine handler: the same keywords, the same errors."""
    if not may_claim(request, overrides):
        # Nothing to claim: skip the hop to the request's thread.
        return await handler()

    async def call_handler() -> HttpResponseBase:
        return await handler()

    def run() -> HttpResponseBase:
        return protect(request, async_to_sync(call_handler), overrides, **keywords)

    return await sync_to_async(run, thread_sensitive=True)()


def may_claim(request: HttpRequest, overrides: Overrides) -> bool:
    """Whether :func:`core.protect` could claim or refuse this request.

    Only a shortcut: when it says yes, ``protect`` still decides.
    """
    conf = idempotency_settings
    if not conf.enabled:
        return False
    options = resolve_options(overrides)
    if request.method not in options.methods:
        return False
    return options.required or conf.header in request.headers
