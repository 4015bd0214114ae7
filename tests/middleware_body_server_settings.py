"""The gunicorn server settings with ``IdempotencyMiddleware`` installed, over upload views."""

from tests.body_server_settings import *  # noqa: F403
from tests.body_server_settings import MIDDLEWARE as _MIDDLEWARE

ROOT_URLCONF = "tests.middleware_body_urls"
MIDDLEWARE = [*_MIDDLEWARE, "django_idempotency.middleware.IdempotencyMiddleware"]
