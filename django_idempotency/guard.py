"""Run a view's handler under :func:`core.protect`, answering errors the view's way.

The decorator and the DRF mixin differ in two things only: how a response
is finished before it is stored (DRF renders through the view), and how an
error of ours is answered (problem details, or the project's DRF exception
handler). A :class:`Guard` holds those two, so that each adapter is a few
lines and sync and async handlers share one path.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from django.http import HttpRequest, HttpResponseBase
from django.template.response import SimpleTemplateResponse

from django_idempotency.core import protect
from django_idempotency.exceptions import IdempotencyError
from django_idempotency.options import ViewOptions
from django_idempotency.responses import problem

Finish = Callable[[HttpResponseBase], HttpResponseBase]
Answer = Callable[[IdempotencyError], HttpResponseBase]
Options = Mapping[str, Any] | ViewOptions


def render(response: HttpResponseBase) -> HttpResponseBase:
    """Render a template response now, inside the transaction: what is stored is what is sent."""
    if isinstance(response, SimpleTemplateResponse) and not response.is_rendered:
        response.render()
    return response


@dataclass(frozen=True)
class Guard:
    finish: Finish = render
    answer: Answer = problem

    def call(
        self,
        request: HttpRequest,
        handler: Callable[[], HttpResponseBase],
        options: Options,
        sender: Any,
    ) -> HttpResponseBase:
        try:
            return protect(request, handler, options, sender=sender, finalize=self.finish)
        except IdempotencyError as error:
            return self.answer(error)

    async def acall(
        self,
        request: HttpRequest,
        handler: Callable[[], Awaitable[HttpResponseBase]],
        options: Options,
        sender: Any,
    ) -> HttpResponseBase:
        from django_idempotency.asynchronous import protect_async

        try:
            return await protect_async(
                request, handler, options, sender=sender, finalize=self.finish
            )
        except IdempotencyError as error:
            return self.answer(error)
