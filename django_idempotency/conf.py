"""The ``IDEMPOTENCY`` settings dict, read through one object.

Values are looked up on every access rather than cached, so
``override_settings`` and the ``setting_changed`` signal need no special
handling. Defaults live here and are never written into
``django.conf.settings``. Validation lives in :mod:`django_idempotency.checks`;
the accessors below assume the checks have passed and only normalise types.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from functools import lru_cache
from typing import Any

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest
from django.utils.module_loading import import_string

SETTING_NAME = "IDEMPOTENCY"

DEFAULTS: dict[str, Any] = {
    "HEADER": "Idempotency-Key",
    "REQUIRED": False,
    "METHODS": ("POST", "PATCH"),
    "TTL": timedelta(hours=24),
    "KEY_MAX_LENGTH": 255,
    "SCOPE": "django_idempotency.scopes.user_scope",
    "FINGERPRINT": "django_idempotency.fingerprint.request_fingerprint",
    "ATOMIC": True,
    "WAIT": 5.0,
    "LEASE": timedelta(minutes=5),
    "REPLAY_HEADER": "Idempotent-Replayed",
    "STORED_HEADERS": (
        "Content-Type",
        "Location",
        "ETag",
        "Last-Modified",
        "Content-Language",
    ),
    "DATABASE": "default",
    "MAX_STORED_BODY": 1_048_576,
    "ENABLED": True,
    "PROBLEM_TYPE_BASE_URL": None,
}

RequestFunction = Callable[[HttpRequest], str]


def to_timedelta(value: timedelta | int | float) -> timedelta:
    """Accept a timedelta or a number of seconds, as every duration option does."""
    if isinstance(value, timedelta):
        return value
    return timedelta(seconds=value)


def resolve_callable(value: str | RequestFunction, name: str) -> RequestFunction:
    """Turn a dotted path into the callable it names; a failure names the setting."""
    if callable(value):
        return value
    return _import_callable(value, name)


@lru_cache(maxsize=64)
def _import_callable(path: str, name: str) -> RequestFunction:
    try:
        func = import_string(path)
    except ImportError as exc:
        raise ImproperlyConfigured(
            f"{SETTING_NAME}[{name!r}] = {path!r} could not be imported: {exc}"
        ) from exc
    if not callable(func):
        raise ImproperlyConfigured(f"{SETTING_NAME}[{name!r}] = {path!r} is not callable.")
    return func


class IdempotencySettings:
    """Typed accessors over the user's ``IDEMPOTENCY`` dict and the defaults."""

    def raw(self, name: str) -> Any:
        user = getattr(django_settings, SETTING_NAME, None) or {}
        if not isinstance(user, dict):
            user = {}
        return user.get(name, DEFAULTS[name])

    @property
    def header(self) -> str:
        return str(self.raw("HEADER"))

    @property
    def required(self) -> bool:
        return bool(self.raw("REQUIRED"))

    @property
    def methods(self) -> frozenset[str]:
        return frozenset(method.upper() for method in self.raw("METHODS"))

    @property
    def ttl(self) -> timedelta:
        return to_timedelta(self.raw("TTL"))

    @property
    def key_max_length(self) -> int:
        return int(self.raw("KEY_MAX_LENGTH"))

    @property
    def scope(self) -> RequestFunction:
        return resolve_callable(self.raw("SCOPE"), "SCOPE")

    @property
    def fingerprint(self) -> RequestFunction:
        return resolve_callable(self.raw("FINGERPRINT"), "FINGERPRINT")

    @property
    def atomic(self) -> bool:
        return bool(self.raw("ATOMIC"))

    @property
    def wait(self) -> float:
        return float(self.raw("WAIT"))

    @property
    def lease(self) -> timedelta:
        return to_timedelta(self.raw("LEASE"))

    @property
    def replay_header(self) -> str:
        return str(self.raw("REPLAY_HEADER"))

    @property
    def stored_headers(self) -> frozenset[str]:
        return frozenset(
            name.lower() for name in self.raw("STORED_HEADERS") if name.lower() != "set-cookie"
        )

    @property
    def database(self) -> str:
        return str(self.raw("DATABASE"))

    @property
    def max_stored_body(self) -> int:
        return int(self.raw("MAX_STORED_BODY"))

    @property
    def enabled(self) -> bool:
        return bool(self.raw("ENABLED"))

    @property
    def problem_type_base_url(self) -> str | None:
        value = self.raw("PROBLEM_TYPE_BASE_URL")
        return None if value is None else str(value)


idempotency_settings = IdempotencySettings()
