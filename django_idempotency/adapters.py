"""What the package knows of a framework: one :class:`Adapter` each.

Plain Django needs none. A framework hands the package one adapter, from
its module in ``django_idempotency/contrib/``, with :func:`register`. One
with a request of its own around Django's (Django REST framework's
``Request``) says how to reach Django's request inside its own, how its
responses are finished before they are stored, how an error of ours is
answered, which placements of ``@idempotent`` it refuses or adapts, and
how its views are protected; one that runs tasks (Celery) says which of
its exceptions end a body on purpose. The rest of the package asks the
adapters registered here and never imports a framework.
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

    Every field but ``name`` is optional: ``None`` means the framework
    needs nothing there beyond what plain Django (or a plain function) gets.
    """

    #: The framework, for messages: ``"Django REST framework"``.
    name: str
    #: The framework's request class, which wraps Django's, and the Django
    #: request inside one of them (its body, ``META``).
    request_class: type | None = None
    django_request: Callable[[Any], HttpRequest] | None = None
    #: Turns a handler's response into the bytes that will be sent, before
    #: they are stored: ``finish(request, response)``.
    finish: Callable[[Any, HttpResponseBase], HttpResponseBase] | None = None
    #: Answers one of our errors to one of its requests: ``answer(request, error)``.
    answer: Callable[[Any, IdempotencyError], HttpResponseBase] | None = None
    #: The format content negotiation picked for the response, which the
    #: fingerprint counts (a retry asking for another format is another request).
    negotiated_format: Callable[[Any], str | None] | None = None
    #: What the framework parsed of the body, for a fingerprint whose raw
    #: body was read before it and not kept.
    parsed_body: Callable[[Any], Any] | None = None
    #: The framework's response class, and the check that a response of it
    #: may be stored under a claim taken on ``request``: it returns the
    #: response or raises ``ImproperlyConfigured``. ``core.protect`` asks it
    #: only of a claim taken on Django's own request: one taken on the
    #: framework's request was taken once the framework ran.
    response_class: type | None = None
    check_claimed: Callable[[HttpResponseBase, Any], HttpResponseBase] | None = None
    #: Raises ``ImproperlyConfigured``, with the fix, for what ``@idempotent``
    #: must not be put on (a view it would see before the framework authenticates).
    check_placement: Callable[[Any], None] | None = None
    #: ``adapt_placement(decorated, options, wrapper)``: the wrapper
    #: ``@idempotent`` returns for ``decorated``; ``wrapper`` where it has
    #: nothing to change.
    adapt_placement: Callable[[Any, DeclaredOptions, Any], Any] | None = None
    #: ``view_protection(view, method, instance)``: how the framework
    #: protects a view function's ``method``, as a
    #: :class:`~django_idempotency.protection.ViewProtection`, or ``None``
    #: for a view not of the framework.
    view_protection: Callable[[Any, str, Any], Any] | None = None
    #: How a body that raised ``exc`` ended (an ``engine.Ending``), when
    #: ``exc`` is the framework's control flow (Celery's ``Ignore``:
    #: completed on purpose); ``None`` for an exception it has no word on.
    ending: Callable[[BaseException], Any] | None = None
    #: Raises the framework's signal that a task ended on purpose, for a
    #: duplicate of a body that ended so (Celery's ``Ignore``).
    end_on_purpose: Callable[[], Any] | None = None


#: The adapters, in the order they were registered.
REGISTERED: list[Adapter] = []

#: Integrations registered when their framework is in use: a module the
#: framework has loaded once it is in use (a body that raised one of
#: Celery's exceptions has imported them; a module defining a DRF view has
#: imported DRF's views), to the module in ``contrib/`` whose import
#: registers its adapter. See :func:`in_use`. Celery's is never imported at
#: start-up; DRF's is imported by the app's ``ready()`` too, but a view may
#: be decorated before that runs.
DEFERRED: dict[str, str] = {
    "celery.exceptions": "django_idempotency.contrib.celery",
    "rest_framework.views": "django_idempotency.contrib.drf",
}

# Request classes seen, each to its adapter (None: plain Django's).
_BY_CLASS: dict[type, Adapter | None] = {}


def register(adapter: Adapter) -> None:
    """Make ``adapter`` the package's knowledge of its framework.

    Called once, by the framework's module in ``contrib/`` when it is
    imported; an adapter registered again under the same name replaces
    the first.
    """
    REGISTERED[:] = [each for each in REGISTERED if each.name != adapter.name]
    REGISTERED.append(adapter)
    _BY_CLASS.clear()


def in_use(*, importing: bool = False) -> list[Adapter]:
    """:data:`REGISTERED`, once the deferred integrations of the frameworks in use are registered.

    Asked where the package must know a framework whose integration may
    not have been imported yet (Celery's control flow ending a body; a view
    decorated in an app's ``ready()`` that runs before this app's), so that
    nothing imports a framework a project does not use. ``importing=True`` also
    imports a deferred integration whose framework is installed but not yet
    loaded, for a record only that framework could have written.
    """
    for loaded, integration in DEFERRED.items():
        if loaded in sys.modules or integration in sys.modules:
            # Even when the integration is in sys.modules: a module is there
            # before its code has run (and registered its adapter), and
            # import_module waits for another thread still importing it.
            import_module(integration)
        elif importing:
            # Not installed, or unimportable: there is nothing to register.
            with suppress(ImportError):
                import_module(integration)
    return REGISTERED


#: What a request of Django's own holds that is not Django's: nothing.
NOT_A_FRAMEWORKS: Mapping[str, Any] = MappingProxyType({})


def reach(request: Any) -> tuple[HttpRequest, Mapping[str, Any], Adapter | None]:
    """Django's request under ``request``, what was set on ``request`` itself, and its adapter.

    A framework's request (DRF's) gives Django's attributes through a proxy
    that raises and catches an error for each, so the package reads them
    from Django's request inside it. But what a project set on the
    framework's request itself (a method override, a session of its own)
    is what the proxy gives instead: a name is looked up in the mapping
    returned first, and on Django's request when it is not there. That is
    the framework request's own attributes, and the ``method`` its class
    gives (a property of a ``Request`` subclass): the method the framework
    dispatches on (``fingerprint.method_of``). For Django's own request, or
    one no adapter reaches into: the request, an empty mapping, and its
    adapter (``None`` for Django's).
    """
    if isinstance(request, HttpRequest):
        return request, NOT_A_FRAMEWORKS, None
    # A registered framework's adapter without for_request's frame: this runs a few times
    # per request (for_request answers the rest, and caches them).
    adapter = _BY_CLASS.get(type(request)) or for_request(request)
    if adapter is None or adapter.django_request is None:
        return request, NOT_A_FRAMEWORKS, adapter
    http_request = adapter.django_request(request)
    if http_request is request:
        return request, NOT_A_FRAMEWORKS, adapter
    own: Mapping[str, Any] = getattr(request, "__dict__", NOT_A_FRAMEWORKS)
    # A class's method (DRF's Request has none; it proxies Django's) is read as
    # the framework reads it, and comes before what its instance holds.
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
