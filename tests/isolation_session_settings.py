"""The isolation servers' settings with ``session_scope``, for anonymous callers with sessions."""

from __future__ import annotations

from tests.isolation_settings import *  # noqa: F403

IDEMPOTENCY = {"SCOPE": "django_idempotency.scopes.session_scope"}
