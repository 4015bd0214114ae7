"""What is stored of a response, how it is replayed, and how errors look.

Only the status, the allowlisted headers and the body bytes are stored:
never cookies, never headers outside ``STORED_HEADERS``, so a replay can
never hand one client another's session.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from django.http import HttpResponse, HttpResponseBase

from django_idempotency.exceptions import IdempotencyError
from django_idempotency.models import IdempotencyKey

PROBLEM_CONTENT_TYPE = "application/problem+json"
# Transient answers a client is expected to retry: never stored.
TRANSIENT_STATUSES = frozenset({408, 409, 425, 429})


@dataclass(frozen=True)
class StoredResponse:
    status_code: int
    headers: list[list[str]]
    # None: too large or streaming, replayed without a body. A memoryview
    # when read back through psycopg2.
    body: bytes | memoryview | None


def is_storable(response: HttpResponseBase) -> bool:
    status = response.status_code
    return status < 500 and status not in TRANSIENT_STATUSES


def capture(
    response: HttpResponseBase, allowed_headers: frozenset[str], max_body: int
) -> StoredResponse:
    headers = [
        [name, value] for name, value in response.headers.items() if name.lower() in allowed_headers
    ]
    body: bytes | None = None
    if not response.streaming:
        content = response.content  # type: ignore[attr-defined]
        if len(content) <= max_body:
            body = content
    return StoredResponse(response.status_code, headers, body)


def replay(record: IdempotencyKey, replay_header: str) -> HttpResponse:
    return _build(record.status_code, record.response_headers, record.response_body, replay_header)


def replay_stored(stored: StoredResponse, replay_header: str) -> HttpResponse:
    """A replay of a response kept outside the database (the replay cache)."""
    return _build(stored.status_code, stored.headers, stored.body, replay_header)


def _build(
    status_code: int | None,
    headers: list[list[str]] | None,
    body: bytes | memoryview | None,
    replay_header: str,
) -> HttpResponse:
    # bytes() of bytes is the same object; psycopg2's memoryview is copied once.
    response = HttpResponse(b"" if body is None else bytes(body), status=status_code)
    del response["Content-Type"]  # only what was stored goes back out
    for name, value in headers or []:
        if body is None and name.lower() == "content-type":
            continue  # no body to describe
        response[name] = value
    response[replay_header] = "true"
    return response


def problem(error: IdempotencyError) -> HttpResponse:
    """An RFC 9457 problem details response for a plain Django view."""
    document = {
        "type": error.type_uri,
        "title": error.title,
        "status": error.status,
        "detail": error.detail,
    }
    response = HttpResponse(
        json.dumps(document), status=error.status, content_type=PROBLEM_CONTENT_TYPE
    )
    for name, value in error.headers().items():
        response[name] = value
    return response
