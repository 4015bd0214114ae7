"""System checks for the ``IDEMPOTENCY`` setting.

A typo or a bad value must stop ``runserver``, ``migrate`` and the test run
with a message naming the key, rather than surface as a 500 on the first
protected request.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error
from django.core.exceptions import ImproperlyConfigured

from django_idempotency.conf import DEFAULTS, SETTING_NAME, resolve_callable

# RFC 9110 token characters: what a header field name may contain.
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_ABSOLUTE_URL = re.compile(r"^https?://[^\s/?#]+[^\s]*$")
_KNOWN_METHODS = {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"}
# The key and scope columns are 255 characters wide.
KEY_COLUMN_LENGTH = 255


def _error(key: str, message: str, hint: str, id: str = "django_idempotency.E003") -> Error:
    return Error(f"{SETTING_NAME}[{key!r}] {message}", hint=hint, id=id)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_positive_duration(value: Any) -> bool:
    if isinstance(value, timedelta):
        return value > timedelta(0)
    return _is_number(value) and value > 0


def _is_header_name(value: Any) -> bool:
    return isinstance(value, str) and bool(_TOKEN.match(value))


def _is_header_list(value: Any) -> bool:
    return isinstance(value, list | tuple | set | frozenset) and all(
        _is_header_name(item) for item in value
    )


def _is_method_list(value: Any) -> bool:
    return (
        isinstance(value, list | tuple | set | frozenset)
        and len(value) > 0
        and all(isinstance(item, str) and item.upper() in _KNOWN_METHODS for item in value)
    )


def _is_request_function(name: str) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        if callable(value):
            return True
        if not isinstance(value, str):
            return False
        try:
            resolve_callable(value, name)
        except ImproperlyConfigured:
            return False
        return True

    return check


# One validator and one hint per setting, so every message names its key.
_VALIDATORS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "HEADER": (_is_header_name, "Use a header field name such as 'Idempotency-Key'."),
    "REQUIRED": (_is_bool, "Use True or False."),
    "METHODS": (_is_method_list, "Use a non-empty tuple of HTTP methods, e.g. ('POST', 'PATCH')."),
    "TTL": (_is_positive_duration, "Use a positive timedelta or number of seconds."),
    "KEY_MAX_LENGTH": (
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= KEY_COLUMN_LENGTH,
        f"Use an integer from 1 to {KEY_COLUMN_LENGTH} (the width of the key column).",
    ),
    "SCOPE": (
        _is_request_function("SCOPE"),
        "Use a callable f(request) -> str or the dotted path of one.",
    ),
    "FINGERPRINT": (
        _is_request_function("FINGERPRINT"),
        "Use a callable f(request) -> str or the dotted path of one.",
    ),
    "ATOMIC": (_is_bool, "Use True (atomic mode) or False (lease mode)."),
    "WAIT": (
        lambda v: _is_number(v) and 0 <= v <= 3600,
        "Use a number of seconds from 0 to 3600.",
    ),
    "LEASE": (_is_positive_duration, "Use a positive timedelta or number of seconds."),
    "REPLAY_HEADER": (_is_header_name, "Use a header field name such as 'Idempotent-Replayed'."),
    "STORED_HEADERS": (_is_header_list, "Use a tuple of header field names."),
    "DATABASE": (lambda v: isinstance(v, str), "Use a database alias from DATABASES."),
    "MAX_STORED_BODY": (
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        "Use a number of bytes, 0 or more.",
    ),
    "ENABLED": (_is_bool, "Use True or False."),
    "PROBLEM_TYPE_BASE_URL": (
        lambda v: v is None or (isinstance(v, str) and _ABSOLUTE_URL.match(v) is not None),
        "Use None (URN problem types) or an absolute http(s) URL such as "
        "'https://api.example.com/problems/'; each problem's name is appended to it.",
    ),
}


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    user = getattr(settings, SETTING_NAME, {})
    if not isinstance(user, dict):
        return [
            Error(
                f"{SETTING_NAME} must be a dict, not {type(user).__name__}.",
                hint="See the settings page of the django-idempotency docs.",
                id="django_idempotency.E001",
            )
        ]
    errors: list[CheckMessage] = []
    for key in user:
        if key not in DEFAULTS:
            close = difflib.get_close_matches(str(key), DEFAULTS, n=1)
            hint = f"Did you mean {close[0]!r}?" if close else f"Known keys: {', '.join(DEFAULTS)}."
            errors.append(
                Error(
                    f"{SETTING_NAME}[{key!r}] is not a known setting.",
                    hint=hint,
                    id="django_idempotency.E002",
                )
            )
    for key, (is_valid, hint) in _VALIDATORS.items():
        if key in user and not is_valid(user[key]):
            errors.append(_error(key, f"has an invalid value: {user[key]!r}.", hint))
    database = user.get("DATABASE", DEFAULTS["DATABASE"])
    if isinstance(database, str) and database not in settings.DATABASES:
        errors.append(
            _error(
                "DATABASE",
                f"names {database!r}, which is not in DATABASES.",
                f"Use one of: {', '.join(settings.DATABASES)}.",
                id="django_idempotency.E004",
            )
        )
    stored = user.get("STORED_HEADERS", ())
    if _is_header_list(stored) and any(name.lower() == "set-cookie" for name in stored):
        errors.append(
            _error(
                "STORED_HEADERS",
                "includes Set-Cookie, which is never stored or replayed.",
                "Remove 'Set-Cookie': replaying a session cookie would hand it to whoever retries.",
                id="django_idempotency.E005",
            )
        )
    return errors
