"""Scope functions: who owns a key.

Keys are only unique within a scope, so the scope is what keeps one client
from ever receiving another client's stored response.
"""

from __future__ import annotations

from django.http import HttpRequest


def user_scope(request: HttpRequest) -> str:
    """``user:<pk>`` for an authenticated user, ``anonymous`` otherwise."""
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return f"user:{user.pk}"
    return "anonymous"
