"""Settings for the uvicorn processes: the server settings plus the middleware.

The decorated async views are skipped by the middleware (protected once),
so one server serves both the decorator's and the middleware's tests.
"""

from __future__ import annotations

from tests.server_settings import *  # noqa: F403
from tests.server_settings import MIDDLEWARE as _MIDDLEWARE

MIDDLEWARE = [*_MIDDLEWARE, "django_idempotency.middleware.IdempotencyMiddleware"]
