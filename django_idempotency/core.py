"""Requests through the engine: the key, the scope and the fingerprint, and the answers.

The decorator, the DRF mixin and the middleware are adapters over :func:`protect` and
:func:`protect_async`. A :class:`Guard` holds what they differ in: how a response is finished
before it is stored, and how an error of ours is answered.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from typing import Any

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponseBase
from django.template.response import SimpleTemplateResponse

from django_idempotency import adapters, engine
from django_idempotency.adapters import NOT_A_FRAMEWORKS
from django_idempotency.asynchronous import run_async
from django_idempotency.body import SPOOLS, close_spools_with, django_request, read_in_part
from django_idempotency.conf import idempotency_settings
from django_idempotency.exceptions import (
    DatabaseBusy,
    FingerprintMismatch,
    IdempotencyError,
    IdempotencyKeyRequired,
    InvalidIdempotencyKey,
    RequestInFlight,
    ResultNotStored,
)
from django_idempotency.fields import FINGERPRINT_COLUMN_LENGTH
from django_idempotency.fingerprint import fingerprint_of, request_fingerprint
from django_idempotency.forms import form_key, is_form
from django_idempotency.info import IdempotencyInfo
from django_idempotency.keys import PLAIN_KEY, check_key, meta_name, parse_key
from django_idempotency.options import DeclaredOptions, Options
from django_idempotency.pages import prefers_html
from django_idempotency.responses import capture, is_storable, problem, problem_for, replay
from django_idempotency.scopes import fit_key_column, scope_of, user_scope
from django_idempotency.store import StoredResponse

Handler = Callable[[], HttpResponseBase]
AsyncHandler = Callable[[], Awaitable[HttpResponseBase]]
Finish = Callable[[HttpResponseBase], HttpResponseBase]
Answer = Callable[[Any, IdempotencyError], HttpResponseBase]
Reached = adapters.Reached

# Set on Django's request by the layer that claims the key, while its call runs: its options
# and the request it took the scope from, so that an inner layer, given that request, a
# framework's copy of it or Django's under it, can tell whether it would protect it the same
# way (_protected_outside). Removed when the call ends: the same request sent through again
# is a retry.
_PROTECTED_WITH = "_idempotency_protected_with"
# Kept on Django's request from its first claim on: each record (scope, key) a layer claimed
# for it, to that layer's options and sender (_refuse_a_held_record).
_HELD = "_idempotency_held"


def render(response: HttpResponseBase) -> HttpResponseBase:
    """Render a template response now, inside the transaction: what is stored is what is sent."""
    if isinstance(response, SimpleTemplateResponse) and not response.is_rendered:
        response.render()
    return response


def _encode(response: HttpResponseBase) -> StoredResponse | None:
    if not is_storable(response):
        return None
    conf = idempotency_settings
    return capture(response, conf.stored_headers, conf.max_stored_body)


def _decode(stored: StoredResponse) -> HttpResponseBase:
    return replay(stored, idempotency_settings.replay_header)


def _check_policy_answer(policy: Callable[..., Any], answer: Any) -> None:
    if answer is not None and not isinstance(answer, HttpResponseBase):
        raise TypeError(
            f"The recovery policy {policy!r} returned {type(answer).__name__}; it must return "
            "an HttpResponse (a stored one completes the key, another holds it) or None "
            "(to take the abandoned claim over and run the view)."
        )


def _refuse_text(what: str, value: Any, source: Any) -> None:
    """Refuse, with the fix, a scope or fingerprint function's value that is not a string."""
    raise TypeError(
        f"The {what} function {source!r} returned {type(value).__name__}, not a string. "
        f"A {what} function takes the request and returns a str."
    )


def _not_stored() -> StoredResponse:
    """The refusal that completes a key whose response could not be kept (500 problem+json)."""
    return capture(problem(ResultNotStored()), idempotency_settings.stored_headers, 1 << 20)


#: How the engine keeps and gives back a response, and the errors a request meets.
RESPONSES = engine.Kind(
    encode=_encode,
    decode=_decode,
    in_flight=lambda retry_after: RequestInFlight(retry_after=retry_after),
    mismatch=FingerprintMismatch,
    database_busy=lambda: DatabaseBusy(retry_after=1),
    unstorable=_not_stored,
    check_answer=_check_policy_answer,
)


def protect(
    request: HttpRequest,
    handler: Handler,
    options: DeclaredOptions,
    *,
    sender: Any,
    finish: Finish = render,
    copies_before: int | None = None,
) -> HttpResponseBase:
    """Run ``handler`` once per key and replay its response to every retry.

    ``finish`` makes the response the bytes that will be sent (DRF renders), so what is
    stored is what the client got. Raises an
    :class:`~django_idempotency.exceptions.IdempotencyError` for 400/409/422; a
    :class:`Guard` answers those. ``copies_before``: how many copies of the body there
    were before this layer began, when it made one before calling this (a form's key).
    """
    # A framework's request (DRF's) is read through the Django request inside it now, as
    # the handler is called with it (adapters.reach).
    if isinstance(request, HttpRequest):
        reached: Reached = (request, NOT_A_FRAMEWORKS, None)
    else:
        reached = adapters.reach(request)
    http_request = reached[0]
    outer = http_request.__dict__.get(_PROTECTED_WITH)
    if outer is not None:
        # Inside another claim, whose layer reads the body into its copy and closes it.
        return _protect_inside(request, reached, options, sender, finish, handler)
    # The copies of the body made before (a caller's, which may still read it) stay open.
    if copies_before is None:
        copies_before = len(http_request.__dict__.get(SPOOLS, ()))
    try:
        # The fingerprint reads the body into a copy, which becomes the body the view reads.
        call = _call(request, reached, options, sender, finish)
        if call is None:
            response: HttpResponseBase = handler()
        else:
            try:
                response = call.run(handler)
            finally:
                del http_request.__dict__[_PROTECTED_WITH]
    except BaseException as error:
        _ended_with(error, http_request, copies_before)
        raise
    close_spools_with(http_request, response, copies_before)
    return response


def _ended_with(error: BaseException, http_request: HttpRequest, copies_before: int) -> None:
    """After an error or a refusal the copy stays the body until Django closes the request.

    Django's error page and error report, and a middleware logging the body, read it. It is
    closed at once when the view began to read it itself (``read_in_part``) or on a
    ``BaseException`` that is not an ``Exception``.
    """
    if not isinstance(error, Exception) or read_in_part(http_request):
        close_spools_with(http_request, None, copies_before)


def _protect_inside(
    request: HttpRequest,
    reached: Reached,
    options: DeclaredOptions,
    sender: Any,
    finish: Finish,
    handler: Handler,
) -> HttpResponseBase:
    """:func:`protect` inside another claim: it runs inside it, or claims a record of its own.

    Either way the caller's mark and ``request.idempotency`` are put back when it ends.
    """
    http_request = reached[0]
    outer = http_request.__dict__[_PROTECTED_WITH]
    kept = request.__dict__.get("idempotency")
    call = _call(request, reached, options, sender, finish)
    try:
        return handler() if call is None else call.run(handler)
    finally:
        http_request.__dict__[_PROTECTED_WITH] = outer
        request.__dict__["idempotency"] = kept
        if kept is None:
            del request.__dict__["idempotency"]


async def protect_async(
    request: HttpRequest,
    handler: AsyncHandler,
    options: DeclaredOptions,
    *,
    sender: Any,
    copies_before: int | None = None,
    finish: Finish = render,
) -> HttpResponseBase:
    """:func:`protect` for a coroutine handler: the same rules, and it finishes when cancelled.

    ``copies_before`` is :func:`protect`'s.
    """
    if _protected_outside(request, options, sender):
        return await handler()
    # Reading a form's key copies the body, here, before protect() begins.
    http_request = request if isinstance(request, HttpRequest) else django_request(request)
    if copies_before is None:
        copies_before = len(http_request.__dict__.get(SPOOLS, ()))
    if not await _may_claim_async(request, options.resolve()):
        # Nothing to claim: skip the hop to the request's thread.
        try:
            response = await handler()
        except BaseException as error:
            _ended_with(error, http_request, copies_before)
            raise
        close_spools_with(request, response, copies_before)
        return response

    def run(body: Handler) -> HttpResponseBase:
        # Finished in the request's thread: rendering a template may run queries.
        return protect(
            request, body, options, sender=sender, finish=finish, copies_before=copies_before
        )

    try:
        return await run_async(run, handler, dropped=_release)
    except asyncio.CancelledError:
        # The call has ended (run_async waits for it), and Django does not close a cancelled
        # request: a copy an error or a refusal left to the request's close is closed now.
        close_spools_with(http_request, None, copies_before)
        raise


def _release(response: HttpResponseBase) -> None:
    """Run the closers of a response a cancellation dropped: the body's copies are among them.

    Not ``close()``, which also sends ``request_finished``: Django's ASGI handler sends it for
    the cancelled request, and an async receiver cannot be called from the event loop's thread.
    """
    closers = response._resource_closers  # type: ignore[attr-defined]
    for closer in closers:
        with suppress(Exception):
            closer()
    closers.clear()


def _call(
    request: HttpRequest,
    reached: Reached,
    declared: DeclaredOptions,
    sender: Any,
    finish: Finish,
) -> engine.Call | None:
    """The engine's call for this request, or ``None`` when it is not protected.

    Not protected: disabled, a method the view does not protect, no key and none required
    (:func:`may_claim`, asked here with the key read once), or an outer layer protects it
    as this one would (one that protects it otherwise raises ``ImproperlyConfigured``,
    :func:`_protected_outside`).

    ``reached`` is what ``adapters.reach(request)`` gives: Django's request (``request`` or
    the one inside it), what was set on a framework's ``request`` itself, which comes
    first, and the framework's adapter. The default scope and fingerprint are given it.
    """
    http_request, own, adapter = reached
    if _PROTECTED_WITH in http_request.__dict__ and _protected_outside(request, declared, sender):
        return None
    # Resolved once per view, until the settings change.
    options = declared.resolved or declared.resolve()
    conf = idempotency_settings
    if protected_method(http_request, own, options.methods) is None:
        return None
    raw_key = None if options.key is not None else http_request.META.get(meta_name(conf.header))
    if raw_key is not None:
        # The header (sent_key's common case, without the call).
        max_length, min_length = conf.key_max_length, conf.key_min_length
        if min_length <= len(raw_key) <= max_length and PLAIN_KEY.match(raw_key):
            key = raw_key  # parse_key's common case, without the call: a valid bare key
        else:
            key = parse_key(raw_key, max_length, min_length)
    else:
        raw_key = sent_key(request, options)
        if raw_key is None:
            if not options.required:
                return None  # no key sent, or the view's key function found none
            raise IdempotencyKeyRequired(_missing_key(request, options))
        # A key function's value or a form's field has no header syntax to parse.
        key = check_key(raw_key, conf.key_max_length, conf.key_min_length)
    if options.scope is user_scope:
        scope = scope_of(request, http_request, own)
    else:
        scope = options.scope(request)
    if not isinstance(scope, str):
        _refuse_text("scope", scope, options.scope)
    if options.fingerprint is request_fingerprint:
        fingerprint = fingerprint_of(request, http_request, own, adapter)
    else:
        fingerprint = options.fingerprint(request)
    if not isinstance(fingerprint, str):
        _refuse_text("fingerprint", fingerprint, options.fingerprint)
    if len(fingerprint) > FINGERPRINT_COLUMN_LENGTH:
        # The column fits a SHA-256 hex digest: a longer custom value is digested, not cut.
        fingerprint = hashlib.sha256(fingerprint.encode()).hexdigest()
    info = IdempotencyInfo(key=key, scope=fit_key_column(scope), fingerprint=fingerprint)
    record = (info.scope, key)
    held = http_request.__dict__.get(_HELD)
    if held is None:
        held = http_request.__dict__[_HELD] = {}
    elif record in held:
        _refuse_a_held_record(info, options, sender, held[record], http_request)
    held[record] = (options, sender)
    request.idempotency = info  # type: ignore[attr-defined]
    http_request.__dict__[_PROTECTED_WITH] = (options, request)

    def finished(response: HttpResponseBase) -> HttpResponseBase:
        if finish is not render:
            return finish(response)
        if isinstance(response, SimpleTemplateResponse) and not response.is_rendered:
            response.render()
        return response

    return engine.Call(
        info,
        options,
        RESPONSES,
        sender,
        request,
        recover=options.recover,
        finish=finished,
        using=conf.database,
    )


def claimed_on(http_request: HttpRequest) -> Any:
    """The request object the claim running on Django's ``http_request`` was taken on, if any.

    ``http_request`` itself for a claim a layer took before any framework ran (the
    middleware, ``@idempotent``); a framework's request (DRF's) for one taken after it
    authenticated the caller.
    """
    protected_with = http_request.__dict__.get(_PROTECTED_WITH)
    return None if protected_with is None else protected_with[1]


#: What decides whose response a caller gets and how the effect commits. Layers may differ
#: in the rest (``@idempotent`` on ``dispatch`` over a mixin that requires a key).
_DECISIVE = ("scope", "key", "fingerprint", "atomic", "store")


def _protected_outside(request: HttpRequest, declared: DeclaredOptions, sender: Any) -> bool:
    """Whether an outer layer already protects this request, as this one would.

    One does when ``IdempotencyMiddleware`` cannot see that a view protects itself (a
    decorator without ``functools.wraps`` hides ``@idempotent``'s mark), and when a
    protected handler hands its request, a copy (DRF's ``clone_request``) or Django's under
    it to another protected with the same ``_DECISIVE`` options (functions by identity):
    that one runs inside the claim, with its ``request.idempotency``. Given a copy or
    Django's request, a layer whose options differ claims a record of its own, as a view
    of its own does. Raises ``ImproperlyConfigured`` before the handler runs, so the outer
    layer stores nothing: when the options differ for the same request, as one client
    could be replayed another's response; and whatever the options, when this layer runs
    on a framework's request (DRF's) and the outer one claimed on Django's, scoped before
    the framework authenticated the caller.
    """
    http_request = request if isinstance(request, HttpRequest) else adapters.reach(request)[0]
    outer: tuple[Options, Any] | None = http_request.__dict__.get(_PROTECTED_WITH)
    if outer is None:
        return False
    outer_options, claimed_on = outer
    name = _name(sender)
    if claimed_on is http_request and request is not http_request:
        raise ImproperlyConfigured(
            f"{name} protects itself inside a layer that claimed the request's key on "
            "Django's request, before the view's framework authenticated the caller: "
            "IdempotencyMiddleware, @idempotent around a decorator that hides the view's "
            "class, or a protected view that calls this one with its request. Its scope "
            "would not tell apart the callers that only the framework knows. Keep the view "
            "visible (functools.wraps in that decorator), leave it out of the middleware "
            "with @idempotency_exempt, or call the code behind the view rather than the view."
        )
    inner = declared.resolve()
    differ = [o for o in _DECISIVE if getattr(inner, o) != getattr(outer_options, o)]
    if not differ:
        if request is not claimed_on:
            request.idempotency = claimed_on.idempotency  # type: ignore[attr-defined]
        return True
    if request is not claimed_on:
        return False
    raise ImproperlyConfigured(
        f"{name} protects itself with other options "
        f"({', '.join(differ)}) than the layer that already protects this request, "
        "usually IdempotencyMiddleware, which could not see that the view protects "
        "itself: a decorator around it hides @idempotent's mark. Keep the mark visible "
        "(functools.wraps in that decorator, functools.update_wrapper in a callable "
        "class), or leave the view out of the middleware with @idempotency_exempt."
    )


def _refuse_a_held_record(
    info: IdempotencyInfo,
    options: Options,
    sender: Any,
    held: tuple[Options, Any],
    http_request: HttpRequest,
) -> None:
    """Refuse a claim of a record a layer already claimed for this request, unless a retry.

    Inside a claim, a layer given a copy of the request (or Django's under DRF's) whose options
    differ claims a record of its own: one a claim of this request holds would have it wait
    for that claim, or be answered that one's response. Views cannot be told apart by name
    (``method_decorator`` names them all ``View.dispatch``), so there each record is claimed
    once. Once the claims have ended, the same request sent through again with the options
    it was claimed with is a retry (replayed); with other options it would be answered a
    response they did not decide, and is refused.
    """
    held_options, holder = held
    inside = _PROTECTED_WITH in http_request.__dict__
    differ = [o for o in _DECISIVE if getattr(options, o) != getattr(held_options, o)]
    if not inside and not differ:
        return
    why = (
        "it would wait for that claim, or be answered its response"
        if inside
        else f"with other options ({', '.join(differ)}), it would be answered its response"
    )
    raise ImproperlyConfigured(
        f"{_name(sender)} was given a request whose record (scope {info.scope!r} and its key) "
        f"{_name(holder)} claimed already: {why}. Give each protected view a request "
        "and a record of its own (a scope of its own), the same options so that one runs "
        "inside the other's claim, or call the code behind the view rather than the view."
    )


def _name(sender: Any) -> str:
    return f"{getattr(sender, '__module__', '')}.{getattr(sender, '__qualname__', repr(sender))}"


def may_claim(request: HttpRequest, options: Options) -> bool:
    """Whether this request may be protected: enabled, a protected method, a key or required.

    A view's ``key`` function is asked once, by :func:`_call`, in the request's thread: it
    may read the body or the database.
    """
    http_request, own, _ = adapters.reach(request)
    if protected_method(http_request, own, options.methods) is None:
        return False
    return options.required or options.key is not None or sent_key(request) is not None


def protected_method(
    http_request: HttpRequest, own: Mapping[str, Any], methods: frozenset[str]
) -> str | None:
    """The method the view dispatches on, in capitals, if protection applies to it; else ``None``.

    ``http_request`` and ``own`` are what ``adapters.reach`` gives: an override set on a
    framework's request comes first. Views dispatch on a method in any case (a middleware's
    ``request.method = "post"`` runs ``post``), so it is compared in capitals with
    ``methods``. Asked before any key is looked for, by every layer; the fingerprint hashes
    the method as set, since a view may tell ``post`` from ``POST``.
    """
    method: str | None = own.get("method") or http_request.method
    if method is not None and not method.isupper():
        method = method.upper()
    if not idempotency_settings.enabled or method not in methods:
        return None
    return method


async def _may_claim_async(request: HttpRequest, options: Options) -> bool:
    """:func:`may_claim`, with a form's key read in a thread (:func:`read_form_key`)."""
    http_request, own, _ = adapters.reach(request)
    if (
        not options.required
        and options.key is None
        and protected_method(http_request, own, options.methods) is not None
    ):
        await read_form_key(request)
    return may_claim(request, options)


def sent_key(request: HttpRequest, options: Options | None = None) -> str | None:
    """The view's ``key`` function's value, else the ``HEADER``, else a form's ``FORM_FIELD``.

    ``None`` when there is no key. The header is read from ``META``: ``request.headers``
    builds a mapping of every header, which a replay never needs.
    """
    if options is not None and options.key is not None:
        return options.key(request)
    conf = idempotency_settings
    value: str | None = request.META.get(meta_name(conf.header))
    if value is None and conf.form_field is not None:
        return _form_key(request, conf.form_field)
    return value


def _form_key(request: HttpRequest, field: str) -> str | None:
    # Read once per request: the adapters ask whether there is a key before claiming it.
    key, refusal = _read_form_key(request, field)
    if refusal is not None:
        raise InvalidIdempotencyKey(refusal)
    return key


def _read_form_key(request: HttpRequest, field: str) -> tuple[str | None, str | None]:
    """The form's key, or the reason it is refused, read from the body once per request."""
    http_request = django_request(request)
    read: tuple[str | None, str | None] | None = getattr(http_request, _FORM_KEY, None)
    if read is None:
        try:
            read = (form_key(request, field), None)
        except InvalidIdempotencyKey as error:
            read = (None, error.detail)
        setattr(http_request, _FORM_KEY, read)
        if read[0] is not None:
            _hide_in_error_reports(http_request, field)
    return read


def _hide_in_error_reports(http_request: HttpRequest, field: str) -> None:
    """Leave a form's key out of Django's error reports, as it leaves out the header's.

    A key replays the stored response to whoever has it. Django's reports hide the POST
    fields named in ``sensitive_post_parameters``; a view's own
    ``@sensitive_post_parameters`` sets that list anew, and must name the field itself.
    """
    hidden = getattr(http_request, "sensitive_post_parameters", None)
    if hidden != "__ALL__":
        http_request.sensitive_post_parameters = [*(hidden or ()), field]  # type: ignore[attr-defined]


async def read_form_key(request: HttpRequest) -> None:
    """Read a form's key from the body in a thread, so that :func:`sent_key` finds it read.

    Under ASGI the body is a temporary file, on disk past ``FILE_UPLOAD_MAX_MEMORY_SIZE``,
    and multipart files are digested as parsed: not work for the event loop.
    """
    field = idempotency_settings.form_field
    if field is None or not _key_in_body(request) or hasattr(django_request(request), _FORM_KEY):
        return
    await sync_to_async(_read_form_key, thread_sensitive=True)(request, field)


def may_send_key(request: HttpRequest) -> bool:
    """Whether the request may have sent a key (the header, or a form): the body is not read."""
    conf = idempotency_settings
    if meta_name(conf.header) in request.META:
        return True
    return conf.form_field is not None and is_form(request)


def _key_in_body(request: HttpRequest) -> bool:
    """Whether a key would be read from the body: no header, a ``FORM_FIELD``, a form."""
    conf = idempotency_settings
    return (
        conf.form_field is not None
        and meta_name(conf.header) not in request.META
        and is_form(request)
    )


_FORM_KEY = "_idempotency_form_key"


def _missing_key(request: HttpRequest, options: Options) -> str:
    if options.key is None:
        conf = idempotency_settings
        if conf.form_field is not None and is_form(request):
            return (
                f"This form has no idempotency key: render {{% idempotency_key_field %}} "
                f"inside it (the {conf.form_field} field), or send an {conf.header} header."
            )
        return f"This endpoint requires an {conf.header} header."
    # A key function may say where the key should have been (the presets do).
    source = getattr(options.key, "source", None)
    if isinstance(source, str):
        return (
            f"This endpoint requires an idempotency key, {source}, "
            "and none was found in the request."
        )
    return "This endpoint requires an idempotency key, and none was found in the request."


@dataclass(frozen=True)
class Guard:
    """How one kind of request finishes its responses and answers our errors."""

    finish: Finish = render
    answer: Answer = problem_for

    def call(
        self, request: HttpRequest, handler: Handler, options: DeclaredOptions, sender: Any
    ) -> HttpResponseBase:
        try:
            return protect(request, handler, options, sender=sender, finish=self.finish)
        except IdempotencyError as error:
            return self.answer(request, error)

    async def acall(
        self, request: HttpRequest, handler: AsyncHandler, options: DeclaredOptions, sender: Any
    ) -> HttpResponseBase:
        try:
            return await protect_async(request, handler, options, sender=sender, finish=self.finish)
        except IdempotencyError as error:
            if prefers_html(request):
                # A page's template may query the database: not in the event loop.
                return await sync_to_async(self.answer, thread_sensitive=True)(request, error)
            return self.answer(request, error)


PLAIN = Guard()


def guard_for(request: HttpRequest) -> Guard:
    """The guard for a request: plain Django's, or its framework's, from its adapter."""
    if isinstance(request, HttpRequest):
        return PLAIN
    adapter = adapters.for_request(request)
    if adapter is None:
        return PLAIN
    finish = render if adapter.finish is None else partial(adapter.finish, request)
    return Guard(finish=finish, answer=adapter.answer or problem_for)
