"""Django REST framework integration: ``IdempotentMixin`` and API exceptions.

The mixin protects the handler after DRF's ``initial()``: authentication, permissions and
throttling answer before any key is claimed, and the scope sees DRF's user (token, JWT,
session). Async handlers of ``adrf`` views go through the same core.
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
from django.db import connections
from django.http import HttpRequest, HttpResponseBase
from django.template.response import SimpleTemplateResponse
from django.views import View
from django.views.decorators.csrf import csrf_exempt
from rest_framework import exceptions, generics, mixins
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import exceptions as core_exceptions
from django_idempotency.adapters import Adapter, Layer, register
from django_idempotency.conf import idempotency_settings
from django_idempotency.core import Answer, Guard, claimed_on, may_claim, protect
from django_idempotency.decorators import dispatched_view
from django_idempotency.marks import EXEMPT_ATTRIBUTE, is_exempt
from django_idempotency.options import OPTION_NAMES, DeclaredOptions, NonAtomicRequests
from django_idempotency.protection import ViewProtection
from django_idempotency.responses import problem_for

# Not __name__: the name projects' LOGGING configurations use.
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
    """Answer ``error`` through the view's exception handling (the project's ``EXCEPTION_HANDLER``).

    Headers DRF has no place for, such as ``Link: <...>; rel="describedby"``, are added.
    """
    view = request.parser_context["view"]
    response = view.handle_exception(to_api_exception(error))
    for name, value in error.headers().items():
        if name not in response:
            response[name] = value
    return response


#: Set on a response :func:`finish` had its view finalise: the view's ``id()``, so that
#: ``IdempotentMixin.finalize_response`` does not finalise it again.
_FINALIZED_BY = "_idempotency_finalized_by"
#: DRF's own ``finalize_response``, as imported (not as a test may patch it).
_DRF_FINALIZE = APIView.finalize_response


def finish(request: Request, response: HttpResponseBase) -> HttpResponseBase:
    """One rendering rule for the mixin and ``@api_view``: the view finalises, then it renders.

    DRF gives a ``Response`` its renderer in ``finalize_response``, after the handler returns;
    doing it now stores the bytes as they will be sent. A template response is rendered too.
    """
    if isinstance(response, Response) and not response.is_rendered:
        view = request.parser_context["view"]
        response = view.finalize_response(request, response)
        setattr(response, _FINALIZED_BY, id(view))
    if isinstance(response, SimpleTemplateResponse):
        # render() does nothing for a rendered response: no need to ask first.
        response.render()
    return response


def refuse_above_api_view(view: Any) -> None:
    """Refuse ``@idempotent`` above ``@api_view`` (or on ``as_view()``): it scopes too early.

    It would see Django's request before DRF authenticates: every token or JWT caller would
    share one scope, and one could receive another's stored response.
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


def _refuse_a_claim_taken_before_authentication(view: APIView, request: Request) -> None:
    """Refuse to run a DRF view inside a claim taken on Django's request, before DRF ran.

    Only a layer that could not see the view claims so (``IdempotencyMiddleware``, or
    ``@idempotent`` outside a decorator without ``functools.wraps``). Its scope was taken
    before DRF authenticated the caller, so callers only DRF tells apart (an API key header,
    a token in a cookie) would share it, and one be replayed another's response past DRF's
    permission checks, whatever the view returns. Refused before DRF authenticates and
    before the handler runs: nothing acted, and the claim is given back.
    """
    http_request = request._request
    if claimed_on(http_request) is not http_request:
        return
    raise ImproperlyConfigured(
        f"{type(view).__module__}.{type(view).__qualname__} is a DRF view, but its idempotency "
        "key was claimed before DRF authenticated the caller: by IdempotencyMiddleware or "
        "@idempotent around a decorator that hides the view's class (one without "
        "functools.wraps), or by a protected view that called this one with its own "
        "request. Callers that only DRF tells apart would share one scope. Keep the view "
        "visible (functools.wraps in that decorator), or leave it out of the middleware "
        "with @idempotency_exempt and protect it with IdempotentMixin; call a DRF view "
        "from outside any claim."
    )


#: DRF's own ``APIView.initial``, which every DRF view (adrf's too) calls before its handler.
_DRF_INITIAL = APIView.initial


def _initial(self: APIView, request: Request, *args: Any, **kwargs: Any) -> None:
    _refuse_a_claim_taken_before_authentication(self, request)
    _DRF_INITIAL(self, request, *args, **kwargs)


# Every DRF view, since a layer that cannot see a view cannot see that it is DRF's.
APIView.initial = _initial  # type: ignore[method-assign]


ATTRIBUTE_PREFIX = "idempotency_"
_ATTRIBUTES = tuple(ATTRIBUTE_PREFIX + name for name in OPTION_NAMES)
#: A class's ``idempotency_*`` attributes, read in one call.
_read_attributes = operator.attrgetter(*_ATTRIBUTES)


class IdempotentMixin:
    """Protect a DRF view's handlers; options as ``idempotency_<option>`` attributes.

    Put it before the DRF base class: ``class OrderViewSet(IdempotentMixin, ModelViewSet)``.
    Attributes left ``None`` fall back to the setting of the same name. The order, the
    attribute names and their values are checked when the class is created.
    """

    # Each ``idempotency_<option>`` attribute is set to None below the class.
    _idempotency_options: DeclaredOptions
    # The ``idempotency_*`` attributes as last read, and which are properties: view_options.
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

        Lease mode commits its claim before the handler, which a request-wide transaction
        would prevent; Django decides that from the view function, before ``dispatch``.
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

        It would only set what it set then (the renderer, ``Allow``; ``Vary`` was taken), so it
        is skipped for that response, as long as what finalises after this class is DRF's own:
        a base class's may not repeat itself, and runs again.
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
    """Shadow, on the instance, the handler of every method the view protects.

    DRF looks the handler up after ``initial()`` has authenticated the caller and checked
    permissions and throttles. Every protected method's handler is shadowed, not only the
    request's: a method override set later (a subclass's ``initial()`` after ``super()``)
    makes DRF dispatch on another method, whose handler must not run unprotected; the core
    reads the method DRF dispatches on as each handler is called. A handler called by
    another (``self.post(clone_request(request, "POST"))``) runs inside that one's claim.
    """
    sender = type(view)
    for name in (options.resolved or options.resolve()).handler_names:
        handler = getattr(view, name, None)
        if handler is not None:
            setattr(view, name, _protected(handler, options, answer, sender))


def _protected(handler: Any, options: DeclaredOptions, answer: Answer, sender: type) -> Any:
    """``handler``, protected with ``options``; ``answer`` turns a refusal into a response."""
    # iscoroutinefunction(handler), cheaper: a function with an empty __dict__ carries no
    # marker, so its code's flag is the whole answer.
    function = getattr(handler, "__func__", handler)
    if type(function) is FunctionType and not function.__dict__:
        is_async = bool(function.__code__.co_flags & _CO_COROUTINE)
    else:
        is_async = iscoroutinefunction(handler)
    if is_async:

        async def protected_async(request: Request, *args: Any, **kwargs: Any) -> Any:
            call = partial(handler, request, *args, **kwargs)
            guard = Guard(finish=partial(finish, request), answer=answer)
            return await guard.acall(request, call, options, sender)

        return protected_async

    def protected(request: Request, *args: Any, **kwargs: Any) -> HttpResponseBase:
        # Guard.call without building a guard per request.
        call = partial(handler, request, *args, **kwargs)
        try:
            # protect reads Django's request inside DRF's now, as the handler is called
            # with it, not as initial() saw it: a project may replace it in between.
            return protect(request, call, options, sender=sender, finish=partial(finish, request))
        except core_exceptions.IdempotencyError as error:
            return answer(request, error)

    return protected


def protect_after_authentication(view_func: Any, options: DeclaredOptions, wrapper: Any) -> Any:
    """``@idempotent`` on a DRF view's ``dispatch``: protect its handler, after authentication.

    Around ``dispatch`` the scope would come from Django's request before DRF authenticates,
    so callers DRF tells apart by a token or an API key header would share one, and a replay
    would skip DRF's permission checks. So ``dispatch`` runs as it is, and the handler it
    picks after ``initial()`` is protected with the decorator's options, as the mixin does,
    errors answered as problem details. ``method_decorator`` hands this a bound method per
    request; any other than ``dispatch`` keeps ``wrapper``.
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

    A ``dispatch`` of the project's own that answers without DRF's (and so before any
    authentication) is not protected: that is logged when the request carries a key (or one
    is required), as the decorator did nothing there.
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

    The class's or its ``as_view()`` arguments'; an option given as a property is read from
    the instance and checked per request.
    """
    options = view._idempotency_options
    cls = type(view)
    # Properties are looked for again only when the attributes changed (a patched class).
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


def _decorated_options(func: Any, depth: int = 0) -> DeclaredOptions | None:
    """The options ``@idempotent`` gave ``func``, what it wraps, or a function its closure calls.

    ``@api_view`` routes every method through one ``handler`` closure over the function.
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
    """The options ``@idempotent`` gave ``view_class``'s handler or ``dispatch`` ``name``."""
    return _decorated_options(getattr(view_class, name, None))


#: DRF's handlers that hand the request to another method (a generic view's ``post`` calls
#: ``create``): a decorated ``create`` protects ``post`` too.
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


_FOR_MIDDLEWARE: weakref.WeakKeyDictionary[Any, tuple[bool, Any]] = weakref.WeakKeyDictionary()


def view_protection(view: Any, method: str, instance: Any = None) -> ViewProtection | None:
    """How ``method`` of the DRF view function ``view`` is protected; ``None`` for a view not DRF's.

    Layers, outermost first: ``@idempotent`` on ``dispatch``; the mixin; ``@idempotent`` on
    the handler or a method it hands the request to (a generic view's ``create``).
    ``instance`` gives the mixin's options as read from it (``as_view()`` arguments,
    properties). DRF authenticates inside the view, after every middleware, so a DRF view
    that protects nothing itself is protected under the middleware as a subclass with
    ``IdempotentMixin`` in front (built once, same ``as_view`` arguments), which claims the
    key after DRF's authentication, permissions and throttling.
    """
    view_class = getattr(view, "cls", None)
    if not (isinstance(view_class, type) and issubclass(view_class, APIView)):
        return None
    exempt = is_exempt(view, method)
    name = handler_name(view, method)
    if name is None or not hasattr(view_class, name):
        return ViewProtection(exempt=exempt)  # DRF answers 405 itself
    # One of the chain decorated protects the view with its options; one exempt leaves it out.
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
    if not _as_drf_built_it(view, view_class):
        return ViewProtection(middleware=partial(_refuse_decorated, view_class))
    return ViewProtection(middleware=partial(_for_middleware, view, view_class))


#: Per view function, whether it is what DRF's ``as_view()`` returned, with nothing around it.
_BUILT_BY_DRF: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _as_drf_built_it(view: Any, view_class: type) -> bool:
    """Whether ``view`` is DRF's ``as_view()`` function itself, not a decorator around it.

    ``functools.wraps`` copies ``cls`` to a decorator (``login_required``): the middleware's
    build, called in the view's place, would skip it. Told apart by the functions along
    ``__wrapped__``, against a view the class builds now.
    """
    known = _BUILT_BY_DRF.get(view)
    if known is None:
        built = _as_view(view_class, view)
        known = _BUILT_BY_DRF[view] = _wrapped_codes(view) == _wrapped_codes(built)
    return known


def _wrapped_codes(function: Any) -> list[Any]:
    codes: list[Any] = []
    # Bounded, as inspect.unwrap is: a __wrapped__ that loops back never ends.
    while function is not None and len(codes) < 100:
        code = getattr(function, "__code__", None)
        if code not in _CSRF_EXEMPT:
            codes.append(code)
        function = getattr(function, "__wrapped__", None)
    return codes


async def _async_view(request: Any) -> None: ...


#: ``csrf_exempt``'s wrappers only mark a view, which DRF's ``as_view()`` does already: one
#: around it changes nothing the build would skip.
_CSRF_EXEMPT = frozenset(csrf_exempt(view).__code__ for view in (lambda request: None, _async_view))


def _refuse_decorated(view_class: type) -> tuple[Any, DeclaredOptions]:
    """Refuse to protect a DRF view inside a decorator that the middleware cannot call through."""
    raise ImproperlyConfigured(
        f"{view_class.__module__}.{view_class.__qualname__} is a DRF view that protects "
        "nothing itself, inside a decorator (such as login_required) around its as_view(). "
        "IdempotencyMiddleware protects such a view after DRF authenticates the caller, by "
        "calling a version of it with IdempotentMixin in front, which would skip that "
        "decorator. Protect the view itself (IdempotentMixin, or @idempotent below "
        "@api_view), move the decorator onto the class's dispatch with method_decorator, "
        "or mark the view @idempotency_exempt."
    )


def _for_middleware(view: Any, view_class: type) -> tuple[Any, DeclaredOptions]:
    """The version of ``view`` the middleware calls in its place, and its options."""
    # A view that manages its own transactions runs in lease mode, as a plain one does.
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
    built = _as_view(protected, view)
    built._non_atomic_requests = _AsDjangoWouldWrap(
        protected._idempotency_options,  # type: ignore[attr-defined]
        frozenset(getattr(view, "_non_atomic_requests", ())),
    )
    return built


class _AsDjangoWouldWrap(NonAtomicRequests):
    """The build's ``_non_atomic_requests``: the resolved view's, so that it runs in the
    request transactions Django would open around that view, in either mode.

    A lease claimed inside one takes a connection of its own, as under ``@api_view``; but on
    SQLite the lease stays on the request's connection, where a worker killed mid-view would
    roll the claim back and let a retry run again: there lease mode keeps the build out of
    the key's database's request transaction, as the mixin does.
    """

    def _aliases(self) -> frozenset[str]:
        using = idempotency_settings.database
        if self._options.atomic or connections[using].vendor != "sqlite":
            return self._also
        return self._also | {using}


def _as_view(view_class: Any, view: Any) -> Any:
    """``view_class.as_view()`` with the ``as_view()`` arguments (and actions) ``view`` had."""
    initkwargs = getattr(view, "initkwargs", {})
    actions = getattr(view, "actions", None)
    if actions is not None:
        return view_class.as_view(actions, **initkwargs)
    return view_class.as_view(**initkwargs)


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
    check_placement=refuse_above_api_view,
    adapt_placement=protect_after_authentication,
    view_protection=view_protection,
)
register(ADAPTER)
