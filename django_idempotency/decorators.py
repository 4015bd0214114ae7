"""``@idempotent``: the view decorator, a thin adapter over :mod:`django_idempotency.core`."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial, wraps
from typing import Any, TypeVar, overload

from asgiref.sync import iscoroutinefunction
from django.http import HttpRequest, HttpResponseBase
from django.views import View

from django_idempotency import adapters
from django_idempotency.core import PLAIN, guard_for
from django_idempotency.marks import PROTECTED_ATTRIBUTE
from django_idempotency.options import NonAtomicRequests, check_options

ViewFunc = TypeVar("ViewFunc", bound=Callable[..., HttpResponseBase])


@overload
def idempotent(view: ViewFunc, /) -> ViewFunc: ...
@overload
def idempotent(view: None = None, /, **options: Any) -> Callable[[ViewFunc], ViewFunc]: ...


def idempotent(view: ViewFunc | None = None, /, **options: Any) -> Any:
    """Protect a view: bare ``@idempotent`` or ``@idempotent(ttl=..., ...)``.

    Works on function views, sync or ``async def`` (see ``docs/async.rst``),
    through ``method_decorator`` on class-based views, and on DRF
    ``@api_view`` functions when placed below ``@api_view``. A misspelt
    option name is a ``TypeError`` and a wrong value an
    ``ImproperlyConfigured``, both raised here, when the view module is
    imported; settings are read only when a request comes.
    """
    check_options(options)

    def decorate(view_func: ViewFunc) -> ViewFunc:
        # A framework that authenticates inside its views refuses what
        # would take the scope before it ran (DRF: above @api_view). Its
        # adapter is registered here if the app's ready() has not run yet
        # (an app listed before this one decorating views in its ready()).
        for adapter in adapters.in_use():
            if adapter.check_placement is not None:
                adapter.check_placement(view_func)
        view_options = check_options(options, view_func)
        wrapper: Any
        if _returns_coroutine(view_func):

            @wraps(view_func)
            async def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
                handler: Any = partial(view_func, request, *args, **kwargs)
                return await guard_for(request).acall(request, handler, view_options, view_func)

        else:

            @wraps(view_func)
            def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
                handler = partial(view_func, request, *args, **kwargs)
                guard = PLAIN if isinstance(request, HttpRequest) else guard_for(request)
                return guard.call(request, handler, view_options, view_func)

        # Or protects, in place of what it is put on, what that calls once
        # the framework authenticated the caller (DRF: on dispatch, the handler).
        for adapter in adapters.REGISTERED:
            if adapter.adapt_placement is not None:
                wrapper = adapter.adapt_placement(view_func, view_options, wrapper)
        # Read by IdempotencyMiddleware, so that a decorated view is protected once.
        setattr(wrapper, PROTECTED_ATTRIBUTE, True)
        marked: frozenset[str] = getattr(view_func, "_non_atomic_requests", frozenset())
        wrapper._non_atomic_requests = NonAtomicRequests(view_options, marked)
        # Its validated options, for the OpenAPI integration and the system checks.
        wrapper.idempotency_options = view_options
        return wrapper

    if view is not None:
        return decorate(view)
    return decorate


def _returns_coroutine(view_func: Any) -> bool:
    """Whether calling ``view_func`` gives a coroutine to await.

    An ``async def`` view does; so does, through ``method_decorator``, the
    ``dispatch`` of a class-based view whose handlers are ``async def``:
    a plain method that returns the handler's coroutine.
    """
    if iscoroutinefunction(view_func):
        return True
    view = dispatched_view(view_func)
    return view is not None and view.view_is_async


def dispatched_view(view_func: Any) -> View | None:
    """The class-based view whose ``dispatch`` ``view_func`` is, as ``method_decorator`` binds it.

    ``method_decorator`` passes a ``partial`` of the bound method, under
    any decorators listed after this one (``functools.wraps`` lets us see
    through them). It is a ``dispatch`` when its function is the one that
    the ``dispatch`` of the view's class or of any class it inherits from
    wraps: a subclass may define a ``dispatch`` of its own that calls the
    decorated one, and a decorator without ``functools.wraps`` may have
    renamed it.
    """
    bound = None
    for _ in range(_MOST_WRAPPERS):
        bound = getattr(view_func, "func", None)
        if isinstance(getattr(bound, "__self__", None), View):
            break
        view_func = getattr(view_func, "__wrapped__", None)
        if view_func is None:
            return None
    view = getattr(bound, "__self__", None)
    if not isinstance(view, View):
        return None
    function = getattr(bound, "__func__", None)
    for cls in type(view).__mro__:
        dispatch = cls.__dict__.get("dispatch")
        for _ in range(_MOST_WRAPPERS):
            if dispatch is None:
                break
            if dispatch is function:
                return view
            dispatch = getattr(dispatch, "__wrapped__", None)
    return None


#: How many layers of wrapping are looked through, at most.
_MOST_WRAPPERS = 8
