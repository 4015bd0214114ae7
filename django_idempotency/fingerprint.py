"""The request fingerprint: what makes a retry "the same request".

A retry matches its original even when a client re-serialises the body
(key order, whitespace, ``10`` as ``10.0``) or picks a new multipart
boundary; any change of meaning does not, so a reused key gets a 422, never
the wrong stored response.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from decimal import Decimal
from json.encoder import encode_basestring_ascii
from operator import itemgetter
from os import SEEK_END
from typing import IO, Any
from urllib.parse import parse_qsl, urlencode

from django.conf import settings
from django.core.files.uploadedfile import UploadedFile
from django.http import HttpRequest, QueryDict
from django.http.request import RawPostDataException
from django.utils.datastructures import MultiValueDict
from django.utils.http import parse_header_parameters

from django_idempotency.adapters import NOT_A_FRAMEWORKS, Adapter, reach
from django_idempotency.body import CHUNK_SIZE, body_stream
from django_idempotency.conf import idempotency_settings
from django_idempotency.forms import FORM, MULTIPART, left_out, parsed_multipart
from django_idempotency.multipart import DigestedFile


def request_fingerprint(request: HttpRequest) -> str:
    """SHA-256 hex over method, path, query, media type, negotiated format and body.

    The rules are described in ``docs/fingerprint.rst``.
    """
    if isinstance(request, HttpRequest):
        return fingerprint_of(request, request, NOT_A_FRAMEWORKS, None)
    return fingerprint_of(request, *reach(request))


def fingerprint_of(
    request: HttpRequest,
    http_request: HttpRequest,
    own: Mapping[str, Any],
    adapter: Adapter | None,
) -> str:
    """:func:`request_fingerprint` given what ``adapters.reach`` gives, which the core has."""
    if http_request is request:
        adapter = None
    media_type, _ = parse_header_parameters(http_request.META.get("CONTENT_TYPE", ""))
    media_type = media_type.lower()
    query_string = http_request.META.get("QUERY_STRING", "")
    if query_string:  # an empty one stays empty
        query = _form_pairs(query_string.encode())
        if query is not None:
            query_string = urlencode(sorted(query, key=_NAME), errors=_SAME_BYTES)
    # The method as set, an override on a framework's request first: a view may tell
    # ``post`` from ``POST``, though protection is decided in capitals (core.protected_method).
    head = [own.get("method") or http_request.method, http_request.path, query_string, media_type]
    # A retry negotiating another format (HTML, JSON) is another request.
    if adapter is not None and adapter.negotiated_format is not None:
        negotiated = adapter.negotiated_format(request)
        if negotiated is not None:
            head.append(negotiated)
    try:
        # json.dumps(head)'s very bytes, without its encoder's calls: a fingerprint
        # must not change across releases, or a retry sent over an upgrade gets a 422.
        encoded_head = "[" + ", ".join(map(_STRING, head)) + "]"
    except TypeError:  # a method of None (a request built by hand)
        encoded_head = json.dumps(head)
    digest = hashlib.sha256(encoded_head.encode())
    digest.update(b"\n")
    body = body_stream(http_request)
    if body is None:
        if adapter is not None and adapter.parsed_body is not None:
            parsed = adapter.parsed_body(request)
        else:
            # What a middleware that read the stream may have kept as request.data.
            parsed = getattr(request, "data", None)
        _update_with_parsed(digest, request, media_type, parsed)
        return digest.hexdigest()
    try:
        if media_type == MULTIPART:
            _update_with_multipart(digest, http_request, body)
        elif media_type in _CANONICALISED or media_type.endswith("+json"):
            limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
            within = limit is None or body.seek(0, SEEK_END) <= limit
            body.seek(0)
            if not within:
                _update_with_bytes(digest, body)
            elif media_type == FORM:
                digest.update(canonical_body(media_type, body.read()))
            else:
                # canonical_body's JSON, inline: every JSON body comes here.
                data = body.read()
                try:
                    # json.detect_encoding's answer at once for a body that opens an
                    # object or array: past a { or [ only a zero byte says UTF-16 or 32.
                    if data[:1] in _OPENINGS and data[1:2] != b"\x00":
                        encoding = "utf-8"
                    else:
                        encoding = json.detect_encoding(data)
                    text = data.decode(encoding, "surrogatepass")
                    digest.update(b"json:" + _dump(_JSON.decode(text)).encode())
                except (ValueError, RecursionError):
                    digest.update(b"bytes:" + data)  # not JSON, or nested too deep
        else:
            _update_with_bytes(digest, body)
    finally:
        body.seek(0)
    return digest.hexdigest()


_NAME = itemgetter(0)
#: How an escape that is not UTF-8 (``%E9``, sent in Latin-1) is read and written again: as
#: its own bytes, so that two such values never fold into one U+FFFD. UTF-8 reads as before.
_SAME_BYTES = "surrogateescape"


def sort_pairs(pairs: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """Order by name only: the order of a name's values is meaning (``name=a&name=b``)."""
    return sorted(pairs, key=_NAME)


def _update_with_bytes(digest: Any, body: IO[bytes]) -> None:
    # Streamed, not parsed: past the limit Django would not load it either.
    digest.update(b"bytes:")
    while chunk := body.read(CHUNK_SIZE):
        digest.update(chunk)


#: The media types read as their meaning (with any ``+json``), within Django's limit.
_CANONICALISED = frozenset({"application/json", FORM})


def _update_with_parsed(digest: Any, request: HttpRequest, media_type: str, data: Any) -> None:
    # The raw stream was read before us and not kept: only what was parsed is left.
    if media_type == MULTIPART:
        try:
            fields, files = request.POST, request.FILES
        except RawPostDataException:
            # Read raw by something else first: the view cannot see it either.
            fields, files = QueryDict(), MultiValueDict()
        _update_with_form_data(digest, fields, files)
        return
    if media_type == FORM and data is not None and hasattr(data, "lists"):
        # The form's own key field and CSRF token, as for a form read here.
        skipped = left_out(idempotency_settings.form_field)
        data = {name: values for name, values in data.lists() if name not in skipped}
    try:
        canonical = "parsed:" + canonical_parsed(data)
    except RecursionError:
        # Deeper than this recursion; json's encoder goes further, without numbers by value.
        canonical = "parsed-deep:" + json.dumps(data, sort_keys=True, default=canonical_parsed)
    digest.update(canonical.encode())


def canonical_parsed(value: Any) -> str:
    """Parsed request data in canonical form, as close to ``canonical_json`` as types allow.

    Keys sorted, numbers by value, a key's values in order, a file by name,
    content type and SHA-256. Other objects count by type and ``str()``, or
    by their attributes when ``str()`` is the default (it shows an address).
    """
    if value is None or isinstance(value, (bool, str)):
        return json.dumps(value)
    if isinstance(value, (int, float, Decimal)):
        return _parsed_number(value)
    if isinstance(value, UploadedFile):
        return "file:" + json.dumps([value.name, value.content_type, _file_digest(value)])
    if isinstance(value, (bytes, bytearray)):
        return "bytes:" + hashlib.sha256(value).hexdigest()
    if hasattr(value, "lists"):  # QueryDict, MultiValueDict: every value of a key
        value = dict(value.lists())
    if isinstance(value, Mapping):
        items = sorted((canonical_parsed(k), canonical_parsed(v)) for k, v in value.items())
        return "{" + ",".join(f"{k}:{v}" for k, v in items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(canonical_parsed(item) for item in value) + "]"
    if isinstance(value, (set, frozenset)):
        return "set[" + ",".join(sorted(canonical_parsed(item) for item in value)) + "]"
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    if type(value).__str__ is object.__str__ and type(value).__repr__ is object.__repr__:
        return kind + canonical_parsed(_attributes(value))
    return kind + json.dumps(str(value))


def _attributes(value: Any) -> dict[str, Any]:
    names: list[str] = []
    for cls in type(value).__mro__:
        slots = getattr(cls, "__slots__", ())
        names.extend([slots] if isinstance(slots, str) else slots)
    attributes = {
        name: getattr(value, name)
        for name in names
        if name not in ("__dict__", "__weakref__") and hasattr(value, name)
    }
    attributes.update(getattr(value, "__dict__", {}))
    return attributes


def _parsed_number(value: int | float | Decimal) -> str:
    if isinstance(value, float):
        # repr() is the shortest text that parses back: 0.1, not 0.1000000000000000055.
        value = Decimal(repr(value))
    elif isinstance(value, int):
        value = Decimal(value)
    if not value.is_finite():
        return str(value)  # NaN, Infinity, -Infinity: bare, unlike any string or number
    return _number(value)


def canonical_body(media_type: str, body: bytes) -> bytes:
    """JSON and form bodies in canonical form; anything else as its bytes."""
    if media_type == "application/json" or media_type.endswith("+json"):
        canonical = canonical_json(body)
        if canonical is not None:
            return b"json:" + canonical.encode()
    elif media_type == FORM:
        pairs = _form_pairs(body)
        if pairs is not None:
            skipped = left_out(idempotency_settings.form_field)
            kept = [(name, value) for name, value in pairs if name not in skipped]
            return b"form:" + urlencode(sorted(kept, key=_NAME), errors=_SAME_BYTES).encode()
    return b"bytes:" + body


def _form_pairs(body: bytes) -> list[tuple[str, str]] | None:
    """The fields, or ``None`` where Django's ``QueryDict`` would refuse them.

    Past ``DATA_UPLOAD_MAX_NUMBER_FIELDS`` the body counts as its bytes and
    the view answers ``TooManyFieldsSent``; the limit also bounds the work here.
    """
    try:
        return parse_qsl(
            body.decode(),
            keep_blank_values=True,
            max_num_fields=settings.DATA_UPLOAD_MAX_NUMBER_FIELDS,
            errors=_SAME_BYTES,
        )
    except ValueError:  # too many fields, or not UTF-8
        return None


def canonical_json(body: bytes) -> str | None:
    """Sorted keys, no whitespace, numbers by value; ``None`` if not valid JSON."""
    try:
        if isinstance(body, (bytes, bytearray)):
            # What json.loads does with bytes, without a new decoder per call.
            value = _JSON.decode(body.decode(json.detect_encoding(body), "surrogatepass"))
        else:
            value = json.loads(body, **_JSON_OPTIONS)
        return _dump(value)
    except (ValueError, RecursionError):
        # Not JSON, or nested too deep: the bytes are the fingerprint.
        return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_JSON_OPTIONS: dict[str, Any] = {
    "parse_float": Decimal,
    "parse_int": Decimal,
    "parse_constant": _reject_constant,
}
_JSON = json.JSONDecoder(**_JSON_OPTIONS)
#: What ``json.dumps`` gives a string: ASCII, escaped.
_STRING = encode_basestring_ascii


def _dump(value: Any) -> str:
    # Strings and numbers are written in the loop: one call per object or array.
    if isinstance(value, dict):
        parts = []
        for name, item in sorted(value.items()):
            if isinstance(item, str):
                parts.append(_STRING(name) + ":" + _STRING(item))
            elif isinstance(item, Decimal):
                parts.append(_STRING(name) + ":" + _number(item))
            else:
                parts.append(_STRING(name) + ":" + _dump(item))
        return "{" + ",".join(parts) + "}"
    if isinstance(value, list):
        parts = []
        for item in value:
            if isinstance(item, str):
                parts.append(_STRING(item))
            elif isinstance(item, Decimal):
                parts.append(_number(item))
            else:
                parts.append(_dump(item))
        return "[" + ",".join(parts) + "]"
    if isinstance(value, Decimal):
        return _number(value)
    return json.dumps(value)  # str, bool, None


#: A JSON object's or array's first byte: UTF-8, or UTF-16/32 little-endian if a zero follows.
_OPENINGS = (b"{", b"[")


def _number(value: Decimal) -> str:
    """Exact canonical form, so 10, 10.0 and 1e1 agree and nothing is rounded."""
    if value.is_zero():
        return "0"
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)  # NaN and Infinity were rejected by the parser
    digits_text = "".join(map(str, digits)).rstrip("0")
    exponent += len(digits) - len(digits_text)
    return f"{'-' if sign else ''}{digits_text}e{exponent}"


def _update_with_multipart(digest: Any, request: HttpRequest, body: IO[bytes]) -> None:
    # The boundary is random per send: hash the parsed form, for every method, not only POST.
    parsed = parsed_multipart(request, body)
    if parsed is None:
        # Malformed or past Django's limits: the view answers; hash the bytes.
        _update_with_bytes(digest, body)
        return
    _update_with_form_data(digest, *parsed)


def _update_with_form_data(digest: Any, fields: Any, files: MultiValueDict) -> None:
    skipped = left_out(idempotency_settings.form_field)
    pairs = sort_pairs(
        (name, value) for name in fields if name not in skipped for value in fields.getlist(name)
    )
    digest.update(b"multipart:" + urlencode(pairs).encode() + b"\n")
    for name in sorted(files):
        for upload in files.getlist(name):
            header = json.dumps([name, upload.name, upload.content_type, _file_digest(upload)])
            digest.update(header.encode() + b"\n")


def _file_digest(upload: UploadedFile) -> str:
    if isinstance(upload, DigestedFile):
        return upload.sha256
    file_digest = hashlib.sha256()
    for chunk in upload.chunks(CHUNK_SIZE):
        file_digest.update(chunk)
    upload.seek(0)
    return file_digest.hexdigest()
