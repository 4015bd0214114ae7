"""The 400/409/422 answers as a page, for a person at a browser.

A shopper who double-clicks Pay should not meet ``application/problem+json``.
A request whose ``Accept`` header prefers ``text/html`` to JSON gets the
same status and headers with a page rendered from
``django_idempotency/problem.html``, which a project overrides like any
template. API clients (``Accept: application/json``, ``*/*``, no header)
keep problem details.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.middleware.csrf import get_token
from django.template import Context, Engine, TemplateDoesNotExist
from django.template.loader import render_to_string
from django.utils.http import parse_header_parameters, url_has_allowed_host_and_scheme

from django_idempotency.body import django_request
from django_idempotency.conf import idempotency_settings
from django_idempotency.exceptions import InvalidIdempotencyKey
from django_idempotency.keys import meta_name, parse_key

PROBLEM_TEMPLATE = "django_idempotency/problem.html"
#: The form field of Django's CSRF token: the page's resend renders a token of its own.
_CSRF_FIELD = "csrfmiddlewaretoken"
#: What a problem is sent as: a page, or one of the JSON types.
_HTML = ("text", "html")
_JSON = (("application", "json"), ("application", "problem+json"))
_TEMPLATES = Path(__file__).resolve().parent / "templates"
#: The longest a 409 page waits before it sends the submission again. A lease's
#: ``Retry-After`` is the time left on it (minutes), while the first request
#: usually ends within seconds; a resend that finds it still running gets
#: this page again, at the cost of one indexed read.
RESEND_AFTER_MAX = 2


def prefers_html(request: Any) -> bool:
    """Whether the client's ``Accept`` header gives ``text/html`` a higher quality than JSON.

    A tie (``*/*``) keeps JSON, the answer of the contract. Each type's quality is that of
    the most specific range naming it, as HTTP says; ``q=0`` refuses it.
    """
    accept: str = django_request(request).META.get("HTTP_ACCEPT", "").lower()
    if "html" not in accept and "text/*" not in accept:
        return False  # the usual API request: no parsing
    ranges = [_media_range(each) for each in _RANGE.findall(accept) if each.strip()]
    known = [each for each in ranges if each is not None]
    return _quality(known, _HTML) > max(_quality(known, json) for json in _JSON)


#: One media range of an ``Accept`` header: up to a comma outside a quoted string.
_RANGE = re.compile(r'(?:[^,"]|"(?:[^"\\]|\\.)*")+')


def _media_range(text: str) -> tuple[str, str, float] | None:
    """``type/subtype;q=...`` as its type, subtype and quality, as Django reads them.

    A quality that is missing, not a number or outside 0-1 counts as 1; ``None`` for a range
    that cannot be read (a parameter in an unknown charset), which is left out.
    """
    try:
        kind, parameters = parse_header_parameters(text)
    except (ValueError, LookupError):  # an unknown charset, as Django versions report it
        return None
    main, _, sub = kind.partition("/")
    try:
        quality = float(parameters.get("q", 1))
    except ValueError:
        quality = 1.0
    if not 0 <= quality <= 1:
        quality = 1.0
    return main, sub, quality


def _quality(ranges: list[tuple[str, str, float]], media_type: tuple[str, str]) -> float:
    """The quality the most specific range matching ``media_type`` gives it; 0 if none does."""
    main, sub = media_type
    best, found = -1, 0.0
    for range_main, range_sub, quality in ranges:
        if range_main == main and range_sub == sub:
            specificity = 2
        elif range_main == main and range_sub == "*":
            specificity = 1
        elif range_main == "*" and range_sub == "*":
            specificity = 0
        else:
            continue
        if specificity > best or (specificity == best and quality > found):
            best, found = specificity, quality
    return found


def problem_page(
    request: Any, problem: Mapping[str, Any], headers: Mapping[str, str], *, held: bool = False
) -> HttpResponse:
    """``problem`` (status, title, detail, type) as an HTML page with the same status.

    The context also has ``retry_after`` (seconds, for a 409) and
    ``resend_after`` (the same, at most ``RESEND_AFTER_MAX``), ``back_url``
    (the page the form was on, when it is on this site) and ``resend``: the
    fields of a form-encoded POST, its key in ``FORM_FIELD``, so that a 409 page
    can send the same submission again (the same key, wherever it came from: it
    is answered with the first's result) rather than reloading the form, which
    would render a new key. ``held``:
    the key waits for an operator (``recovery.hold``): the page sends nothing by
    itself and offers no way back to the form, only the same submission again.
    """
    http_request = django_request(request)
    header = headers.get("Retry-After")
    retry_after = int(header) if header and header.isdigit() else None
    context = {
        "problem": problem,
        "held": held,
        "retry_after": retry_after,
        "resend_after": (
            None if held or retry_after is None else max(min(retry_after, RESEND_AFTER_MAX), 1)
        ),
        "back_url": None if held else _back_url(http_request),
        "resend": _resend(http_request, _key(request)) if problem["status"] == 409 else None,
        "action": http_request.get_full_path(),
    }
    if context["resend"] is not None:
        # The resend's own token (``{% csrf_token %}``): a key sent by htmx or a script
        # came with its token in a header, which a form cannot send either.
        context["csrf_token"] = get_token(http_request)
    try:
        html = render_to_string(PROBLEM_TEMPLATE, context, request=http_request)
    except TemplateDoesNotExist:
        # A project without the app-directories loader (an API-only one
        # that a browser still reaches): the page this package ships.
        engine = Engine(dirs=[str(_TEMPLATES)], autoescape=True)
        html = engine.get_template(PROBLEM_TEMPLATE).render(Context(context))
    response = HttpResponse(html, status=problem["status"], content_type="text/html; charset=utf-8")
    # It holds the submission's fields (a 409's resend): no cache keeps it.
    response["Cache-Control"] = "no-store"
    return response


def _back_url(request: HttpRequest) -> str | None:
    referer = request.META.get("HTTP_REFERER")
    if referer and url_has_allowed_host_and_scheme(
        referer, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return referer
    return None


def _key(request: Any) -> str | None:
    """The key the request was refused under (``request.idempotency``, set before its claim)."""
    info = getattr(request, "idempotency", None)
    return getattr(info, "key", None)


def _resend(request: HttpRequest, key: str | None) -> list[tuple[str, str]] | None:
    """The submission again, its key in ``FORM_FIELD``; ``None`` where a page cannot send it.

    A form cannot send a header: a key that came in the ``Idempotency-Key`` header (htmx's
    ``hx-headers``, a ``fetch``) goes back in the field, which the fingerprint leaves out, in
    place of any the form had. A key a view's own ``key`` function read elsewhere, or no
    ``FORM_FIELD``, leaves nothing a page could send again under the same key.
    """
    # Only a urlencoded form can be sent again from the page as it was: a
    # multipart one (even without files) would be resent urlencoded, a body
    # of another media type, and answered 422 instead of the first's result.
    field = idempotency_settings.form_field
    if (
        field is None
        or request.method != "POST"
        or not (request.content_type or "").startswith("application/x-www-form-urlencoded")
    ):
        return None
    try:
        fields = [(name, value) for name, values in request.POST.lists() for value in values]
    except Exception:  # a body Django refuses: no resend, the page still helps
        return None
    header = request.META.get(meta_name(idempotency_settings.header))
    if header is not None:
        try:
            sent: str | None = parse_key(header, len(header))
        except InvalidIdempotencyKey:
            return None
    else:
        sent = next((value for name, value in fields if name == field), None)
    if key is None:
        key = sent  # a page asked for outside a claim: the key the request carries
    if sent is None or sent != key:
        return None  # none sent, or the view's own key function chose it
    return [(name, value) for name, value in fields if name not in (field, _CSRF_FIELD)] + [
        (field, key)
    ]
