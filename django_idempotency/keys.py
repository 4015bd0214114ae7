"""Parsing the ``Idempotency-Key`` header value.

The IETF draft writes the key as an RFC 8941 sf-string (``"abc-123"``) while
most clients send it bare (``abc-123``); both denote the same key. The key
itself is ``KEY_MIN_LENGTH`` (default 1) to ``KEY_MAX_LENGTH`` visible ASCII
characters (0x21-0x7E), so it can be stored and compared byte for byte on
every backend.

A request may carry one key only. Servers join repeated header lines with
commas (``k-a,k-b``), so a bare value with a comma is refused rather than
taken for one key: which of the two the client meant cannot be known. A
quoted key is one sf-string item and may hold commas inside its quotes.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from functools import lru_cache

from django.conf import settings

from django_idempotency.exceptions import InvalidIdempotencyKey

_VISIBLE_ASCII = re.compile(r"^[\x21-\x7e]+\Z")
# An sf-string: printable ASCII (space included) with \" and \\ escapes.
_SF_STRING = re.compile(r'^"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"\Z')
_SF_ESCAPE = re.compile(r'\\(["\\])')
#: A key sent bare that needs no parsing: visible ASCII, no comma, no quote first.
PLAIN_KEY = re.compile(r"[\x21\x23-\x2b\x2d-\x7e][\x21-\x2b\x2d-\x7e]*\Z")
# One list member as servers join them: an sf-string, or anything up to the next comma.
_MEMBER = r'(?:"(?:[^"\\]|\\.)*"|[^",]*)'
_LIST = re.compile(rf"^{_MEMBER}(?:[ \t]*,[ \t]*{_MEMBER})+\Z")


_SEVERAL_KEYS = (
    "The request carried more than one Idempotency-Key header (they arrive joined "
    "by commas), or a key with a comma outside quotes. Send one Idempotency-Key "
    'header with one key; quote a key that contains a comma ("a,b").'
)


@lru_cache(maxsize=16)
def meta_name(header: str) -> str:
    """Where Django's ``request.META`` keeps the request header ``header``."""
    return "HTTP_" + header.upper().replace("-", "_")


def parse_key(value: str, max_length: int, min_length: int = 1) -> str:
    """Return the key a header value denotes, or raise ``InvalidIdempotencyKey``."""
    if min_length <= len(value) <= max_length and PLAIN_KEY.match(value):
        return value  # a valid key, sent bare: the common case, in one call
    if value.startswith('"'):
        match = _SF_STRING.match(value)
        if match is None:
            if _is_list(value):
                raise InvalidIdempotencyKey(_SEVERAL_KEYS)
            raise InvalidIdempotencyKey(
                "The Idempotency-Key header starts with a quote but is not a valid "
                'quoted string. Send the key bare (abc-123) or quoted ("abc-123").'
            )
        value = _SF_ESCAPE.sub(r"\1", match.group(1))
    elif "," in value:
        raise InvalidIdempotencyKey(_SEVERAL_KEYS)
    if not value:
        raise InvalidIdempotencyKey("The Idempotency-Key header is empty.")
    return check_key(value, max_length, min_length)


def check_key(value: object, max_length: int, min_length: int = 1) -> str:
    """Return ``value`` if it is a valid key, or raise ``InvalidIdempotencyKey``.

    The rules for the key itself, whether a header carried it or a view's
    ``key`` function read it from the request (an event id in the body):
    a function's value has no header syntax, so neither quotes nor the
    comma rule apply to it. It may come from what the client sent, so a
    value that is no string is refused as a bad key, not a crash.
    """
    if not isinstance(value, str):
        raise InvalidIdempotencyKey(
            f"The idempotency key taken from the request is {type(value).__name__}, not a string."
        )
    if not value:
        raise InvalidIdempotencyKey("The idempotency key is empty.")
    if len(value) > max_length:
        raise InvalidIdempotencyKey(
            f"The idempotency key is {len(value)} characters long; the limit is {max_length}."
        )
    if len(value) < min_length:
        # A public endpoint's scope may be shared (anonymous callers), so a
        # short, guessable key could reach another caller's stored response.
        raise InvalidIdempotencyKey(
            f"The idempotency key is {len(value)} characters long; keys must be at "
            f"least {min_length}. Send a random key, such as a UUID."
        )
    if not _VISIBLE_ASCII.match(value):
        raise InvalidIdempotencyKey(
            "The idempotency key may only contain visible ASCII characters "
            "(no spaces, control characters or non-ASCII text)."
        )
    return value


def _is_list(value: str) -> bool:
    """Whether a value that is not one sf-string reads as several joined members."""
    return _LIST.match(value) is not None


#: Hex digits of a masked key: enough to tell keys apart in logs.
MASK_LENGTH = 12
_MASK_SALT = "django_idempotency.keys.mask_key"


def mask_key(key: str) -> str:
    """A short, stable digest of a key for logs and the admin: never show a key in clear.

    Keyed with ``SECRET_KEY`` (an HMAC): many keys are guessable
    (``receipt-7``), and a plain hash prefix in a log would let anyone who
    reads the log try candidates until one matches, then replay it.
    """
    secret = _mask_secret(settings.SECRET_KEY)
    return hmac.new(secret, key.encode(), hashlib.sha256).hexdigest()[:MASK_LENGTH]


@lru_cache(maxsize=4)
def _mask_secret(secret_key: str) -> bytes:
    # What salted_hmac derives from the salt and SECRET_KEY, once per secret
    # rather than once per log line.
    return hashlib.sha256((_MASK_SALT + secret_key).encode()).digest()
