"""Django REST framework integration: ``IdempotentMixin`` and API exceptions.

The only module that imports ``rest_framework``. The mixin wraps the
handler after DRF's ``initial()``, so authentication, permissions and
throttling have answered before any key is claimed, and the scope sees the
DRF-authenticated user (token, JWT, session). Async handlers of ``adrf``
views go through the same core (``docs/async.rst``).
"""

from __future__ import annotations

import difflib
import inspect
import logging
import operator
import weakref
from functools import partial, wraps
from types import FunctionType
from typing import Any

from asgiref.sync import iscoroutinefunction
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponseBase
from django.template.response import SimpleTemplateResponse
from django.views import View
from rest_framework import exceptions, generics, mixins
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import exceptions as core_exceptions
from django_idempotency.adapters import Adapter, Layer, reach, register
from django_idempotency.conf import idempotency_settings
from django_idempotency.core import Answer, Guard, may_claim, protect
from django_idempotency.decorators import dispatched_view
from django_idempotency.fingerprint import method_of
from django_idempotency.marks import EXEMPT_ATTRIBUTE, is_exempt
from django_idempotency.options import OPTION_NAMES, DeclaredOptions, NonAtomicRequests
from django_idempotency.protection import ViewProtection
from django_idempotency.responses import problem_for

# The name it has logged under since before the move to contrib/, which
# projects' LOGGING configurations name.
logger = logging.getLogger("django_idempotency.drf")


def _said_as(error: type[core_exceptions.IdempotencyError]) -> tuple[int, str, str]:
    """The DRF exception's ``status_code``, ``default_detail`` and ``default_code``: ``error``'s."""
    return error.status, error.default_detail, error.code


class IdempotencyKeyRequired(exceptions.APIException):
    status_code, default_detail, default_code = _said_as(core_exceptions.IdempotencyKeyRequired)


class InvalidIdempotencyKey(exceptions.APIException):
    status_code, default_detail, default_code = _said_as(core_exceptions.InvalidIdempotencyKey)


class RequestInFlight(exceptions.APIException):
    status_code, default_detail, default_code = _said_as(core_exceptions.RequestInFlight)

    def __init__(self, detail: Any = None, code: Any = None, wait: int = 1) -> None:
        super().__init__(detail, code)
        # DRF's exception handler turns ``wait`` into Retry-After, as for Throttled.
        self.wait = wait


class FingerprintMismatch(exceptions.APIException):
    status_code, default_detail, default_code = _said_as(core_exceptions.FingerprintMismatch)


_EQUIVALENTS: dict[type[core_exceptions.IdempotencyError], type[exceptions.APIException]] = {
    core_exceptions.IdempotencyKeyRequired: IdempotencyKeyRequired,
    core_exceptions.InvalidIdempotencyKey: InvalidIdempotencyKey,
    # Every 409 with Retry-After: in flight, lease lost, abandoned.
    core_exceptions.InFlight: RequestInFlight,
    core_exceptions.FingerprintMismatch: FingerprintMismatch,
}


def to_api_exception(error: core_exceptions.IdempotencyError) -> exceptions.APIException:
    """The DRF exception for a core error, so the project's EXCEPTION_HANDLER renders it."""
    # Walk the MRO so that a subclass of a core error keeps its HTTP meaning.
    api_class = next(_EQUIVALENTS[cls] for cls in type(error).__mro__ if cls in _EQUIVALENTS)
    if isinstance(error, core_exceptions.InFlight):
        return RequestInFlight(error.detail, error.code, wait=error.retry_after)
    return api_class(error.detail)


def error_response(request: Request, error: core_exceptions.IdempotencyError) -> HttpResponseBase:
    """Answer ``error`` through the view's own exception handling, plus its ``Link``.

    The same as raising the DRF exception from the handler (the project's
    ``EXCEPTION_HANDLER`` renders it), except that headers DRF has no place
    for, such as ``Link: <...>; rel="describedby"``, are added to the answer.
    """
    view = request.parser_context["view"]
    response = view.handle_exception(to_api_exception(error))
    for name, value in error.headers().items():
        if name not in response:
            response[name] = value
    return response


#: Set on a response that :func:`finish` had its view finalise: the view's
#: ``id()``, so that ``IdempotentMixin.finalize_response`` does not finalise
#: it a second time when DRF's ``dispatch`` asks.
_FINALIZED_BY = "_idempotency_finalized_by"
#: DRF's own ``finalize_response``, as imported (not as a test may patch it).
_DRF_FINALIZE = APIView.finalize_response


def finish(request: Request, response: HttpResponseBase) -> HttpResponseBase:
    """One rendering rule for the mixin and ``@api_view``: the view finalises, then it renders.

    DRF gives a ``Response`` its renderer in ``finalize_response``, after the
    handler returns; doing it now lets the bytes be stored as they will be
    sent. A plain template response (which DRF passes through) is rendered too.
    """
    if isinstance(response, Response) and not response.is_rendered:
        view = request.parser_context["view"]
        response = view.finalize_response(request, response)
        setattr(response, _FINALIZED_BY, id(view))
    if isinstance(response, SimpleTemplateResponse):
        # As core.render does, without its frame; render() does nothing for
        # a response already rendered, so it is not asked first.
        response.render()
    return response


def refuse_above_api_view(view: Any) -> None:
    """Refuse ``@idempotent`` above ``@api_view`` (or on ``as_view()``): it scopes too early.

    The decorator would see the plain ``HttpRequest``, before DRF's
    authentication ran, so every token or JWT caller would share one
    scope and one caller could receive another's stored response.
    """
    view_class = getattr(view, "cls", None) or getattr(view, "view_class", None)
    if not (isinstance(view_class, type) and issubclass(view_class, APIView)):
        return
    name = view_class.__name__  # @api_view names its class after the function
    if "WrappedAPIView" in view_class.__qualname__:  # what @api_view makes
        fix = (
            f"Put @idempotent below @api_view, next to the function:\n\n"
            f"    @api_view([...])\n    @idempotent\n    def {name}(request): ..."
        )
    else:
        fix = (
            f"Protect the DRF view class with IdempotentMixin instead: "
            f"class {view_class.__name__}(IdempotentMixin, ...)."
        )
    raise ImproperlyConfigured(
        f"@idempotent is applied to the DRF view {name!r} from outside, where it sees "
        "the request before DRF authenticates it: every caller would share one scope "
        f"and could receive another's stored response. {fix}"
    )


def _claimed_after_authentication(response: HttpResponseBase, request: Any) -> HttpResponseBase:
    """Refuse a DRF view's response under a claim taken on Django's request, before DRF ran.

    Only a layer that could not see the view was DRF's claims that way:
    ``IdempotencyMiddleware`` or ``@idempotent`` outside a decorator that
    hides the view's class (no ``functools.wraps``). Its scope was taken
    before DRF authenticated the caller, so callers that only DRF tells
    apart (an API key header) would share it, and one be replayed
    another's response past DRF's permission checks. Nothing is stored:
    in atomic mode the handler's writes roll back with the claim.
    """
    context = getattr(response, "renderer_context", None) or {}
    view = context.get("view")
    if isinstance(request, Request) or not isinstance(view, APIView):
        return response
    raise ImproperlyConfigured(
        f"{type(view).__module__}.{type(view).__qualname__} is a DRF view, but its idempotency "
        "key was claimed before DRF authenticated the caller, by IdempotencyMiddleware or "
        "@idempotent around a decorator that hides the view's class (one without "
        "functools.wraps): callers that only DRF tells apart would share one scope. Keep "
        "the view visible (functools.wraps in that decorator), or leave it out of the "
        "middleware with @idempotency_exempt and protect it with IdempotentMixin."
    )


ATTRIBUTE_PREFIX = "idempotency_"
_ATTRIBUTES = tuple(ATTRIBUTE_PREFIX + name for name in OPTION_NAMES)
#: A class's ``idempotency_*`` attributes, read in one call.
_read_attributes = operator.attrgetter(*_ATTRIBUTES)


class IdempotentMixin:
    """Protect a DRF view's handlers; options as ``idempotency_<option>`` attributes.

    Put it before the DRF base class: ``class OrderViewSet(IdempotentMixin,
    ModelViewSet)``. Attributes left ``None`` fall back to the setting of
    the same name. The order, the attribute names and their values are
    checked when the class is created (see docs/drf.rst).
    """

    # One ``idempotency_<option>`` attribute per option, each None: set below
    # the class, from the options table.
    _idempotency_options: DeclaredOptions
    # The ``idempotency_*`` attributes as last read, and those of them that
    # are properties (read per request): see view_options.
    _idempotency_properties: tuple[tuple[Any, ...], list[str]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _check_order(cls)
        _check_attribute_names(cls)
        cls._idempotency_options = _class_options(cls, {})
        cls._idempotency_properties = (_read_attributes(cls), _properties(cls))

    @classmethod
    def as_view(cls, *args: Any, **initkwargs: Any) -> Any:
        """Validate ``idempotency_*`` arguments; keep lease mode out of ``ATOMIC_REQUESTS``.

        Lease mode must commit its claim before the handler runs, which a
        request-wide transaction would prevent. Django decides this from the
        view function before DRF's ``dispatch`` ever runs, so it is settled
        here, from the attribute, the ``as_view`` argument or the setting.
        """
        given = {name: value for name, value in initkwargs.items() if name in _ATTRIBUTES}
        options = _class_options(cls, given) if given else cls._idempotency_options
        if given:
            initkwargs["_idempotency_options"] = options
        view = super().as_view(*args, **initkwargs)  # type: ignore[misc]
        marked: frozenset[str] = getattr(view, "_non_atomic_requests", frozenset())
        view._non_atomic_requests = NonAtomicRequests(options, marked)
        return view

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)  # type: ignore[misc]
        _protect_handler(self, request, view_options(self), error_response)

    def finalize_response(
        self, request: Request, response: HttpResponseBase, *args: Any, **kwargs: Any
    ) -> HttpResponseBase:
        """DRF's, which has nothing left to do for a response this view finalised to store it.

        It would only set what it set then (the renderer, ``Allow``; ``Vary``
        was taken), so it is skipped for that response, as long as what
        finalises after this class is DRF's own: a base class's may not
        repeat itself, and runs again.
        """
        finalize = super().finalize_response  # type: ignore[misc]
        if (
            response.__dict__.pop(_FINALIZED_BY, None) == id(self)
            and getattr(finalize, "__func__", None) is _DRF_FINALIZE
        ):
            return response
        return finalize(request, response, *args, **kwargs)


_CO_COROUTINE = inspect.CO_COROUTINE


def _protect_handler(view: Any, request: Request, options: DeclaredOptions, answer: Answer) -> None:
    """Shadow the handler DRF is about to call, on the instance, with a protected one.

    DRF looks the handler up after ``initial()``, which has authenticated
    the caller and checked permissions and throttles; ViewSets set their
    actions on the instance the same way. ``answer`` answers our errors:
    through the view's exception handling, or as problem details.

    The handler of every method the view protects is shadowed too: a method
    override set after this runs (in a subclass's ``initial()`` after
    ``super()``) makes DRF dispatch on a method not seen here, and that
    handler must not run unprotected. The core protects each under the
    method it reads when the handler is called.
    """
    # The method DRF dispatches on: one set on DRF's request itself (an
    # override, clone_request) comes first, as DRF's proxy would give it.
    http_request, own, _ = reach(request)
    method = (method_of(http_request, own) or "").lower()
    _shadow(view, method, options, answer)
    for protected_method in (options.resolved or options.resolve()).methods:
        other = protected_method.lower()
        if other != method and getattr(view, other, None) is not None:
            _shadow(view, other, options, answer)


def _shadow(view: Any, method: str, options: DeclaredOptions, answer: Answer) -> None:
    """Shadow the view's handler of ``method``, if it has one, with a protected one."""
    handler = getattr(view, method, None)
    if handler is None:
        return
    sender = type(view)
    # iscoroutinefunction(handler), without its calls for a plain method: a
    # function with nothing in its __dict__ carries no marker that makes it
    # a coroutine function, so its code's flag is the whole answer.
    function = getattr(handler, "__func__", handler)
    if type(function) is FunctionType and not function.__dict__:
        is_async = bool(function.__code__.co_flags & _CO_COROUTINE)
    else:
        is_async = iscoroutinefunction(handler)
    if is_async:
        # An async handler of an adrf view (docs/async.rst).

        async def protected_async(request: Request, *args: Any, **kwargs: Any) -> Any:
            call = partial(handler, request, *args, **kwargs)
            guard = Guard(finish=partial(finish, request), answer=answer)
            return await guard.acall(request, call, options, sender)

        setattr(view, method, protected_async)
        return

    def protected(request: Request, *args: Any, **kwargs: Any) -> HttpResponseBase:
        # Guard.call without building a guard per request.
        call = partial(handler, request, *args, **kwargs)
        try:
            # protect reads Django's request inside DRF's now, as the handler is called
            # with it, not as initial() saw it: a project may replace it in between.
            return protect(request, call, options, sender=sender, finish=partial(finish, request))
        except core_exceptions.IdempotencyError as error:
            return answer(request, error)

    setattr(view, method, protected)


def protect_after_authentication(view_func: Any, options: DeclaredOptions, wrapper: Any) -> Any:
    """``@idempotent`` on a DRF view's ``dispatch``: protect its handler, after authentication.

    ``method_decorator`` hands the decorator, for each request, a method of
    the view bound to it. Around ``dispatch`` the scope would come from
    Django's request, before DRF authenticates the caller, so callers that
    DRF tells apart by a token or an API key header would share one scope,
    and a replay would skip DRF's permission checks. So ``dispatch`` runs
    as it is, and the handler it picks once ``initial()`` has authenticated
    the caller (and checked permissions and throttles) is protected with
    the decorator's options, as ``IdempotentMixin`` protects it; errors are
    answered as problem details, as a decorator's are. Any other method
    (a handler, a generic view's ``create``, a helper) keeps ``wrapper``.
    """
    view = dispatched_view(view_func)
    if not isinstance(view, APIView):
        return wrapper
    if iscoroutinefunction(wrapper):  # an ``async def dispatch`` of the project's own

        @wraps(view_func)
        async def dispatch_async(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            return await _dispatch_protecting_the_handler(
                view, view_func, options, request, *args, **kwargs
            )

        return dispatch_async

    @wraps(view_func)
    def dispatch(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        return _dispatch_protecting_the_handler(view, view_func, options, request, *args, **kwargs)

    return dispatch


def _dispatch_protecting_the_handler(
    view: APIView,
    dispatch: Any,
    options: DeclaredOptions,
    request: HttpRequest,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Run ``dispatch``, protecting the handler that DRF picks after ``initial()``.

    A ``dispatch`` of the project's own that answers without DRF's (and so
    before any authentication) is not protected: that is logged, as the
    decorator did nothing there.
    """
    authenticated = view.initial
    reached: list[bool] = []

    def initial(drf_request: Request, *a: Any, **kw: Any) -> None:
        reached.append(True)
        authenticated(drf_request, *a, **kw)
        _protect_handler(view, drf_request, options, problem_for)

    view.initial = initial  # type: ignore[method-assign, assignment]
    response = dispatch(request, *args, **kwargs)
    if not inspect.isawaitable(response):
        _unless_reached(reached, view, request, options)
        return response

    async def awaited() -> Any:  # an adrf view's dispatch
        answered = await response
        _unless_reached(reached, view, request, options)
        return answered

    return awaited()


def _unless_reached(
    reached: list[bool], view: APIView, request: HttpRequest, options: DeclaredOptions
) -> None:
    if reached:
        return
    try:
        sent = may_claim(request, options.resolve())
    except core_exceptions.IdempotencyError:
        sent = True  # a bad key (a form's field sent twice) is a key all the same
    if not sent:
        return
    logger.warning(
        "%s.dispatch answered a request with an idempotency key without running DRF's "
        "initial(), so @idempotent on dispatch protected nothing: it protects the handler "
        "that DRF calls once it has authenticated the caller. Protect the code that answers "
        "instead (a view of its own, or a method DRF calls).",
        type(view).__qualname__,
    )


for _attribute in _ATTRIBUTES:
    setattr(IdempotentMixin, _attribute, None)


def view_options(view: IdempotentMixin) -> DeclaredOptions:
    """The options this view instance protects its handlers with, read now.

    The class's, or its ``as_view()`` arguments'; an option given as a
    property is read from the instance and checked now, as each request does.
    """
    options = view._idempotency_options
    cls = type(view)
    # Which options are properties is looked for again only when the
    # attributes, read in one call, are no longer what they were when it was
    # last looked for: the class, or a base, was patched since.
    values = _read_attributes(cls)
    seen, dynamic = cls._idempotency_properties
    if values != seen:
        dynamic = _properties(cls)
        cls._idempotency_properties = (values, dynamic)
    if dynamic:
        given = {name: getattr(view, name) for name in _ATTRIBUTES}
        given = {name: given[name] for name in [*dynamic, *vars(view)] if name in given}
        options = _class_options(type(view), given)
    return options


def _properties(cls: type) -> list[str]:
    """The options ``cls`` gives as properties, read per request (a class may be patched)."""
    found = []
    for name in _ATTRIBUTES:  # a loop, not a comprehension: one frame less
        if isinstance(getattr(cls, name), property):
            found.append(name)
    return found


def _class_options(cls: type, given: dict[str, Any]) -> DeclaredOptions:
    """The options of ``cls``: its attributes, then ``given`` (``as_view`` arguments)."""
    values = {name: getattr(cls, ATTRIBUTE_PREFIX + name) for name in OPTION_NAMES}
    for name in _properties(cls):
        values[name[len(ATTRIBUTE_PREFIX) :]] = None  # read per request
    values.update({name[len(ATTRIBUTE_PREFIX) :]: value for name, value in given.items()})
    return DeclaredOptions(values, lambda name: f"{cls.__qualname__}.{ATTRIBUTE_PREFIX}{name}")


def _check_order(cls: type) -> None:
    """The mixin must come before APIView, whose ``initial`` and ``as_view`` never reach it."""
    mro = cls.__mro__
    if APIView in mro and mro.index(APIView) < mro.index(IdempotentMixin):
        ours = next(base for base in cls.__bases__ if issubclass(base, IdempotentMixin))
        bases = [base for base in cls.__bases__ if base is not ours]
        fixed = ", ".join(base.__name__ for base in [ours, *bases])
        raise ImproperlyConfigured(
            f"{cls.__qualname__} lists {ours.__name__} after a DRF view class, so its "
            f"requests would not be protected. Put the mixin first: "
            f"class {cls.__name__}({fixed})."
        )
    if APIView not in mro and issubclass(cls, View):
        raise ImproperlyConfigured(
            f"{cls.__qualname__} is a Django view, not a DRF one: IdempotentMixin protects "
            "DRF views only. Decorate its handlers with "
            "@method_decorator(idempotent, name='post') instead."
        )


def _check_attribute_names(cls: type) -> None:
    """A misspelt ``idempotency_*`` attribute would be ignored: refuse it instead."""
    for name in vars(cls):
        if name in _ATTRIBUTES or name.startswith("__"):
            continue
        close = difflib.get_close_matches(name, _ATTRIBUTES, n=1, cutoff=0.85)
        if name.startswith(ATTRIBUTE_PREFIX) or close:
            hint = f"Did you mean {close[0]!r}? " if close else ""
            raise ImproperlyConfigured(
                f"{cls.__qualname__}.{name} is not an IdempotentMixin option. {hint}"
                f"The options are: {', '.join(_ATTRIBUTES)}."
            )


# Which DRF handlers ``@idempotent`` protects, for view_protection below.


def _decorated_options(func: Any, depth: int = 0) -> DeclaredOptions | None:
    """The options ``@idempotent`` gave ``func``, what it wraps, or a function its closure calls.

    ``@api_view`` routes every method through one ``handler`` closure over
    the decorated function, so that is where the decorator's mark is found.
    """
    if func is None or depth > 4:
        return None
    options = getattr(func, "idempotency_options", None)
    if isinstance(options, DeclaredOptions):
        return options
    inner = [getattr(func, "__wrapped__", None)]
    for cell in getattr(func, "__closure__", None) or ():
        try:
            inner.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    for candidate in inner:
        if callable(candidate) and not isinstance(candidate, type):
            found = _decorated_options(candidate, depth + 1)
            if found is not None:
                return found
    return None


def decorated_options(view_class: type, name: str) -> DeclaredOptions | None:
    """The options ``@idempotent`` gave ``view_class``'s method ``name``, if it decorates it.

    ``name`` is a handler or ``dispatch``; the mixin's own options are not
    the answer.
    """
    return _decorated_options(getattr(view_class, name, None))


#: DRF's own handlers that hand the request to another method of the view:
#: a generic view's ``post`` calls ``create``, ``partial_update`` calls
#: ``update``. A decorated ``create`` or ``update`` protects them too.
_HANDED_TO: dict[Any, str] = {
    getattr(view, method): target
    for view, methods in [
        (generics.CreateAPIView, {"post": "create"}),
        (generics.ListCreateAPIView, {"post": "create"}),
        (generics.UpdateAPIView, {"put": "update", "patch": "partial_update"}),
        (generics.RetrieveUpdateAPIView, {"put": "update", "patch": "partial_update"}),
        (generics.DestroyAPIView, {"delete": "destroy"}),
        (generics.RetrieveDestroyAPIView, {"delete": "destroy"}),
        (
            generics.RetrieveUpdateDestroyAPIView,
            {"put": "update", "patch": "partial_update", "delete": "destroy"},
        ),
        (mixins.UpdateModelMixin, {"partial_update": "update"}),
    ]
    for method, target in methods.items()
}


def handler_chain(view_class: type, name: str) -> list[str]:
    """``name``, then the methods DRF's own ``name`` hands the request to, in call order."""
    chain = [name]
    handed_to = _HANDED_TO.get(getattr(view_class, name, None))
    while handed_to is not None and handed_to not in chain:
        chain.append(handed_to)
        handed_to = _HANDED_TO.get(getattr(view_class, handed_to, None))
    return chain


def handler_name(view: Any, method: str) -> str | None:
    """The handler a DRF view function runs for ``method``: a ViewSet's action, else the method."""
    actions = getattr(view, "actions", None)
    if actions is not None:
        name: str | None = actions.get(method.lower())
        return name
    return method.lower()


# How DRF views are protected: DRF's answer to protection.view_protection.

_FOR_MIDDLEWARE: weakref.WeakKeyDictionary[Any, tuple[bool, Any]] = weakref.WeakKeyDictionary()


def view_protection(view: Any, method: str, instance: Any = None) -> ViewProtection | None:
    """How ``method`` of the DRF view function ``view`` is protected; ``None`` for a view not DRF's.

    Its layers in the order of the run time: ``@idempotent`` on
    ``dispatch`` protects the handler outside every other layer; the mixin
    wraps the handler; ``@idempotent`` on the handler, or on a method DRF's
    handler hands the request to (a generic view's ``create``), is
    innermost. ``instance``, an instance of the view's class, gives the
    mixin's options as read from it (``as_view()`` arguments, properties).

    DRF authenticates inside the view, after every middleware, so the
    middleware cannot take the scope itself. A DRF view that protects
    nothing itself is protected by the middleware as a subclass with
    ``IdempotentMixin`` in front, built once, with the same ``as_view``
    arguments: the mixin's path, which claims the key after DRF's
    authentication, permissions and throttling.
    """
    view_class = getattr(view, "cls", None)
    if not (isinstance(view_class, type) and issubclass(view_class, APIView)):
        return None
    exempt = is_exempt(view, method)
    name = handler_name(view, method)
    if name is None or not hasattr(view_class, name):
        return ViewProtection(exempt=exempt)  # DRF answers 405 itself
    # The handler and the methods it hands the request to (a generic view's
    # ``post`` calls ``create``): one of them decorated protects the view with
    # its own options, one of them exempt leaves it out.
    chain = handler_chain(view_class, name)
    exempt = exempt or any(
        getattr(getattr(view_class, each, None), EXEMPT_ATTRIBUTE, False) for each in chain
    )
    layers = []
    dispatch = decorated_options(view_class, "dispatch")
    if dispatch is not None:
        # Answers its errors as a decorator does, not through DRF's handler.
        layers.append(Layer(dispatch, problem_details=True))
    if issubclass(view_class, IdempotentMixin):
        mixin = view_class._idempotency_options if instance is None else view_options(instance)
        layers.append(Layer(mixin))
    for handler in chain:
        options = decorated_options(view_class, handler)
        if options is not None:
            layers.append(Layer(options))
    if exempt or layers:
        return ViewProtection(layers=tuple(layers), protects_itself=bool(layers), exempt=exempt)
    return ViewProtection(middleware=partial(_for_middleware, view, view_class))


def _for_middleware(view: Any, view_class: type) -> tuple[Any, DeclaredOptions]:
    """The version of ``view`` the middleware calls in its place, and its options."""
    # A view that manages its own transactions runs in lease mode, as the
    # middleware runs a plain one.
    lease = idempotency_settings.database in getattr(view, "_non_atomic_requests", ())
    made = _FOR_MIDDLEWARE.get(view)
    if made is None or made[0] != lease:
        made = _FOR_MIDDLEWARE[view] = (lease, _with_mixin(view, view_class, lease))
    return made[1], made[1].cls._idempotency_options


def _with_mixin(view: Any, view_class: type, lease: bool) -> Any:
    attributes: dict[str, Any] = {
        "__module__": view_class.__module__,
        "__qualname__": view_class.__qualname__,
        "__doc__": view_class.__doc__,
    }
    if lease:
        attributes["idempotency_atomic"] = False
    protected = type(view_class.__name__, (IdempotentMixin, view_class), attributes)
    initkwargs = getattr(view, "initkwargs", {})
    actions = getattr(view, "actions", None)
    if actions is not None:
        return protected.as_view(actions, **initkwargs)  # type: ignore[attr-defined]
    return protected.as_view(**initkwargs)  # type: ignore[attr-defined]


#: Everything the package knows of DRF, handed to it in one piece.
ADAPTER = Adapter(
    name="Django REST framework",
    request_class=Request,
    # A C callable, not a function: asked for each read of Django's request.
    django_request=operator.attrgetter("_request"),
    finish=finish,
    answer=error_response,
    negotiated_format=lambda request: getattr(request, "accepted_media_type", None),
    parsed_body=lambda request: getattr(request, "data", None),
    response_class=Response,
    check_claimed=_claimed_after_authentication,
    check_placement=refuse_above_api_view,
    adapt_placement=protect_after_authentication,
    view_protection=view_protection,
)
register(ADAPTER)
