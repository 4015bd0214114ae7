"""The key a browser form sends as a field, read without taking the body from the view.

A plain HTML form cannot send a header, so ``{% idempotency_key_field %}``
puts the key in a hidden field (``FORM_FIELD``). It is read from the body
only when no header was sent and the body is a form, through the same
copy of the body the fingerprint reads (``body.py``): ``request.POST`` and
``request.FILES`` stay the view's, and a multipart body is parsed once,
its files digested as they stream past, for the key and the fingerprint
alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import IO, Any
from urllib.parse import parse_qsl

from django.conf import settings
from django.http import HttpRequest, QueryDict
from django.utils.datastructures import MultiValueDict
from django.utils.http import parse_header_parameters

from django_idempotency import adapters
from django_idempotency.body import body_size, body_stream, django_request
from django_idempotency.exceptions import InvalidIdempotencyKey
from django_idempotency.multipart import parse_digested

MULTIPART = "multipart/form-data"
FORM = "application/x-www-form-urlencoded"
#: Django's CSRF field: a fresh mask at every render, so never part of a fingerprint.
CSRF_FIELD = "csrfmiddlewaretoken"

_PARSED = "_idempotency_parsed_multipart"
_NOT_PARSED = object()


def is_form(request: Any) -> bool:
    """Whether the request's body is form-encoded or multipart: cheap, from the header only."""
    content_type: str = django_request(request).META.get("CONTENT_TYPE", "")
    return content_type[:33].lower().startswith((FORM, MULTIPART))


def form_key(request: Any, field: str) -> str | None:
    """The value of ``field`` in a form body, ``None`` if the body is no form or lacks it.

    Raises ``InvalidIdempotencyKey`` when the field is sent more than once:
    which of the keys the page meant cannot be known.
    """
    if not is_form(request):
        return None
    values = _field_values(request, field)
    if len(values) > 1:
        raise InvalidIdempotencyKey(
            f"The form sent the {field} field {len(values)} times. Render "
            "{% idempotency_key_field %} once per form."
        )
    return values[0] if values else None


def left_out(form_field: str | None) -> frozenset[str]:
    """The fields a form's fingerprint leaves out: the key's own field and the CSRF token."""
    return frozenset({CSRF_FIELD} if form_field is None else {CSRF_FIELD, form_field})


def parsed_multipart(
    request: HttpRequest, body: IO[bytes]
) -> tuple[QueryDict, MultiValueDict] | None:
    """A multipart body's fields and digested files, parsed once per request."""
    parsed = getattr(request, _PARSED, _NOT_PARSED)
    if parsed is _NOT_PARSED:
        parsed = parse_digested(body, request.META.get("CONTENT_TYPE", ""), request.encoding)
        setattr(request, _PARSED, parsed)
    return parsed  # type: ignore[return-value]


def _field_values(request: Any, field: str) -> list[str]:
    http_request = django_request(request)
    media_type, _ = parse_header_parameters(http_request.META.get("CONTENT_TYPE", ""))
    body = body_stream(http_request)
    if body is None:
        return _parsed_values(request, http_request, field)
    try:
        if media_type.lower() == MULTIPART:
            parsed = parsed_multipart(http_request, body)
            return [] if parsed is None else parsed[0].getlist(field)
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        if limit is not None and body_size(body) > limit:
            return []  # request.POST refuses it too: the view answers that
        try:
            pairs = parse_qsl(
                body.read().decode(),
                keep_blank_values=True,
                max_num_fields=settings.DATA_UPLOAD_MAX_NUMBER_FIELDS,
            )
        except ValueError:  # too many fields, or not UTF-8: the view answers that
            return []
        return [value for name, value in pairs if name == field]
    finally:
        body.seek(0)  # where the view will start reading


def _parsed_values(request: Any, http_request: HttpRequest, field: str) -> list[str]:
    # The stream was read before us and not kept: what was parsed from it
    # (Django's request.POST, or what a framework's adapter says it parsed,
    # DRF's request.data) is all there is.
    if request is not http_request:
        adapter = adapters.for_request(request)
        parsed = None if adapter is None else adapter.parsed_body
        data = None if parsed is None else parsed(request)
    else:
        data = getattr(http_request, "_post", None)
    if data is None:
        return []
    if hasattr(data, "getlist"):
        return [value for value in data.getlist(field) if isinstance(value, str)]
    # A parser of the project's own may give a plain dict.
    value = data.get(field) if isinstance(data, Mapping) else None
    return [value] if isinstance(value, str) else []
