"""What a view says about itself to ``IdempotencyMiddleware``: protected already, or exempt.

``@idempotent`` marks the views it protects, so that the middleware protects
them once, not twice; ``@idempotency_exempt`` marks a view, or every view of
a URL include, that the middleware must leave alone.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import update_wrapper
from typing import Any, TypeVar

from asgiref.sync import iscoroutinefunction
from django.urls import URLPattern, URLResolver

ViewFunc = TypeVar("ViewFunc", bound=Callable[..., Any])

#: Set by ``@idempotent`` on the views it protects.
PROTECTED_ATTRIBUTE = "_idempotency_protected"
#: Set by ``@idempotency_exempt``.
EXEMPT_ATTRIBUTE = "_idempotency_exempt"


def idempotency_exempt(view: ViewFunc) -> ViewFunc:
    """Leave a view, or every view of an ``include()``, out of ``IdempotencyMiddleware``.

    Works on function views (sync or async), on ``as_view()`` results and,
    through ``method_decorator``, on class-based view methods. Given what
    ``include()`` returns (or ``admin.site.urls``), it returns the same
    include with every view in it exempt, nested includes too::

        path("accounts/", idempotency_exempt(include("allauth.urls"))),

    The views themselves are not changed: the include gets exempt copies of
    them, so the same view elsewhere is still protected.
    """
    if isinstance(view, tuple):
        return _exempt_include(view)
    setattr(view, EXEMPT_ATTRIBUTE, True)
    return view


def _exempt_include(included: tuple[Any, ...]) -> tuple[Any, ...]:
    urlconf, *names = included
    patterns = getattr(urlconf, "urlpatterns", urlconf)
    return ([_exempt_pattern(pattern) for pattern in patterns], *names)


def _exempt_pattern(pattern: Any) -> Any:
    if isinstance(pattern, URLResolver):
        return URLResolver(
            pattern.pattern,
            [_exempt_pattern(inner) for inner in pattern.url_patterns],
            pattern.default_kwargs,
            pattern.app_name,
            pattern.namespace,
        )
    if isinstance(pattern, URLPattern):
        return URLPattern(
            pattern.pattern, _exempt_copy(pattern.callback), pattern.default_args, pattern.name
        )
    return pattern


def _exempt_copy(view: Callable[..., Any]) -> Callable[..., Any]:
    copy: Callable[..., Any]
    if iscoroutinefunction(view):

        async def copy(*args: Any, **kwargs: Any) -> Any:
            return await view(*args, **kwargs)

    else:

        def copy(*args: Any, **kwargs: Any) -> Any:
            return view(*args, **kwargs)

    # Its attributes too (csrf_exempt, view_class, _non_atomic_requests).
    update_wrapper(copy, view)
    setattr(copy, EXEMPT_ATTRIBUTE, True)
    return copy


def is_exempt(view: Any, method: str) -> bool:
    return _marked(view, method, EXEMPT_ATTRIBUTE)


def protects_itself(view: Any, method: str) -> bool:
    """Whether ``@idempotent`` is on the view, its ``dispatch`` or its ``method`` handler."""
    return _marked(view, method, PROTECTED_ATTRIBUTE)


def _marked(view: Any, method: str, marker: str) -> bool:
    candidates = [view]
    view_class = getattr(view, "view_class", None) or getattr(view, "cls", None)
    if isinstance(view_class, type):
        # method_decorator copies our markers onto the method it decorates.
        candidates += [getattr(view_class, name, None) for name in ("dispatch", method.lower())]
    return any(getattr(candidate, marker, False) for candidate in candidates)
