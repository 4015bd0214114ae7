"""The ``IDEMPOTENCY`` settings: each described once, as an attribute of the settings object.

A setting's default, validator, normaliser, check id and hint live in one
row, from which the system checks and the per-view options derive too, so
an option cannot accept a value its setting would refuse. Values are cached
until Django's ``setting_changed``; defaults are never written into
``django.conf.settings``.
"""

from __future__ import annotations

import difflib
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import lru_cache
from typing import Any, Generic, NoReturn, TypeVar, cast, overload

from asgiref.sync import iscoroutinefunction
from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.http import HttpRequest
from django.utils.module_loading import import_string

from django_idempotency.fields import KEY_COLUMN_LENGTH

SETTING_NAME = "IDEMPOTENCY"
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"})
# RFC 9110 token characters: what a header field name may contain.
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")
_DOTTED_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+\Z")
_ABSOLUTE_URL = re.compile(r"^https?://[^\s/?#]+[^\s]*\Z")

T = TypeVar("T")
RequestFunction = Callable[[HttpRequest], str]
#: A view's ``key`` option: the key read from the request itself, or ``None``.
KeyFunction = Callable[[HttpRequest], "str | None"]
#: A view's ``store`` option: whether a response may complete the key.
StoreFunction = Callable[[Any], bool]


class InvalidValue(ValueError):
    """A value that passed its type rule but could not be normalised (an import failed)."""


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_positive_duration(value: Any) -> bool:
    if isinstance(value, timedelta):
        return value > timedelta(0)
    return _is_number(value) and value > 0


# A form field name as a browser sends it: no whitespace or control characters.
_FIELD_NAME = re.compile(r"^[\x21-\x7e]+\Z")


def _is_header_name(value: Any) -> bool:
    return isinstance(value, str) and bool(_TOKEN.match(value))


def _is_header_list(value: Any) -> bool:
    return isinstance(value, list | tuple | set | frozenset) and all(
        _is_header_name(item) for item in value
    )


def _is_method_list(value: Any) -> bool:
    # A bare string is refused: iterating "POST" would give {P, O, S, T}.
    return (
        isinstance(value, list | tuple | set | frozenset)
        and len(value) > 0
        and all(isinstance(item, str) and item.upper() in KNOWN_METHODS for item in value)
    )


def _is_key_length(value: Any) -> bool:
    return _is_int(value) and 1 <= value <= KEY_COLUMN_LENGTH


def _is_request_function(value: Any) -> bool:
    return callable(value) or (isinstance(value, str) and bool(_DOTTED_PATH.match(value)))


def to_timedelta(value: timedelta | int | float) -> timedelta:
    """Accept a timedelta or a number of seconds, as every duration option does."""
    if isinstance(value, timedelta):
        return value
    return timedelta(seconds=value)


def _to_methods(value: Any) -> frozenset[str]:
    return frozenset(method.upper() for method in value)


def _to_stored_headers(value: Any) -> frozenset[str]:
    return frozenset(name.lower() for name in value if name.lower() != "set-cookie")


def to_request_function(value: str | RequestFunction) -> RequestFunction:
    """Turn a dotted path into the callable it names; say why an import failed."""
    if callable(value):
        return value
    return _import_request_function(value)


@lru_cache(maxsize=64)
def _import_request_function(path: str) -> RequestFunction:
    try:
        func = import_string(path)
    except ImportError as exc:
        raise InvalidValue(f"names {path!r}, which could not be imported: {exc}") from exc
    if not callable(func):
        raise InvalidValue(f"names {path!r}, a {type(func).__name__}, not a callable")
    return cast(RequestFunction, func)


def _identity(value: Any) -> Any:
    return value


def _under(url: str | None) -> str | None:
    """A base URL ready for a name: ``https://x/problems`` is ``https://x/problems/``.

    Only one that ends in a letter or digit, a folder's name, gets the ``/``: any other
    ending (``/``, ``#``, ``=``, ``-``) is where the name goes, as given.
    """
    if url is None or not url[-1].isalnum():
        return url
    return url + "/"


def _is_response_predicate(value: Any) -> bool:
    # Asked in the request's thread, after the view: a coroutine function
    # would return a coroutine, never a verdict.
    if callable(value):
        return not iscoroutinefunction(value)
    return isinstance(value, str) and bool(_DOTTED_PATH.match(value))


def _to_response_predicate(value: str | Callable[[Any], bool]) -> Callable[[Any], bool]:
    function = to_request_function(value)  # type: ignore[arg-type]
    if iscoroutinefunction(function):
        raise InvalidValue(f"names {value!r}, an async function: store must answer at once")
    return cast(Callable[[Any], bool], function)


def _is_optional_function(value: Any) -> bool:
    return value is None or _is_request_function(value)


def _to_optional_function(value: Any) -> Any:
    return None if value is None else to_request_function(value)


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One row of the settings table, and the typed attribute that reads it.

    A row is named after its attribute (``ttl`` is ``IDEMPOTENCY["TTL"]``).
    Read from the class it is the row; from the settings object, the
    normalised value.
    """

    default: Any
    is_valid: Callable[[Any], bool]
    normalise: Callable[[Any], T]
    check_id: str
    hint: str
    #: Also a per-view option (``@idempotent(ttl=...)``, ``idempotency_ttl``).
    option: bool = False
    #: Normalising imports code: a per-view value is imported at first use.
    imports: bool = False
    #: The key in ``IDEMPOTENCY``; given only for :data:`OPTION_ONLY`.
    name: str = ""

    def __set_name__(self, owner: type, attribute: str) -> None:
        object.__setattr__(self, "name", attribute.upper())

    @overload
    def __get__(self, instance: None, owner: type) -> Setting[T]: ...
    @overload
    def __get__(self, instance: IdempotencySettings, owner: type) -> T: ...
    def __get__(self, instance: IdempotencySettings | None, owner: type) -> Setting[T] | T:
        if instance is None:
            return self
        return cast(T, instance.value(self))

    @property
    def option_name(self) -> str:
        return self.name.lower()

    def problem(self, value: Any, *, resolve: bool = True) -> str | None:
        """What is wrong with ``value``, to follow the name of where it was set; None if fine."""
        if not self.is_valid(value):
            return f"has an invalid value: {value!r}"
        if resolve:
            try:
                self.normalise(value)
            except InvalidValue as exc:
                return str(exc)
        return None

    def clean(self, value: Any, label: str) -> Any:
        """The normalised value, or ``ImproperlyConfigured`` naming ``label`` and the fix."""
        problem = self.problem(value, resolve=False)
        if problem is None:
            try:
                return self.normalise(value)
            except InvalidValue as exc:
                problem = str(exc)
        self.refuse(label, problem)

    def refuse(self, label: str, problem: str) -> NoReturn:
        raise ImproperlyConfigured(f"{label} {problem}. {self.hint}")


_FUNCTION_HINT = (
    "Use a callable f(request) -> str or the dotted path of one, "
    "e.g. 'myproject.idempotency.tenant_scope'."
)


def _duration(default: timedelta, check_id: str) -> Setting[timedelta]:
    """A row of a positive length of time; a per-view option too."""
    return Setting(
        default,
        _is_positive_duration,
        to_timedelta,
        check_id,
        "Use a positive timedelta or a number of seconds, e.g. timedelta(hours=1) or 3600.",
        option=True,
    )


def _request_function(
    default: str | None, check_id: str, hint: str = _FUNCTION_HINT, name: str = ""
) -> Setting[RequestFunction]:
    """A row naming a function of the request, or its dotted path; a per-view option too."""
    return Setting(
        default,
        _is_request_function,
        to_request_function,
        check_id,
        hint,
        option=True,
        imports=True,
        name=name,
    )


class IdempotencySettings:
    """The user's ``IDEMPOTENCY`` dict over the defaults, normalised and cached."""

    header = Setting(
        "Idempotency-Key",
        _is_header_name,
        str,
        "django_idempotency.E101",
        "Use a header field name such as 'Idempotency-Key'.",
    )
    required = Setting(
        False,
        _is_bool,
        bool,
        "django_idempotency.E102",
        "Use True or False.",
        option=True,
    )
    methods: Setting[frozenset[str]] = Setting(
        ("POST", "PATCH"),
        _is_method_list,
        _to_methods,
        "django_idempotency.E103",
        "Use a non-empty tuple of HTTP methods, e.g. ('POST', 'PATCH'); "
        "for one method write ('POST',), not 'POST'.",
        option=True,
    )
    ttl = _duration(timedelta(hours=24), "django_idempotency.E104")
    key_max_length = Setting(
        KEY_COLUMN_LENGTH,
        _is_key_length,
        int,
        "django_idempotency.E105",
        f"Use an integer from 1 to {KEY_COLUMN_LENGTH} (the width of the key column).",
    )
    key_min_length = Setting(
        1,
        _is_key_length,
        int,
        "django_idempotency.E106",
        f"Use an integer from 1 to {KEY_COLUMN_LENGTH}, e.g. 16 for public endpoints "
        "whose clients send random keys.",
    )
    scope = _request_function("django_idempotency.scopes.user_scope", "django_idempotency.E107")
    fingerprint = _request_function(
        "django_idempotency.fingerprint.request_fingerprint", "django_idempotency.E108"
    )
    atomic = Setting(
        True,
        _is_bool,
        bool,
        "django_idempotency.E109",
        "Use True (atomic mode) or False (lease mode).",
        option=True,
    )
    wait = Setting(
        5.0,
        lambda value: _is_number(value) and 0 <= value <= 3600,
        float,
        "django_idempotency.E110",
        "Use a number of seconds from 0 to 3600.",
        option=True,
    )
    lease = _duration(timedelta(minutes=5), "django_idempotency.E111")
    replay_header = Setting(
        "Idempotent-Replayed",
        _is_header_name,
        str,
        "django_idempotency.E112",
        "Use a header field name such as 'Idempotent-Replayed'.",
    )
    stored_headers: Setting[frozenset[str]] = Setting(
        (
            "Content-Type",
            "Location",
            "ETag",
            "Last-Modified",
            "Content-Language",
            "Content-Encoding",
            "Content-Disposition",
        ),
        _is_header_list,
        _to_stored_headers,
        "django_idempotency.E113",
        "Use a tuple of header field names, e.g. ('Content-Type', 'Location').",
    )
    database = Setting(
        "default",
        lambda value: isinstance(value, str),
        str,
        "django_idempotency.E114",
        "Use a database alias from DATABASES, e.g. 'default'.",
    )
    max_stored_body = Setting(
        1_048_576,
        lambda value: _is_int(value) and value >= 0,
        int,
        "django_idempotency.E115",
        "Use a number of bytes, 0 or more.",
    )
    enabled = Setting(
        True,
        _is_bool,
        bool,
        "django_idempotency.E116",
        "Use True or False.",
    )
    problem_type_base_url: Setting[str | None] = Setting(
        None,
        lambda value: (
            value is None or (isinstance(value, str) and _ABSOLUTE_URL.match(value) is not None)
        ),
        _under,
        "django_idempotency.E119",
        "Use None (URN problem types) or an absolute http(s) URL such as "
        "'https://api.example.com/problems/'; each problem's name is put under it.",
    )
    replay_cache: Setting[str | None] = Setting(
        None,
        lambda value: value is None or (isinstance(value, str) and value != ""),
        _identity,
        "django_idempotency.E120",
        "Use None (no replay cache) or the alias of a cache in CACHES, e.g. 'default'.",
    )
    recover: Setting[Callable[..., Any] | None] = Setting(
        None,
        _is_optional_function,
        _to_optional_function,
        "django_idempotency.E121",
        "Use None (an abandoned claim is taken over), or a callable "
        "f(request, abandoned) -> HttpResponse | None or the dotted path of one, "
        "e.g. 'django_idempotency.recovery.hold'.",
        option=True,
        imports=True,
    )

    form_field: Setting[str | None] = Setting(
        "idempotency_key",
        lambda value: value is None or (isinstance(value, str) and bool(_FIELD_NAME.match(value))),
        _identity,
        "django_idempotency.E122",
        "Use the name of a form field, e.g. 'idempotency_key' (the name "
        "{% idempotency_key_field %} renders), or None to read keys from the header only.",
    )

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}
        # Held while a value is cached or the cache dropped, never while read.
        self._lock = threading.Lock()
        #: Bumped on every reload, so that derived values know they are stale.
        self.generation = 0
        #: Called on every reload, under the lock: derived values forget themselves.
        self.on_reload: list[Callable[[], None]] = []

    def user_settings(self) -> dict[str, Any]:
        user = getattr(django_settings, SETTING_NAME, {})
        if not isinstance(user, dict):
            raise ImproperlyConfigured(
                f"{SETTING_NAME} must be a dict, not {type(user).__name__}. "
                "See the settings page of the django-idempotency docs."
            )
        return user

    def raw(self, name: str) -> Any:
        return self.user_settings().get(name, DEFAULTS[name])

    def value(self, setting: Setting[Any]) -> Any:
        try:
            return self._cache[setting.name]
        except KeyError:
            pass
        generation = self.generation
        # Fails in the system check's words, should the check be silenced.
        value = setting.clean(self.raw(setting.name), f"{SETTING_NAME}[{setting.name!r}]")

        def keep() -> None:
            self._cache[setting.name] = value
            # A row is a non-data descriptor: later reads are plain lookups.
            self.__dict__[setting.option_name] = value

        self.keep_if_current(generation, keep)
        return value

    def reload(self) -> None:
        with self._lock:
            for row in SETTINGS:
                self.__dict__.pop(row.option_name, None)
            self._cache.clear()
            self.generation += 1
            for forget in self.on_reload:
                forget()

    def keep_if_current(self, generation: int, keep: Callable[[], None]) -> None:
        """Call ``keep`` unless the settings were reloaded since ``generation`` was read.

        Under :meth:`reload`'s lock, so a value derived before an override is
        never kept past it.
        """
        with self._lock:
            if generation == self.generation:
                keep()


#: The rows, in the order they are declared.
SETTINGS: tuple[Setting[Any], ...] = tuple(
    row for row in vars(IdempotencySettings).values() if isinstance(row, Setting)
)

#: Per-view options with no setting, so no value check; a dotted path that
#: fails to import is the views' check, E118.
OPTION_ONLY: tuple[Setting[Any], ...] = (
    _request_function(
        None,
        "",
        "Use a callable f(request) -> str | None that reads the key from the request "
        "(an event id in the body, a delivery id header), or the dotted path of one, "
        "e.g. 'myproject.webhooks.event_id'.",
        name="KEY",
    ),
    Setting(
        None,
        _is_response_predicate,
        _to_response_predicate,
        "",
        "Use a callable f(response) -> bool (not async) that accepts the responses which "
        "may complete the key, or the dotted path of one, e.g. "
        "'django_idempotency.webhooks.success_only'.",
        option=True,
        imports=True,
        name="STORE",
    ),
)

BY_NAME: dict[str, Setting[Any]] = {setting.name: setting for setting in SETTINGS}
DEFAULTS: dict[str, Any] = {setting.name: setting.default for setting in SETTINGS}

idempotency_settings = IdempotencySettings()


#: The check for a key that is not a setting; silencing it also silences
#: the refusal under ``override_settings``.
UNKNOWN_KEY_CHECK_ID = "django_idempotency.E002"


def unknown_key(key: Any) -> tuple[str, str]:
    """The message and hint for an ``IDEMPOTENCY`` key that is not a setting."""
    close = difflib.get_close_matches(str(key), DEFAULTS, n=1)
    hint = f"Did you mean {close[0]!r}?" if close else f"Known keys: {', '.join(DEFAULTS)}."
    return f"{SETTING_NAME}[{key!r}] is not a known setting.", hint


def _reload_settings(*, setting: str, enter: bool = True, **kwargs: Any) -> None:
    if setting != SETTING_NAME:
        return
    idempotency_settings.reload()
    if enter:
        _refuse_unknown_keys()


def _refuse_unknown_keys() -> None:
    """Fail an ``override_settings`` that misspells a key, as the system check fails start-up.

    Otherwise a test with a typo would run with the default and pass for the
    wrong reason. Django's ``override_settings`` undoes an override whose
    receiver raises, then raises the error. A bad *value* is left to its
    first read: refusing it here would refuse the overrides that test the
    checks themselves.
    """
    user = getattr(django_settings, SETTING_NAME, {})
    if not isinstance(user, dict) or UNKNOWN_KEY_CHECK_ID in django_settings.SILENCED_SYSTEM_CHECKS:
        return
    for key in user:
        if key not in DEFAULTS:
            message, hint = unknown_key(key)
            raise ImproperlyConfigured(f"{message} {hint}")


setting_changed.connect(_reload_settings, dispatch_uid="django_idempotency.conf.reload")
