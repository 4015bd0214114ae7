"""``IdempotencyMiddleware``: protect every view at once, with the settings' defaults.

It wraps the rest of the stack (later middleware, ``ATOMIC_REQUESTS``, the view) in
:func:`core.protect`: the request's transaction nests inside ours in atomic mode and starts
after our committed claim in lease mode. Which views it protects, and how, it asks
:func:`~django_idempotency.protection.view_protection`: not those that protect themselves or
opt out (``@idempotency_exempt``), nor the admin's. A framework that authenticates inside the
view (DRF) protects its views after its authentication; the middleware calls that version in
place of the resolved view.

What Django does around a view shapes the rest:

- a view marked ``transaction.non_atomic_requests`` for our database runs in lease mode;
- an exception the view raises reaches us as Django's response (403, 404, 500), through
  ``process_exception``: a failure, never stored; in atomic mode a deadlock or a lost Galera
  certification is answered there instead, and the claim starts over, as it does under the
  decorator;
- a template response is rendered after the view returned (``process_template_response``
  says so): an exception then is the rendering's, after the view acted, and the response
  cannot be kept (lease mode completes the key with a refusal; atomic mode rolls back);
- a view that authenticates the request itself does so after the scope is taken: the default
  scope folds an unauthenticated request's ``Authorization`` header into it
  (:mod:`django_idempotency.scopes`), so one client's token never replays another's answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asgiref.sync import async_to_sync, iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.apps import apps
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections, transaction
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.urls import Resolver404, resolve
from django.utils.module_loading import import_string

from django_idempotency.adapters import NOT_A_FRAMEWORKS
from django_idempotency.body import SPOOLS
from django_idempotency.conf import idempotency_settings
from django_idempotency.core import (
    may_send_key,
    protect,
    protect_async,
    protected_method,
    read_form_key,
    render,
    sent_key,
)
from django_idempotency.exceptions import IdempotencyError, InvalidIdempotencyKey
from django_idempotency.marks import idempotency_exempt
from django_idempotency.options import DeclaredOptions
from django_idempotency.protection import view_protection
from django_idempotency.responses import aproblem, discard, problem
from django_idempotency.store import lost_race

__all__ = ["IdempotencyMiddleware", "idempotency_exempt"]

# Set by process_view: the request passed every other middleware's checks (CSRF, login);
# ours is the last process_view, or the middleware refuses to load (misplaced()).
_REACHED_VIEW = "_idempotency_reached_view"
# Set by process_exception: the view raised; get_response returns Django's response to it.
_VIEW_RAISED = "_idempotency_view_raised"
# Set by __call__: the view process_view calls in place of the resolved one.
_CALL_INSTEAD = "_idempotency_call_instead"
# Set by process_template_response: the view returned a response Django renders after it.
_VIEW_RETURNED = "_idempotency_view_returned"
# Set by process_exception after the view returned: what rendering its response raised.
_RENDER_FAILED = "_idempotency_render_failed"
# Set by process_exception, in the claim's thread: the view's error that rolled the whole
# attempt back.
_LOST_ATTEMPT = "_idempotency_lost_attempt"
# Set by __call__ in atomic mode: an attempt that lost its whole transaction starts over.
_STARTS_OVER = "_idempotency_starts_over"
#: What one attempt leaves on the request: cleared before each, as the engine may start over.
_ATTEMPT_MARKS = (_REACHED_VIEW, _VIEW_RAISED, _VIEW_RETURNED, _RENDER_FAILED, _LOST_ATTEMPT)


class _NotReached(Exception):
    """Another middleware answered before the view ran: give the key back."""

    def __init__(self, response: HttpResponseBase) -> None:
        self.response = response


class _NotRendered(Exception):
    """The view returned, and its response failed to render: Django answered ``response``."""

    def __init__(self, response: HttpResponseBase) -> None:
        super().__init__("The view's response could not be rendered.")
        self.response = response


def _has_key(request: HttpRequest) -> bool:
    """Whether the request sent a key, valid or not: a bad one is the view's 400 to answer."""
    try:
        return sent_key(request) is not None
    except InvalidIdempotencyKey:
        return True  # a form's field sent twice: refused once the view is known


class IdempotencyMiddleware:
    """Protect every view answering a method in ``METHODS``, sync or async.

    Put it at the end of ``MIDDLEWARE``: after ``AuthenticationMiddleware``,
    whose user the default scope reads, and after ``CsrfViewMiddleware``, so
    that a request refused before its view never consumes its key.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        problem = misplaced()
        if problem is not None and ORDER_CHECK_ID not in settings.SILENCED_SYSTEM_CHECKS:
            # Never serve with the wrong scope: gunicorn and uvicorn run no system checks.
            raise ImproperlyConfigured(" ".join(problem))
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)
            # A sync process_view would cost an async stack a thread hop per request.
            self.process_view = self._process_view_async  # type: ignore[method-assign,assignment]
            self.process_template_response = self._process_template_response_async  # type: ignore[method-assign,assignment]

    def __call__(self, request: HttpRequest) -> Any:
        if self.async_mode:
            return self._call_async(request)
        protection = _protection(request)
        # Looking for a form's key copies the body: this layer's copy, closed with its response.
        copies_before = len(request.__dict__.get(SPOOLS, ()))
        arguments = None if protection is None else _chosen(request, protection, copies_before)
        if arguments is None:
            return self.get_response(request)

        def handler() -> HttpResponseBase:
            for mark in _ATTEMPT_MARKS:  # the engine may start over
                request.__dict__.pop(mark, None)
            return self._reached_view(request, self.get_response(request))

        try:
            return protect(request, handler, **arguments)
        except (_NotReached, _NotRendered) as unfinished:
            return unfinished.response
        except IdempotencyError as error:
            return problem(error, request)

    async def _call_async(self, request: HttpRequest) -> HttpResponseBase:
        protection = _protection(request)
        copies_before = len(request.__dict__.get(SPOOLS, ()))
        arguments = None
        if protection is not None:
            if not idempotency_settings.required:
                await read_form_key(request)
            arguments = _chosen(request, protection, copies_before)
        if arguments is None:
            response: HttpResponseBase = await self.get_response(request)
            return response

        async def handler() -> HttpResponseBase:
            for mark in _ATTEMPT_MARKS:
                request.__dict__.pop(mark, None)
            return self._reached_view(request, await self.get_response(request))

        try:
            return await protect_async(request, handler, **arguments)
        except (_NotReached, _NotRendered) as unfinished:
            return unfinished.response
        except IdempotencyError as error:
            return await aproblem(error, request)

    def process_view(
        self, request: HttpRequest, view_func: Any, view_args: Any, view_kwargs: Any
    ) -> HttpResponseBase | None:
        view = self._view_instead(request)
        return None if view is None else view(request, *view_args, **view_kwargs)

    async def _process_view_async(
        self, request: HttpRequest, view_func: Any, view_args: Any, view_kwargs: Any
    ) -> HttpResponseBase | None:
        view = self._view_instead(request)
        return None if view is None else await view(request, *view_args, **view_kwargs)

    def _view_instead(self, request: HttpRequest) -> Any:
        """Mark the view reached; the view to call in the resolved one's place, if any.

        Called as this middleware is: a coroutine function in async mode, a plain one else.
        """
        setattr(request, _REACHED_VIEW, True)
        instead = getattr(request, _CALL_INSTEAD, None)
        if instead is None:
            return None
        view = _in_request_transactions(instead)
        if iscoroutinefunction(view) == self.async_mode:
            return view
        return (
            sync_to_async(view, thread_sensitive=True) if self.async_mode else async_to_sync(view)
        )

    def process_template_response(
        self, request: HttpRequest, response: HttpResponseBase
    ) -> HttpResponseBase:
        # Called in reverse order, ours first: the view returned, nothing is rendered yet.
        _returned(request)
        return response

    async def _process_template_response_async(
        self, request: HttpRequest, response: HttpResponseBase
    ) -> HttpResponseBase:
        """:meth:`process_template_response`, awaited in async mode rather than run in a thread."""
        _returned(request)
        return response

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        # Django always calls this hook synchronously, in either mode: in the thread of the
        # claim's connection, which the event loop's thread does not see.
        if getattr(request, _VIEW_RETURNED, False):
            # Raised by the rendering, after the view acted (see _finish). Never started over:
            # Django has committed the request's transactions on other databases by then.
            setattr(request, _RENDER_FAILED, exception)
            return None
        setattr(request, _VIEW_RAISED, exception)
        if request.__dict__.get(_STARTS_OVER) and _lost_the_attempt(request, exception):
            setattr(request, _LOST_ATTEMPT, exception)
            # Answered here, so that Django neither reports it as the request's error nor
            # renders its 500: the engine starts over, and this response is dropped.
            return HttpResponse(status=500)
        return None

    @staticmethod
    def _reached_view(request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
        if not getattr(request, _REACHED_VIEW, False):
            raise _NotReached(response)
        # Taken off the request: its traceback holds the view's frames, which hold the request.
        raised: Exception | None = request.__dict__.pop(_VIEW_RAISED, None)
        if raised is None:
            return response
        if request.__dict__.pop(_LOST_ATTEMPT, None) is raised:
            # process_exception answered it in Django's place; the engine starts the claim
            # over, as it does when the view raises it under the decorator: nothing of the
            # attempt committed.
            raise raised
        # Nothing stored; atomic mode rolls back what the view wrote before raising.
        return discard(response)


#: What :func:`view_protection` gives for a view the middleware protects.
_Protects = Callable[[], tuple[Any, DeclaredOptions]]


def _protection(request: HttpRequest) -> tuple[Any, _Protects] | None:
    """The view ``request`` resolves to, and how the middleware protects it if a key is sent.

    ``None`` for a view it leaves alone (exempt, the admin's, one that protects itself),
    decided before the body is read for a form's key: an unprotected request's body is the
    view's alone, for its own upload handlers. Without a header or a form, no URL is resolved.
    """
    conf = idempotency_settings
    method = protected_method(request, NOT_A_FRAMEWORKS, conf.methods)
    if method is None:
        return None
    if not conf.required and not may_send_key(request):
        return None
    try:
        match = resolve(request.path_info, urlconf=getattr(request, "urlconf", None))
    except Resolver404:
        return None
    if "admin" in match.app_names:
        # An AdminSite's URLs: its forms cannot send a key.
        return None
    by_middleware = view_protection(match.func, method).middleware
    return None if by_middleware is None else (match.func, by_middleware)


def _chosen(
    request: HttpRequest, protection: tuple[Any, _Protects], copies_before: int
) -> dict[str, Any] | None:
    """What :func:`protect` is given besides the handler, for the view it protects, or ``None``.

    ``None`` without a key (unless ``REQUIRED``), and for a framework's view that protects
    itself: that version of it is left on the request for process_view. Marks, in atomic
    mode, that an attempt which lost its whole transaction starts over.
    """
    if not idempotency_settings.required and not _has_key(request):
        return None
    view, by_middleware = protection
    protected, options = by_middleware()
    if protected is not view:
        setattr(request, _CALL_INSTEAD, protected)
        return None
    request.__dict__[_STARTS_OVER] = (options.resolved or options.resolve()).atomic
    return {
        "options": options,
        "sender": view,
        "finish": _finish(request),
        "copies_before": copies_before,
    }


def _lost_the_attempt(request: HttpRequest, error: Exception) -> bool:
    """Whether ``error`` rolled back the atomic-mode claim's whole transaction, and nothing else.

    A deadlock, or a lost Galera certification, reported by one of the view's own statements.
    Not when the view ran in a request transaction on another database: that one may have
    committed before the error (the claim's own ``RELEASE SAVEPOINT`` after the view), and a
    new attempt would write there again.
    """
    if not isinstance(error, DatabaseError):
        return False
    using = idempotency_settings.database
    # The view Django wrapped in its request transactions. (An error from the one our
    # process_view calls in its place reaches no process_exception.)
    match = request.resolver_match
    view = match.func if match else None
    if any(alias != using for alias in _request_transaction_aliases(view)):
        return False
    return connections[using].in_atomic_block and lost_race(using, error)


def _returned(request: HttpRequest) -> None:
    """Mark that the view returned a response, unless Django made it of the view's exception."""
    if _VIEW_RAISED not in request.__dict__:
        setattr(request, _VIEW_RETURNED, True)


def _finish(request: HttpRequest) -> Callable[[HttpResponseBase], HttpResponseBase]:
    """How the engine finishes the response of ``request``'s view: :func:`core.render`.

    If Django failed to render the view's template response, raises instead: the engine ends
    the call as one whose result cannot be kept, and the middleware answers Django's response.
    """

    def finish(response: HttpResponseBase) -> HttpResponseBase:
        failure: Exception | None = request.__dict__.pop(_RENDER_FAILED, None)
        if failure is None:
            return render(response)
        raise _NotRendered(response) from failure

    return finish


#: The system check that reports what :func:`misplaced` finds.
ORDER_CHECK_ID = "django_idempotency.E006"


def misplaced() -> tuple[str, str] | None:
    """``(message, fix)`` when ``IdempotencyMiddleware`` is listed where it cannot be right.

    Listed before ``AuthenticationMiddleware``, ``RemoteUserMiddleware`` or
    ``SessionMiddleware``, it takes the scope before Django knows the user or the session, and
    every caller looks anonymous: one user's key replays another's stored response. Before
    another middleware's hooks: :func:`_view_hook_after`.
    Subclasses count as the class they extend; WSGI and ASGI share one ``MIDDLEWARE``.
    """
    middleware = settings.MIDDLEWARE
    ours = _first_subclass(IdempotencyMiddleware, middleware)
    if ours is None:
        return None
    if apps.is_installed("django.contrib.auth"):
        # Without it, the auth middleware cannot be imported, let alone used.
        from django.contrib.auth.middleware import AuthenticationMiddleware, RemoteUserMiddleware

        authentication = _first_subclass(AuthenticationMiddleware, middleware)
        if authentication is not None and authentication[0] > ours[0]:
            return _misplaced(ours[1], authentication[1], "every session user")
        remote = _first_subclass(RemoteUserMiddleware, middleware[ours[0] + 1 :])
        if remote is not None:
            return _misplaced(ours[1], remote[1], "every remote user")
    # A project without the auth middleware still scopes its guests by their session; its
    # middleware needs no app installed (signed cookies, cache-backed sessions).
    from django.contrib.sessions.middleware import SessionMiddleware

    session = _first_subclass(SessionMiddleware, middleware[ours[0] + 1 :])
    if session is not None:
        return _misplaced(ours[1], session[1], "every guest's browser", known="the session")
    return _view_hook_after(ours[1], middleware[ours[0] + 1 :])


def _view_hook_after(ours: str, later: list[str]) -> tuple[str, str] | None:
    """``(message, fix)`` when a middleware listed after ours hooks into the view's call.

    Django calls ``process_view`` hooks in ``MIDDLEWARE`` order and lets none wrap the view's
    call, so ours must run last to know the view was reached: else a later hook's refusal
    (CSRF's 403, ``LoginRequiredMiddleware``'s redirect) would be stored and replayed to the
    corrected request for the ``TTL``, and a DRF view, which our hook calls, would skip that
    hook. ``process_exception`` hooks run the other way and stop at the first that answers: a
    later one would make the view's exception a response, stored as the view's own with the
    writes made before it raised.
    """
    for path in later:
        try:
            candidate = import_string(path)
        except ImportError:
            continue
        if isinstance(candidate, type) and issubclass(candidate, IdempotencyMiddleware):
            continue
        if hasattr(candidate, "process_view"):
            why = (
                "Listed before a middleware that may refuse a request before its view "
                "(CSRF, login), it would store that refusal for the key and replay it "
                "to the corrected request."
            )
        elif hasattr(candidate, "process_exception"):
            why = (
                "Listed before a middleware that may turn a view's exception into a "
                "response, it would store that response as the view's own, with what the "
                "view wrote before it raised, instead of rolling it back."
            )
        else:
            continue
        return (
            f"{ours!r} must come after {path!r} in MIDDLEWARE.",
            f"Move {ours!r} below {path!r}, best to the end of MIDDLEWARE. {why}",
        )
    return None


def installed() -> bool:
    """Whether ``IdempotencyMiddleware`` (or a subclass) is in ``MIDDLEWARE``."""
    return _first_subclass(IdempotencyMiddleware, settings.MIDDLEWARE) is not None


def listed_after() -> list[str]:
    """The middleware listed after ``IdempotencyMiddleware``, which its answers skip (``W006``).

    Replays and our 400, 409 and 422 never reach them; one that cancels the view or answers
    in its place (a timeout) hides how the view ended.
    """
    middleware = settings.MIDDLEWARE
    ours = _first_subclass(IdempotencyMiddleware, middleware)
    if ours is None:
        return []
    return [
        path
        for path in middleware[ours[0] + 1 :]
        if _is_subclass(path, IdempotencyMiddleware) is False
    ]


def _misplaced(ours: str, theirs: str, users: str, known: str = "the user") -> tuple[str, str]:
    return (
        f"{ours!r} must come after {theirs!r} in MIDDLEWARE.",
        f"Move {ours!r} below {theirs!r}, best to the end of MIDDLEWARE. "
        f"Listed before it, the scope is taken before Django knows {known}: "
        f"{users} would be 'anonymous' and could receive another user's "
        "stored response.",
    )


def _first_subclass(cls: type, paths: list[str]) -> tuple[int, str] | None:
    """The position and path of the first entry of ``paths`` that is ``cls`` or a subclass."""
    for index, path in enumerate(paths):
        if _is_subclass(path, cls):
            return index, path
    return None


def _is_subclass(path: str, cls: type) -> bool | None:
    """Whether the middleware at ``path`` is ``cls`` or a subclass; ``None`` if not importable.

    Django itself reports a middleware that cannot be imported.
    """
    try:
        candidate = import_string(path)
    except ImportError:
        return None
    return isinstance(candidate, type) and issubclass(candidate, cls)


def _in_request_transactions(view: Any) -> Any:
    """``view`` wrapped as Django wraps the views it calls itself for ``ATOMIC_REQUESTS``.

    We call it from process_view, so we wrap it: same exclusions, same refusal of async views.
    """
    for alias in _request_transaction_aliases(view):
        if iscoroutinefunction(view):
            raise RuntimeError("You cannot use ATOMIC_REQUESTS with async views.")
        view = transaction.atomic(using=alias)(view)
    return view


def _request_transaction_aliases(view: Any) -> list[str]:
    """The databases whose ``ATOMIC_REQUESTS`` transaction wraps ``view``, as Django decides."""
    excluded = getattr(view, "_non_atomic_requests", ())
    return [
        alias
        for alias, settings_dict in connections.settings.items()
        if settings_dict["ATOMIC_REQUESTS"] and alias not in excluded
    ]
