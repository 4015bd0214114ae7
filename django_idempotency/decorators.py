"""``@idempotent``: the view decorator, a thin adapter over :func:`core.protect`."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial, wraps
from typing import Any, TypeVar, overload

from asgiref.sync import iscoroutinefunction
from django.conf import settings
from django.http import HttpRequest, HttpResponseBase

from django_idempotency.conf import idempotency_settings
from django_idempotency.guard import Guard
from django_idempotency.middleware import PROTECTED_ATTRIBUTE
from django_idempotency.options import check_options

ViewFunc = TypeVar("ViewFunc", bound=Callable[..., HttpResponseBase])

PLAIN = Guard()


def guard_for(request: HttpRequest) -> Guard:
    """DRF's guard for a DRF request (``@api_view`` under the decorator), else the plain one.

    The only place outside :mod:`django_idempotency.drf` that knows DRF
    exists, and it imports nothing from DRF unless the request is DRF's.
    """
    if type(request).__module__ == "rest_framework.request":
        from django_idempotency.drf import guard

        return guard(request)  # type: ignore[arg-type]
    return PLAIN


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
    imported.
    """
    check_options(options)

    def decorate(view_func: ViewFunc) -> ViewFunc:
        view_options = check_options(options, view_func)
        wrapper: Any
        if iscoroutinefunction(view_func):

            @wraps(view_func)
            async def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
                handler = partial(view_func, request, *args, **kwargs)
                return await guard_for(request).acall(request, handler, view_options, view_func)

        else:

            @wraps(view_func)
            def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
                handler = partial(view_func, request, *args, **kwargs)
                return guard_for(request).call(request, handler, view_options, view_func)

        # Read by IdempotencyMiddleware, so that a decorated view is protected once.
        setattr(wrapper, PROTECTED_ATTRIBUTE, True)
        atomic = view_options.atomic
        if atomic is False or (atomic is None and not idempotency_settings.atomic):
            # Lease mode commits its claim before the handler runs, which a
            # request-wide transaction (ATOMIC_REQUESTS) would prevent.
            wrapper._non_atomic_requests = set(settings.DATABASES)
        # Its validated options, for the OpenAPI integration and the system checks.
        wrapper.idempotency_options = view_options
        return wrapper

    if view is not None:
        return decorate(view)
    return decorate
