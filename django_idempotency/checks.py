"""System checks for the ``IDEMPOTENCY`` setting and where the middleware sits.

A typo or a bad value must stop ``runserver``, ``migrate`` and the test run
with a message naming the key, rather than surface as a 500 on the first
protected request; so must a middleware order that would take the scope
before Django knows the user. Each rule has its own id, so that a project
can silence exactly one; the value rules (and the unknown-key words) come
from :mod:`django_idempotency.conf`. The ids are listed in docs/settings.rst.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning
from django.core.exceptions import ImproperlyConfigured
from django.urls import URLPattern, URLResolver, get_resolver

from django_idempotency.conf import (
    BY_NAME,
    DEFAULTS,
    SETTING_NAME,
    SETTINGS,
    UNKNOWN_KEY_CHECK_ID,
    idempotency_settings,
    unknown_key,
)
from django_idempotency.options import all_deferred_imports

NOT_A_DICT = "django_idempotency.E001"
UNKNOWN_KEY = UNKNOWN_KEY_CHECK_ID
UNKNOWN_DATABASE = "django_idempotency.E004"
SET_COOKIE_STORED = "django_idempotency.E005"
KEY_LENGTHS_CROSSED = "django_idempotency.E117"
VIEW_IMPORT_FAILED = "django_idempotency.E118"
UNPROTECTABLE_VIEW = "django_idempotency.E007"


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    user = getattr(settings, SETTING_NAME, {})
    if not isinstance(user, dict):
        return [
            Error(
                f"{SETTING_NAME} must be a dict, not {type(user).__name__}.",
                hint="See the settings page of the django-idempotency docs.",
                id=NOT_A_DICT,
            )
        ]
    errors: list[CheckMessage] = [_unknown_key(key) for key in user if key not in DEFAULTS]
    invalid = set()
    for setting in SETTINGS:
        if setting.name not in user:
            continue
        problem = setting.problem(user[setting.name])
        if problem is not None:
            invalid.add(setting.name)
            errors.append(_error(setting.name, f"{problem}.", setting.hint, setting.check_id))
    values = {name: user.get(name, default) for name, default in DEFAULTS.items()}
    for rule in (_database_alias, _set_cookie, _key_lengths, _replay_cache_alias):
        errors.extend(rule(values, invalid))
    return errors


def _error(key: str, message: str, hint: str, id: str) -> Error:
    return Error(f"{SETTING_NAME}[{key!r}] {message}", hint=hint, id=id)


def _unknown_key(key: Any) -> Error:
    message, hint = unknown_key(key)
    return Error(message, hint=hint, id=UNKNOWN_KEY)


# Rules over a valid value and the rest of the project's settings.


def _database_alias(values: dict[str, Any], invalid: set[str]) -> list[Error]:
    database = values["DATABASE"]
    if "DATABASE" in invalid or database in settings.DATABASES:
        return []
    return [
        _error(
            "DATABASE",
            f"names {database!r}, which is not in DATABASES.",
            f"Use one of: {', '.join(settings.DATABASES)}.",
            UNKNOWN_DATABASE,
        )
    ]


def _set_cookie(values: dict[str, Any], invalid: set[str]) -> list[Error]:
    stored = values["STORED_HEADERS"]
    if "STORED_HEADERS" in invalid or all(name.lower() != "set-cookie" for name in stored):
        return []
    return [
        _error(
            "STORED_HEADERS",
            "includes Set-Cookie, which is never stored or replayed.",
            "Remove 'Set-Cookie': replaying a session cookie would hand it to whoever retries.",
            SET_COOKIE_STORED,
        )
    ]


def _key_lengths(values: dict[str, Any], invalid: set[str]) -> list[Error]:
    low, high = values["KEY_MIN_LENGTH"], values["KEY_MAX_LENGTH"]
    if {"KEY_MIN_LENGTH", "KEY_MAX_LENGTH"} & invalid or low <= high:
        return []
    return [
        _error(
            "KEY_MIN_LENGTH",
            f"is {low}, above KEY_MAX_LENGTH ({high}): every key would be refused.",
            BY_NAME["KEY_MIN_LENGTH"].hint + " Keep it at most KEY_MAX_LENGTH.",
            KEY_LENGTHS_CROSSED,
        )
    ]


def _replay_cache_alias(values: dict[str, Any], invalid: set[str]) -> list[Error]:
    alias = values["REPLAY_CACHE"]
    if "REPLAY_CACHE" in invalid or alias is None or alias in settings.CACHES:
        return []
    setting = BY_NAME["REPLAY_CACHE"]
    return [
        _error(
            "REPLAY_CACHE",
            f"names {alias!r}, which is not in CACHES.",
            f"Use None or one of: {', '.join(settings.CACHES) or '(no caches configured)'}.",
            setting.check_id,
        )
    ]


def check_view_options(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Import the dotted paths that views' options defer to their first request.

    Decorating a view does not import them (that would invite import
    cycles); by the time the checks run every module can be imported, so a
    wrong path still stops start-up rather than fail every request.
    """
    try:
        get_resolver().url_patterns  # noqa: B018  imports the views
    except Exception:
        return []  # Django's own URL checks report a URLconf that fails to import
    errors: list[CheckMessage] = []
    for label, setting, path in all_deferred_imports():
        problem = setting.problem(path)
        if problem is not None:
            errors.append(Error(f"{label} {problem}.", hint=setting.hint, id=VIEW_IMPORT_FAILED))
    return errors


def check_middleware_order(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """``IdempotencyMiddleware`` must come after the middleware that sets ``request.user``,
    and after every middleware with a ``process_view`` (CSRF, login) or a
    ``process_exception``; best, it comes last.

    The middleware refuses to load in the wrong order too (see
    :func:`django_idempotency.middleware.misplaced`), since a server such
    as gunicorn runs no system checks.
    """
    from django_idempotency.middleware import ORDER_CHECK_ID, listed_after, misplaced

    problem = misplaced()
    if problem is not None:
        message, hint = problem
        return [Error(message, hint=hint, id=ORDER_CHECK_ID)]
    later = listed_after()
    if not later:
        return []
    return [
        Warning(
            f"'django_idempotency.middleware.IdempotencyMiddleware' is listed before "
            f"{', '.join(map(repr, later))} in MIDDLEWARE.",
            hint=(
                "Move it to the end of MIDDLEWARE. A replay, and the middleware's own "
                "400, 409 and 422 answers, skip what is listed after it (headers it adds, "
                "CORS included, are missing from them), and one that cancels the view or "
                "answers in its place, such as a timeout, hides how the view ended: a "
                "view cut short would look like one that answered."
            ),
            id=LATER_MIDDLEWARE_CHECK_ID,
        )
    ]


#: The warning that a middleware is listed after ``IdempotencyMiddleware``.
LATER_MIDDLEWARE_CHECK_ID = "django_idempotency.W006"


def check_middleware_views(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Each view ``IdempotencyMiddleware`` would refuse to protect, as its first request would.

    A DRF view inside a decorator of its ``as_view()`` cannot be protected after DRF's
    authentication without skipping that decorator: every request with a key would fail.
    """
    from django_idempotency.middleware import installed
    from django_idempotency.protection import view_protection

    if not installed():
        return []
    try:
        if not idempotency_settings.enabled:
            return []  # the middleware protects, and refuses, nothing
        methods = sorted({method.upper() for method in idempotency_settings.methods})
        idempotency_settings.database  # noqa: B018  what every view's protection reads
    except ImproperlyConfigured:
        return []  # check_settings reports it
    try:
        patterns = get_resolver().url_patterns
    except Exception:
        return []  # Django's own URL checks report a URLconf that fails to import
    errors: list[CheckMessage] = []
    for route, view in _views(patterns, ""):
        for method in methods:
            protects = view_protection(view, method).middleware
            if protects is None:
                continue
            try:
                protects()
            except ImproperlyConfigured as refusal:
                errors.append(Error(f"The URL {route!r}: {refusal}", id=UNPROTECTABLE_VIEW))
                break
    return errors


def _views(patterns: Any, prefix: str) -> list[tuple[str, Any]]:
    """Each URL pattern's route and view, outside an admin site (the middleware skips those)."""
    found: list[tuple[str, Any]] = []
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            if pattern.app_name == "admin":
                continue
            found += _views(pattern.url_patterns, prefix + str(pattern.pattern))
        elif isinstance(pattern, URLPattern):
            found.append((prefix + str(pattern.pattern), pattern.callback))
    return found
