"""What is stored of a response, how it is replayed, and how errors look.

Only the status, the allowlisted headers and the body bytes are stored:
never cookies, never headers outside ``STORED_HEADERS``, so a replay can
never hand one client another's session.
"""

from __future__ import annotations

import json
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpResponse, HttpResponseBase
from django.http.response import ResponseHeaders
from django.utils.cache import patch_vary_headers

from django_idempotency.exceptions import IdempotencyError, RequestAbandoned
from django_idempotency.pages import prefers_html, problem_page
from django_idempotency.store import StoredResponse

PROBLEM_CONTENT_TYPE = "application/problem+json"
# Transient answers a client is expected to retry: never stored.
TRANSIENT_STATUSES = frozenset({408, 409, 425, 429})
# Headers that describe the body (RFC 9110's representation metadata and
# validators): a replay without the stored body must not claim one, or a
# client would decode, save or cache an empty body as the original.
BODY_HEADERS = frozenset(
    {
        "content-type",
        "content-encoding",
        "content-language",
        "content-length",
        "content-disposition",
        "content-range",
        "content-location",
        "content-md5",
        "content-digest",
        "repr-digest",
        "digest",
        "etag",
        "last-modified",
    }
)
# Set by discard() on a response that stands for a failed handler.
_DISCARDED = "_idempotency_discarded"


def discard(response: HttpResponseBase) -> HttpResponseBase:
    """Mark ``response`` as the answer to a handler that raised.

    Such a response is never stored, and the protocol treats it as it treats
    the handler's exception: atomic mode rolls the handler's writes back,
    lease mode gives the key back. The client still receives ``response``.
    For adapters whose framework turns a view's exception into a response
    before they see it (the middleware, see docs/middleware.rst).
    """
    setattr(response, _DISCARDED, True)
    return response


def is_storable(response: HttpResponseBase) -> bool:
    if getattr(response, _DISCARDED, False):
        return False
    status = response.status_code
    return status < 500 and status not in TRANSIENT_STATUSES


def capture(
    response: HttpResponseBase, allowed_headers: frozenset[str], max_body: int
) -> StoredResponse:
    headers = []
    # The (name, value) pairs Django's ResponseHeaders keeps, without the
    # mapping's four calls per header that items() goes through.
    kept = response.headers
    pairs = kept._store.values() if type(kept) is ResponseHeaders else kept.items()
    for name, value in pairs:  # a loop, not a comprehension: one frame less
        if name.lower() in allowed_headers:
            headers.append([name, value])
    body: bytes | None = None
    if not response.streaming:
        content = response.content  # type: ignore[attr-defined]
        if len(content) <= max_body:
            body = content
    return StoredResponse(response.status_code, headers, body)


def replay(stored: StoredResponse, replay_header: str) -> HttpResponse:
    """The stored response again: its status, its allowlisted headers, its body, marked replayed."""
    body = stored.body
    # bytes() of bytes is the same object; psycopg2's memoryview is copied once.
    response = HttpResponse(b"" if body is None else bytes(body), status=stored.status_code)
    del response["Content-Type"]  # only what was stored goes back out
    for name, value in stored.headers:
        if body is None and name.lower() in BODY_HEADERS:
            continue  # no body to describe, see docs/http.rst
        response[name] = value
    response[replay_header] = "true"
    return response


def problem(error: IdempotencyError, request: Any = None) -> HttpResponse:
    """An RFC 9457 problem details response for a plain Django view.

    A browser (``Accept`` preferring ``text/html`` to JSON) gets the same
    status and headers with a page a person can read instead
    (:mod:`django_idempotency.pages`).
    """
    document = {
        "type": error.type_uri,
        "title": error.title,
        "status": error.status,
        "detail": error.detail,
    }
    if request is not None and prefers_html(request):
        held = isinstance(error, RequestAbandoned)
        response = problem_page(request, document, error.headers(), held=held)
    else:
        response = HttpResponse(
            json.dumps(document), status=error.status, content_type=PROBLEM_CONTENT_TYPE
        )
    for name, value in error.headers().items():
        response[name] = value
    # A page or problem details, by Accept: a cache must not give one client the other.
    patch_vary_headers(response, ("Accept",))
    return response


async def aproblem(error: IdempotencyError, request: Any) -> HttpResponse:
    """:func:`problem` from async code: a page is rendered in the request's thread.

    A project's template (its context processors, ``request.user``) may
    query the database, which async code must not do in the event loop.
    """
    if prefers_html(request):
        return await sync_to_async(problem, thread_sensitive=True)(error, request)
    return problem(error, request)


def problem_for(request: Any, error: IdempotencyError) -> HttpResponse:
    """:func:`problem` as a guard answers: for this request, which may prefer a page."""
    return problem(error, request)
