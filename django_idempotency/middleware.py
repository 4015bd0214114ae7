"""``IdempotencyMiddleware``: protect every view at once, with the settings' defaults.

The middleware wraps the rest of the stack (later middleware, Django's
``ATOMIC_REQUESTS`` transaction, the view) in :func:`core.protect`, so the
request's own transaction nests inside ours in atomic mode and starts after
our committed claim in lease mode. It leaves alone the views that protect
themselves (``@idempotent``), that opt out (``@idempotency_exempt``), and
every DRF view: DRF authenticates inside the view, after any middleware, so
only the DRF mixin can compute the right scope. ``docs/middleware.rst`` has
the details.

Three things Django does around a view shape what the middleware does:

- a view marked ``transaction.non_atomic_requests`` for our database
  manages its own transactions: it runs in lease mode, outside any
  transaction of ours;
- an exception the view raises reaches us as the response Django made of
  it (403, 404, 500): we hear of it through ``process_exception`` and
  treat the response as the handler's failure, never stored;
- a view that authenticates the request itself runs after the scope is
  taken: the default scope folds an unauthenticated request's
  ``Authorization`` header into it (:mod:`django_idempotency.scopes`), as
  under the decorator, so one client's token never replays another's answer.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponseBase
from django.urls import Resolver404, resolve

from django_idempotency.asynchronous import may_claim, protect_async
from django_idempotency.conf import idempotency_settings
from django_idempotency.core import protect
from django_idempotency.exceptions import IdempotencyError
from django_idempotency.responses import discard, problem

ViewFunc = TypeVar("ViewFunc", bound=Callable[..., Any])

#: Set by ``@idempotent`` on the views it protects.
PROTECTED_ATTRIBUTE = "_idempotency_protected"
#: Set by ``@idempotency_exempt``.
EXEMPT_ATTRIBUTE = "_idempotency_exempt"
# Set on the request by process_view: the request got past every earlier
# middleware's checks (CSRF, login) and reached the view.
_REACHED_VIEW = "_idempotency_reached_view"
# Set on the request by process_exception: the view raised, and the response
# get_response returns is the one Django made of the exception.
_VIEW_RAISED = "_idempotency_view_raised"


def idempotency_exempt(view: ViewFunc) -> ViewFunc:
    """Leave a view out of ``IdempotencyMiddleware``: it runs unprotected.

    Works on function views (sync or async), on ``as_view()`` results and,
    through ``method_decorator``, on class-based view methods.
    """
    setattr(view, EXEMPT_ATTRIBUTE, True)
    return view


class _NotReached(Exception):
    """Another middleware answered before the view ran: give the key back."""

    def __init__(self, response: HttpResponseBase) -> None:
        self.response = response


class IdempotencyMiddleware:
    """Protect every view answering a method in ``METHODS``, sync or async.

    Put it at the end of ``MIDDLEWARE``: after ``AuthenticationMiddleware``,
    whose user the default scope reads, and after ``CsrfViewMiddleware``, so
    that a request refused before its view never consumes its key.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)
            # Django adapts a sync process_view to an async stack with a hop
            # to another thread on every request; an async one needs none.
            self.process_view = self._process_view_async  # type: ignore[method-assign,assignment]

    def __call__(self, request: HttpRequest) -> Any:
        if self.async_mode:
            return self._call_async(request)
        view = self._view_to_protect(request)
        if view is None:
            return self.get_response(request)

        def handler() -> HttpResponseBase:
            return self._reached_view(request, self.get_response(request))

        try:
            return protect(request, handler, _options_for(view), sender=view)
        except _NotReached as not_reached:
            return not_reached.response
        except IdempotencyError as error:
            return problem(error)

    async def _call_async(self, request: HttpRequest) -> HttpResponseBase:
        view = self._view_to_protect(request)
        if view is None:
            response: HttpResponseBase = await self.get_response(request)
            return response

        async def handler() -> HttpResponseBase:
            return self._reached_view(request, await self.get_response(request))

        try:
            return await protect_async(request, handler, _options_for(view), sender=view)
        except _NotReached as not_reached:
            return not_reached.response
        except IdempotencyError as error:
            return problem(error)

    def process_view(
        self, request: HttpRequest, view_func: Any, view_args: Any, view_kwargs: Any
    ) -> None:
        setattr(request, _REACHED_VIEW, True)

    async def _process_view_async(
        self, request: HttpRequest, view_func: Any, view_args: Any, view_kwargs: Any
    ) -> None:
        setattr(request, _REACHED_VIEW, True)

    def process_exception(self, request: HttpRequest, exception: Exception) -> None:
        # Django always calls this hook synchronously, in either mode.
        setattr(request, _VIEW_RAISED, True)

    @staticmethod
    def _reached_view(request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
        if not getattr(request, _REACHED_VIEW, False):
            raise _NotReached(response)
        if getattr(request, _VIEW_RAISED, False):
            # A handler that raises leaves nothing stored, and atomic mode
            # rolls back what it wrote before raising (docs/concepts.rst).
            return discard(response)
        return response

    @staticmethod
    def _view_to_protect(request: HttpRequest) -> Any:
        """The view this middleware protects for this request, or ``None``."""
        if not may_claim(request, {}):
            return None
        try:
            match = resolve(request.path_info, urlconf=getattr(request, "urlconf", None))
        except Resolver404:
            return None
        view = match.func
        if _handled_elsewhere(view, request.method or ""):
            return None
        return view


def _options_for(view: Any) -> dict[str, Any]:
    """The options the middleware protects ``view`` with: the settings', adapted."""
    options: dict[str, Any] = {}
    if idempotency_settings.database in getattr(view, "_non_atomic_requests", ()):
        # The view opted out of request transactions (a durable block, its own
        # commits): wrapping it in ours would break it. Lease mode commits the
        # claim first and runs the view outside any transaction.
        options["atomic"] = False
    return options


def _handled_elsewhere(view: Any, method: str) -> bool:
    """Whether the view protects itself, opted out, or is a DRF view."""
    candidates = [view]
    view_class = getattr(view, "view_class", None) or getattr(view, "cls", None)
    if isinstance(view_class, type):
        if _is_drf_view(view_class):
            return True
        # method_decorator copies our markers onto the method it decorates.
        candidates += [getattr(view_class, name, None) for name in ("dispatch", method.lower())]
    markers = (PROTECTED_ATTRIBUTE, EXEMPT_ATTRIBUTE)
    return any(getattr(view, marker, False) for view in candidates for marker in markers)


def _is_drf_view(view_class: type) -> bool:
    # Without rest_framework imported there can be no DRF view; importing
    # it here would make DRF a dependency of the middleware.
    drf_views = sys.modules.get("rest_framework.views")
    return drf_views is not None and issubclass(view_class, drf_views.APIView)
