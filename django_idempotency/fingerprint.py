"""The request fingerprint: what makes a retry "the same request".

A retry must match its original even when a client library re-serialises
the body (key order, whitespace, ``10`` written as ``10.0``) or picks a new
multipart boundary, yet any change of meaning must not match, so that a
reused key is answered 422 rather than with the wrong stored response.
"""

from __future__ import annotations

import hashlib
import json
from decimal import Decimal
from typing import Any
from urllib.parse import parse_qsl, urlencode

from django.http import HttpRequest
from django.http.request import RawPostDataException
from django.utils.http import parse_header_parameters

_CHUNK = 64 * 1024


def request_fingerprint(request: HttpRequest) -> str:
    """SHA-256 hex over method, path, sorted query, media type and canonical body."""
    http_request: HttpRequest = getattr(request, "_request", request)  # DRF wraps it
    media_type, _ = parse_header_parameters(http_request.META.get("CONTENT_TYPE", ""))
    media_type = media_type.lower()
    query = sorted(parse_qsl(http_request.META.get("QUERY_STRING", ""), keep_blank_values=True))
    head = json.dumps([http_request.method, http_request.path, urlencode(query), media_type])
    digest = hashlib.sha256(head.encode())
    digest.update(b"\n")
    if media_type == "multipart/form-data":
        _update_with_multipart(digest, http_request)
    else:
        try:
            body = http_request.body
        except RawPostDataException:
            # DRF parsed the stream before us (a permission read request.data):
            # its parsed data is all that is left to fingerprint.
            body = _dump_parsed(getattr(request, "data", None)).encode()
            media_type = "parsed"
        digest.update(canonical_body(media_type, body))
    return digest.hexdigest()


def _dump_parsed(data: Any) -> str:
    if hasattr(data, "lists"):  # QueryDict
        data = {key: values for key, values in data.lists()}
    return json.dumps(data, sort_keys=True, default=str)


def canonical_body(media_type: str, body: bytes) -> bytes:
    """JSON and form bodies in canonical form; anything else as its bytes."""
    if media_type == "application/json" or media_type.endswith("+json"):
        canonical = canonical_json(body)
        if canonical is not None:
            return b"json:" + canonical.encode()
    elif media_type == "application/x-www-form-urlencoded":
        try:
            pairs = parse_qsl(body.decode(), keep_blank_values=True, strict_parsing=False)
        except UnicodeDecodeError:
            pass
        else:
            return b"form:" + urlencode(sorted(pairs)).encode()
    return b"bytes:" + body


def canonical_json(body: bytes) -> str | None:
    """Sorted keys, no whitespace, numbers by value; ``None`` if not valid JSON."""
    try:
        value = json.loads(
            body,
            parse_float=Decimal,
            parse_int=Decimal,
            parse_constant=_reject_constant,
        )
        return _dump(value)
    except (ValueError, RecursionError):
        # Not JSON (or too deeply nested to be worth canonicalising): the
        # bytes themselves are the fingerprint, and the handler will reject it.
        return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _dump(value: Any) -> str:
    if isinstance(value, dict):
        items = sorted(value.items())
        return "{" + ",".join(json.dumps(k) + ":" + _dump(v) for k, v in items) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_dump(item) for item in value) + "]"
    if isinstance(value, Decimal):
        return _number(value)
    return json.dumps(value)  # str, bool, None


def _number(value: Decimal) -> str:
    """Exact canonical form, so 10, 10.0 and 1e1 agree and nothing is rounded."""
    if value.is_zero():
        return "0"
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)  # NaN and Infinity were rejected by the parser
    digits_text = "".join(map(str, digits)).rstrip("0")
    exponent += len(digits) - len(digits_text)
    return f"{'-' if sign else ''}{digits_text}e{exponent}"


def _update_with_multipart(digest: Any, request: HttpRequest) -> None:
    # The boundary is random per send, so hash the parsed fields and files
    # rather than the raw bytes. Reading request.POST here is safe for DRF,
    # which falls back to Django's parsed data once the stream is consumed.
    fields = sorted((name, value) for name in request.POST for value in request.POST.getlist(name))
    digest.update(b"multipart:" + urlencode(fields).encode() + b"\n")
    for name in sorted(request.FILES):
        for upload in request.FILES.getlist(name):
            file_digest = hashlib.sha256()
            for chunk in upload.chunks(_CHUNK):
                file_digest.update(chunk)
            upload.seek(0)
            header = json.dumps([name, upload.name, upload.content_type, file_digest.hexdigest()])
            digest.update(header.encode() + b"\n")
