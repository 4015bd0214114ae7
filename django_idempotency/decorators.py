"""``@idempotent``: the view decorator, a thin adapter over :func:`core.protect`."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar, overload

from asgiref.sync import iscoroutinefunction
from django.conf import settings
from django.http import HttpRequest, HttpResponseBase
from django.template.response import SimpleTemplateResponse

from django_idempotency.conf import idempotency_settings
from django_idempotency.core import protect
from django_idempotency.exceptions import IdempotencyError
from django_idempotency.middleware import PROTECTED_ATTRIBUTE
from django_idempotency.options import ViewOptions, check_options
from django_idempotency.responses import problem

ViewFunc = TypeVar("ViewFunc", bound=Callable[..., HttpResponseBase])
#: Set on each protected view to its options, for the OpenAPI integration to read.
OPTIONS_ATTRIBUTE = "_idempotency_options"


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
            wrapper = _async_wrapper(view_func, view_options)
        else:

            @wraps(view_func)
            def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
                try:
                    return protect(
                        request,
                        lambda: view_func(request, *args, **kwargs),
                        view_options,
                        sender=view_func,
                        finalize=lambda response: _render(request, response),
                    )
                except IdempotencyError as error:
                    return _error_response(request, error)

        setattr(wrapper, OPTIONS_ATTRIBUTE, dict(options))
        # Read by IdempotencyMiddleware, so that a decorated view is protected once.
        setattr(wrapper, PROTECTED_ATTRIBUTE, True)
        atomic = view_options.atomic
        if atomic is False or (atomic is None and not idempotency_settings.atomic):
            # Lease mode commits its claim before the handler runs, which a
            # request-wide transaction (ATOMIC_REQUESTS) would prevent.
            wrapper._non_atomic_requests = set(settings.DATABASES)
        # For system checks that look at a view's options.
        wrapper.idempotency_options = view_options
        return wrapper

    if view is not None:
        return decorate(view)
    return decorate


def _async_wrapper(view_func: Callable[..., Any], options: ViewOptions) -> Any:
    from django_idempotency.asynchronous import protect_async

    @wraps(view_func)
    async def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        try:
            return await protect_async(
                request,
                lambda: view_func(request, *args, **kwargs),
                options,
                sender=view_func,
                finalize=lambda response: _render(request, response),
            )
        except IdempotencyError as error:
            return _error_response(request, error)

    return wrapper


def _is_drf_request(request: HttpRequest) -> bool:
    return type(request).__module__ == "rest_framework.request"


def _render(request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
    # Render now, inside the transaction, so the bytes stored are the bytes sent.
    if isinstance(response, SimpleTemplateResponse) and not response.is_rendered:
        if _is_drf_request(request):
            from django_idempotency.drf import finalize_api_view_response

            response = finalize_api_view_response(request, response)  # type: ignore[arg-type]
        response.render()  # type: ignore[attr-defined]
    return response


def _error_response(request: HttpRequest, error: IdempotencyError) -> HttpResponseBase:
    if _is_drf_request(request):
        from django_idempotency.drf import error_response

        return error_response(request, error)  # type: ignore[arg-type]
    return problem(error)
