"""Requests through the engine: the key, the scope and the fingerprint, and the answers.

The decorator, the DRF mixin and the middleware are thin adapters over
:func:`protect` (sync handlers) and :func:`protect_async` (coroutines). This
module reads what identifies a request, tells the engine
(:mod:`django_idempotency.engine`) how a response is stored and replayed,
and holds what the adapters differ in, a :class:`Guard`: how a response is
finished before it is stored (DRF renders through the view) and how an
error of ours is answered (problem details, or DRF's exception handler).
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponseBase
from django.template.response import SimpleTemplateResponse

from django_idempotency import adapters, engine
from django_idempotency.adapters import NOT_A_FRAMEWORKS
from django_idempotency.asynchronous import run_async
from django_idempotency.body import close_spools_with, django_request
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
from django_idempotency.fingerprint import method_of
from django_idempotency.forms import form_key, is_form
from django_idempotency.info import IdempotencyInfo
from django_idempotency.keys import PLAIN_KEY, check_key, parse_key
from django_idempotency.options import DeclaredOptions, Options
from django_idempotency.pages import prefers_html
from django_idempotency.responses import capture, is_storable, problem, problem_for, replay
from django_idempotency.scopes import fit_key_column
from django_idempotency.store import StoredResponse

Handler = Callable[[], HttpResponseBase]
AsyncHandler = Callable[[], Awaitable[HttpResponseBase]]
Finish = Callable[[HttpResponseBase], HttpResponseBase]
Answer = Callable[[Any, IdempotencyError], HttpResponseBase]

# Set on the request by the layer that claims its key: the options it runs
# with and the request object it took the scope from, so that a layer
# inside it can tell whether it would protect the request the same way.
_PROTECTED_WITH = "_idempotency_protected_with"


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
) -> HttpResponseBase:
    """Run ``handler`` once per key and replay its response to every retry.

    ``finish`` turns the handler's response into the bytes that will be
    sent (DRF rendering), so that what is stored is exactly what the client
    got. Raises an :class:`~django_idempotency.exceptions.IdempotencyError`
    for the 400/409/422 answers; a :class:`Guard` renders those.
    """
    # A framework's request (DRF's) is read through Django's inside it, as
    # the handler is called with it (adapters.reach); Django's own needs no call.
    if isinstance(request, HttpRequest):
        http_request, own = request, NOT_A_FRAMEWORKS
    else:
        http_request, own, _ = adapters.reach(request)
    try:
        # The key's checks read the body (its fingerprint) into a copy, which
        # is closed however the request ends: a refused key included.
        call = _call(request, http_request, own, options, sender, finish)
        if call is None:
            response: HttpResponseBase = handler()
        else:
            response = call.run(handler)
    except BaseException:
        close_spools_with(http_request, None)
        raise
    close_spools_with(http_request, response)
    return response


async def protect_async(
    request: HttpRequest,
    handler: AsyncHandler,
    options: DeclaredOptions,
    *,
    sender: Any,
    finish: Finish = render,
) -> HttpResponseBase:
    """:func:`protect` for a coroutine handler: the same rules, and it finishes when cancelled."""
    if _protected_outside(request, options, sender) or not await _may_claim_async(
        request, options.resolve()
    ):
        # Nothing to claim: skip the hop to the request's thread.
        return await handler()

    def run(body: Handler) -> HttpResponseBase:
        # Finished in the request's thread, as for a sync view: rendering a
        # template may run queries.
        return protect(request, body, options, sender=sender, finish=finish)

    return await run_async(run, handler)


def _call(
    request: HttpRequest,
    http_request: HttpRequest,
    own: Mapping[str, Any],
    declared: DeclaredOptions,
    sender: Any,
    finish: Finish,
) -> engine.Call | None:
    """The engine's call for this request, or ``None`` when it is not protected.

    Not protected: disabled, a method the view does not protect, or no key
    and none required (:func:`may_claim`, asked here with the key read once).
    ``http_request`` is Django's request, ``request`` or the one inside it, and ``own``
    what was set on a framework's ``request`` itself, which comes first (``adapters.reach``).
    """
    if (_PROTECTED_WITH in own or hasattr(http_request, _PROTECTED_WITH)) and _protected_outside(
        request, declared, sender
    ):
        return None
    # Resolved once per view, until the settings change.
    options = declared.resolved or declared.resolve()
    conf = idempotency_settings
    if not conf.enabled or method_of(http_request, own) not in options.methods:
        return None
    raw_key = None if options.key is not None else http_request.META.get(_meta_name(conf.header))
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
        # What a function read from the request, or a form's field, has no
        # header syntax to parse.
        key = check_key(raw_key, conf.key_max_length, conf.key_min_length)
    scope = options.scope(request)
    if not isinstance(scope, str):
        _refuse_text("scope", scope, options.scope)
    fingerprint = options.fingerprint(request)
    if not isinstance(fingerprint, str):
        _refuse_text("fingerprint", fingerprint, options.fingerprint)
    if len(fingerprint) > FINGERPRINT_COLUMN_LENGTH:
        # The column holds a SHA-256 hex digest; a custom function may return
        # anything, so longer values are digested rather than truncated.
        fingerprint = hashlib.sha256(fingerprint.encode()).hexdigest()
    info = IdempotencyInfo(key=key, scope=fit_key_column(scope), fingerprint=fingerprint)
    request.idempotency = info  # type: ignore[attr-defined]
    setattr(request, _PROTECTED_WITH, (options, request))

    def finished(response: HttpResponseBase) -> HttpResponseBase:
        # check_claimed_for, then finish, in one frame on the common path. A
        # claim taken on a framework's own request was taken once it ran.
        for adapter in adapters.REGISTERED if request is http_request else ():
            checked = adapter.response_class
            if checked is not None and isinstance(response, checked) and adapter.check_claimed:
                response = adapter.check_claimed(response, request)
                break
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


def check_claimed_for(response: HttpResponseBase, request: Any) -> HttpResponseBase:
    """``response``, once it is known that the claim on ``request`` may store it.

    Raises ``ImproperlyConfigured`` when the claim's scope cannot be right
    for a response of this kind. Any response may be stored here; a
    framework that authenticates inside its views checks its own responses
    in its adapter (DRF's refuses one made under a claim taken before DRF
    authenticated the caller).
    """
    for adapter in adapters.REGISTERED:
        checked = adapter.response_class
        if checked is not None and isinstance(response, checked) and adapter.check_claimed:
            return adapter.check_claimed(response, request)
    return response


#: What decides whose response a caller is given and how the effect commits.
#: Layers that differ only in the rest (``ttl``, ``required``, ``wait``...) are
#: a design: ``@idempotent`` on ``dispatch`` claiming a sent key over a mixin
#: that refuses a request without one.
_DECISIVE = ("scope", "key", "fingerprint", "atomic", "store")


def _protected_outside(request: HttpRequest, declared: DeclaredOptions, sender: Any) -> bool:
    """Whether an outer layer already protects this request, as this one would.

    That happens when ``IdempotencyMiddleware`` cannot see that a view
    protects itself: a project's decorator without ``functools.wraps`` (or
    a callable class) hides ``@idempotent``'s mark. With the same options,
    protected once is all. With others (a scope read from an API key, a
    mode, a key function), the outer layer's would be the ones that count
    and one client could be replayed another's response: refused before the
    handler runs, so the outer layer ends as a raise and stores nothing.
    Options compare field by field: functions by identity, values by value;
    only those in ``_DECISIVE`` count.

    Refused as well, whatever the options, when this layer's request is
    not the one the outer layer claimed with: a framework's own request
    (DRF's) wrapping Django's, made once the framework took over. The outer
    layer took its scope before the framework authenticated the caller, so
    callers it alone tells apart (an API key header) would share a scope.
    """
    outer: tuple[Options, Any] | None = getattr(request, _PROTECTED_WITH, None)
    if outer is None:
        return False
    outer_options, claimed_on = outer
    name = f"{getattr(sender, '__module__', '')}.{getattr(sender, '__qualname__', repr(sender))}"
    if claimed_on is not request:
        raise ImproperlyConfigured(
            f"{name} protects itself inside a layer that claimed the request's key before "
            "the view's framework authenticated the caller, usually IdempotencyMiddleware "
            "or @idempotent around a decorator that hides the view's class. Its scope would "
            "not tell apart the callers that only the framework knows. Keep the view visible "
            "(functools.wraps in that decorator), or leave it out of the middleware with "
            "@idempotency_exempt."
        )
    inner = declared.resolve()
    differ = [o for o in _DECISIVE if getattr(inner, o) != getattr(outer_options, o)]
    if not differ:
        return True
    raise ImproperlyConfigured(
        f"{name} protects itself with other options "
        f"({', '.join(differ)}) than the layer that already protects this request, "
        "usually IdempotencyMiddleware, which could not see that the view protects "
        "itself: a decorator around it hides @idempotent's mark. Keep the mark visible "
        "(functools.wraps in that decorator, functools.update_wrapper in a callable "
        "class), or leave the view out of the middleware with @idempotency_exempt."
    )


def may_claim(request: HttpRequest, options: Options) -> bool:
    """Whether this request may be protected: enabled, a protected method, a key or required.

    A view's ``key`` function is asked once, by :func:`_call`, in the
    request's thread: it may read the body or the database.
    """
    if not _applies(request, options):
        return False
    return options.required or options.key is not None or sent_key(request) is not None


def _applies(request: HttpRequest, options: Options) -> bool:
    """Enabled, and the method the view dispatches on is one it protects, as :func:`_call` asks."""
    if not idempotency_settings.enabled:
        return False
    if isinstance(request, HttpRequest):
        return method_of(request) in options.methods
    http_request, own, _ = adapters.reach(request)
    return method_of(http_request, own) in options.methods


async def _may_claim_async(request: HttpRequest, options: Options) -> bool:
    """:func:`may_claim`, with a form's key read in a thread (:func:`read_form_key`)."""
    if not options.required and options.key is None and _applies(request, options):
        await read_form_key(request)
    return may_claim(request, options)


def sent_key(request: HttpRequest, options: Options | None = None) -> str | None:
    """What the view's ``key`` function reads from the request, else the key the client sent.

    The ``HEADER`` as sent; without it, a form's ``FORM_FIELD`` (a browser
    form cannot send a header). ``None`` when there is no key. The header
    is read from ``META`` directly: ``request.headers`` builds a mapping of
    every header on first use, which a replay otherwise never needs; the
    body is looked at only when there is no header and it is a form.
    """
    if options is not None and options.key is not None:
        return options.key(request)
    conf = idempotency_settings
    value: str | None = request.META.get(_meta_name(conf.header))
    if value is None and conf.form_field is not None:
        return _form_key(request, conf.form_field)
    return value


def _form_key(request: HttpRequest, field: str) -> str | None:
    # Read once per request: the adapters ask whether there is a key
    # before they claim it.
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
    return read


async def read_form_key(request: HttpRequest) -> None:
    """Read a form's key from the body in a thread, so that :func:`sent_key` finds it read.

    For an async view: under ASGI the body is a temporary file, on disk
    past ``FILE_UPLOAD_MAX_MEMORY_SIZE``, and a multipart body's files are
    digested as they are parsed; neither belongs in the event loop. Does
    nothing when the key would not come from the body (a header was sent,
    no ``FORM_FIELD``, no form) or was read already.
    """
    field = idempotency_settings.form_field
    if field is None or not _key_in_body(request) or hasattr(django_request(request), _FORM_KEY):
        return
    await sync_to_async(_read_form_key, thread_sensitive=True)(request, field)


def may_send_key(request: HttpRequest) -> bool:
    """Whether the request may have sent a key, from its headers alone.

    The header, or a form that may hold the ``FORM_FIELD``: the body is
    not looked at.
    """
    conf = idempotency_settings
    if _meta_name(conf.header) in request.META:
        return True
    return conf.form_field is not None and is_form(request)


def _key_in_body(request: HttpRequest) -> bool:
    """Whether a key would be read from the body: no header, a ``FORM_FIELD``, a form."""
    conf = idempotency_settings
    return (
        conf.form_field is not None
        and _meta_name(conf.header) not in request.META
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
    # A key function may say where the key should have been (the presets do),
    # so that a provider's dashboard shows what the delivery lacked.
    source = getattr(options.key, "source", None)
    if isinstance(source, str):
        return (
            f"This endpoint requires an idempotency key, {source}, "
            "and none was found in the request."
        )
    return "This endpoint requires an idempotency key, and none was found in the request."


@lru_cache(maxsize=16)
def _meta_name(header: str) -> str:
    return "HTTP_" + header.upper().replace("-", "_")


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
    """The guard for a request: plain Django's, or its framework's, from the framework's adapter.

    So the decorator needs to know no framework: a DRF ``Request`` (an
    ``@api_view`` under ``@idempotent``) finds DRF's rendering and
    exception handling through DRF's adapter.
    """
    if isinstance(request, HttpRequest):
        return PLAIN
    adapter = adapters.for_request(request)
    if adapter is None:
        return PLAIN
    finish = render if adapter.finish is None else partial(adapter.finish, request)
    return Guard(finish=finish, answer=adapter.answer or problem_for)
