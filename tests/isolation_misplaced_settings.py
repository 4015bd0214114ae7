"""The isolation servers' settings, with the middleware misplaced.

``IdempotencyMiddleware`` listed before ``AuthenticationMiddleware``: the
order that would scope every session user ``anonymous``. A server started
on it must never serve a protected request.
"""

from __future__ import annotations

from tests.isolation_settings import *  # noqa: F403
from tests.isolation_settings import MIDDLEWARE as _MIDDLEWARE

_OURS = "django_idempotency.middleware.IdempotencyMiddleware"
_AUTHENTICATION = "django.contrib.auth.middleware.AuthenticationMiddleware"

MIDDLEWARE = [entry for entry in _MIDDLEWARE if entry != _OURS]
MIDDLEWARE.insert(MIDDLEWARE.index(_AUTHENTICATION), _OURS)
