"""What the package knows of a framework: one :class:`Adapter` each.

Plain Django needs none. A framework's module in ``contrib/`` hands its
adapter to :func:`register`; the rest of the package asks the adapters here
and never imports a framework.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from importlib import import_module
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from django.http import HttpRequest

if TYPE_CHECKING:
    from django.http import HttpResponseBase

    from django_idempotency.exceptions import IdempotencyError
    from django_idempotency.options import DeclaredOptions


@dataclass(frozen=True)
class Layer:
    """One protection a request meets on its way to a view's handler."""

    options: DeclaredOptions
    #: Whether its errors are answered as problem details, as a decorator's
    #: are, rather than by the framework's own error handling.
    problem_details: bool = False


@dataclass(frozen=True)
class Adapter:
    """How one framework's requests, responses, views and task bodies are protected.

    ``None`` in a field: nothing beyond what plain Django (or a function) gets.
    """

    #: The framework, for messages: ``"Django REST framework"``.
    name: str
    #: The framework's request class, which wraps Django's, and Django's inside one.
    request_class: type | None = None
    django_request: Callable[[Any], HttpRequest] | None = None
    #: ``finish(request, response)``: the response as it will be sent, before it is stored.
    finish: Callable[[Any, HttpResponseBase], HttpResponseBase] | None = None
    #: Answers one of our errors to one of its requests: ``answer(request, error)``.
    answer: Callable[[Any, IdempotencyError], HttpResponseBase] | None = None
    #: The format content negotiation picked: another format is another fingerprint.
    negotiated_format: Callable[[Any], str | None] | None = None
    #: What the framework parsed of the body, for a fingerprint whose raw body is gone.
    parsed_body: Callable[[Any], Any] | None = None
    #: Raises ``ImproperlyConfigured``, with the fix, for what ``@idempotent``
    #: must not be put on (a view it would see before the framework authenticates).
    check_placement: Callable[[Any], None] | None = None
    #: ``adapt_placement(decorated, options, wrapper)``: what ``@idempotent``
    #: returns for ``decorated``; ``wrapper`` when nothing changes.
    adapt_placement: Callable[[Any, DeclaredOptions, Any], Any] | None = None
    #: ``view_protection(view, method, instance)``: how the framework protects
    #: ``method`` of a view, a :class:`~django_idempotency.protection.ViewProtection`
    #: (``None`` for a view not of the framework).
    view_protection: Callable[[Any, str, Any], Any] | None = None
    #: How a body that raised the framework's control flow ``exc`` ended (an
    #: ``engine.Ending``; Celery's ``Ignore``: completed on purpose); ``None`` for other errors.
    ending: Callable[[BaseException], Any] | None = None
    #: Raises the framework's "ended on purpose" (Celery's ``Ignore``), for a
    #: duplicate of a body that ended so.
    end_on_purpose: Callable[[], Any] | None = None


#: The adapters, in the order they were registered.
REGISTERED: list[Adapter] = []

#: A module its framework has loaded once in use (a body raising Celery's
#: exceptions imported them; a DRF view's module imported DRF's views), to the
#: ``contrib/`` module whose import registers its adapter (:func:`in_use`).
#: Celery's is never imported at start-up; DRF's is, by ``ready()``, but a view
#: may be decorated earlier.
DEFERRED: dict[str, str] = {
    "celery.exceptions": "django_idempotency.contrib.celery",
    "rest_framework.views": "django_idempotency.contrib.drf",
}

# Request classes seen, each to its adapter (None: plain Django's).
_BY_CLASS: dict[type, Adapter | None] = {}


def register(adapter: Adapter) -> None:
    """Register ``adapter``, replacing one of the same name."""
    REGISTERED[:] = [each for each in REGISTERED if each.name != adapter.name]
    REGISTERED.append(adapter)
    _BY_CLASS.clear()


def in_use(*, importing: bool = False) -> list[Adapter]:
    """:data:`REGISTERED`, once the deferred integrations of the frameworks in use are registered.

    It imports no framework a project does not use; ``importing=True`` also
    imports one installed but not loaded yet, for a record only that
    framework could have written.
    """
    for loaded, integration in DEFERRED.items():
        if loaded in sys.modules or integration in sys.modules:
            # Even when in sys.modules: a module is there before its code has
            # run, and import_module waits for another thread importing it.
            import_module(integration)
        elif importing:
            # Not installed, or unimportable: nothing to register.
            with suppress(ImportError):
                import_module(integration)
    return REGISTERED


#: What a request of Django's own holds that is not Django's: nothing.
NOT_A_FRAMEWORKS: Mapping[str, Any] = MappingProxyType({})


#: What :func:`reach` gives: Django's request, what was set on a framework's, its adapter.
Reached = tuple[HttpRequest, Mapping[str, Any], "Adapter | None"]


def reach(request: Any) -> Reached:
    """Django's request under ``request``, what was set on ``request`` itself, and its adapter.

    A framework's request (DRF's) proxies Django's attributes, raising and
    catching an error for each, so they are read from Django's request. A
    name is looked up first in the mapping: what the project set on the
    framework's request (a method override, a session), and the ``method``
    its class defines, which the framework dispatches on. Django's own
    request, or one no adapter reaches into, gives an empty mapping.
    """
    if isinstance(request, HttpRequest):
        return request, NOT_A_FRAMEWORKS, None
    # Cached adapters without for_request's frame: this runs a few times per request.
    adapter = _BY_CLASS.get(type(request)) or for_request(request)
    if adapter is None or adapter.django_request is None:
        return request, NOT_A_FRAMEWORKS, adapter
    http_request = adapter.django_request(request)
    if http_request is request:
        return request, NOT_A_FRAMEWORKS, adapter
    own: Mapping[str, Any] = getattr(request, "__dict__", NOT_A_FRAMEWORKS)
    # DRF's Request has no method of its own; a subclass's comes before the instance's.
    if hasattr(type(request), "method"):
        method = request.method
        if method is not own.get("method"):
            own = {**own, "method": method}
    return http_request, own, adapter


def for_request(request: Any) -> Adapter | None:
    """The adapter of the framework whose request ``request`` is, or ``None`` for Django's own.

    A subclass of a framework's request class (adrf's ``Request``) is the framework's.
    """
    cls = type(request)
    try:
        return _BY_CLASS[cls]
    except KeyError:
        pass
    found = next(
        (
            each
            for each in REGISTERED
            if each.request_class is not None and issubclass(cls, each.request_class)
        ),
        None,
    )
    _BY_CLASS[cls] = found
    return found
