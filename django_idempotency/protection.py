"""Whether a view is protected, and with which options: one answer for every asker.

``IdempotencyMiddleware`` asks it of the view a URL resolves to, a
framework's adapter answers it for its own views (DRF's, whose handlers are
protected after DRF's authentication), and the OpenAPI extension asks it of
each operation it documents, so that what the schema says is what the run
time does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django_idempotency import adapters
from django_idempotency.adapters import Layer
from django_idempotency.conf import idempotency_settings
from django_idempotency.marks import is_exempt, protects_itself
from django_idempotency.options import DeclaredOptions

__all__ = ["Layer", "ViewProtection", "middleware_options", "view_protection"]


@dataclass(frozen=True)
class ViewProtection:
    """How a request for one method of a view is protected."""

    #: The view's own protections, outermost first, as a request meets
    #: them: ``@idempotent`` (on the view, its ``dispatch`` or the handler),
    #: a framework's mixin. Empty when the view protects nothing itself, or
    #: when it does in a way only its marks tell (a plain view's).
    layers: tuple[Layer, ...] = ()
    #: Whether ``@idempotent`` protects it (on the view, its ``dispatch`` or
    #: the method's handler), or a framework's mixin does.
    protects_itself: bool = False
    #: Whether ``@idempotency_exempt`` leaves it out of the middleware.
    exempt: bool = False
    #: How ``IdempotencyMiddleware`` protects the view: ``None`` when it
    #: leaves it alone (it protects itself, is exempt, or has no handler
    #: for the method); else a function that gives what the middleware
    #: protects, and the options it protects it with. What it protects is
    #: the view itself, which the middleware wraps, or a framework's version
    #: of it that protects itself once the framework authenticated the
    #: caller, which the middleware calls in the view's place; such a
    #: version is made when first asked for, not by asking this.
    middleware: Callable[[], tuple[Any, DeclaredOptions]] | None = None


def view_protection(view: Any, method: str, *, instance: Any = None) -> ViewProtection:
    """How ``method`` of the view function ``view`` (what a URL resolves to) is protected.

    A framework's adapter answers for its own views; ``instance`` is an
    instance of the view's class, whose options (``as_view()`` arguments,
    properties) a framework's mixin reads from it, for the OpenAPI
    extension. Whether the middleware is installed, and the method one it
    protects, is for the asker: this says what it would do.
    """
    for adapter in adapters.REGISTERED:
        if adapter.view_protection is not None:
            found: ViewProtection | None = adapter.view_protection(view, method, instance)
            if found is not None:
                return found
    exempt = is_exempt(view, method)
    protected = protects_itself(view, method)
    if exempt or protected:
        return ViewProtection(protects_itself=protected, exempt=exempt)
    return ViewProtection(middleware=lambda: (view, middleware_options(view)))


def middleware_options(view: Any) -> DeclaredOptions:
    """The options the middleware protects ``view`` with: the settings', adapted."""
    if idempotency_settings.database in getattr(view, "_non_atomic_requests", ()):
        # The view opted out of request transactions (a durable block, its own
        # commits): wrapping it in ours would break it. Lease mode commits the
        # claim first and runs the view outside any transaction.
        return _LEASE_MODE
    return _SETTINGS


def _label(name: str) -> str:
    return f"IdempotencyMiddleware's {name}"


_SETTINGS = DeclaredOptions({}, _label)
_LEASE_MODE = DeclaredOptions({"atomic": False}, _label)
