"""Scope functions: who owns a key.

Keys are only unique within a scope, so the scope is what keeps one client
from ever receiving another client's stored response. See the security
section of docs/concepts.rst for choosing between them.
"""

from __future__ import annotations

import hashlib

from django.http import HttpRequest

ANONYMOUS = "anonymous"


def user_scope(request: HttpRequest) -> str:
    """``user:<pk>`` for an authenticated user, ``anonymous`` otherwise."""
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return f"user:{user.pk}"
    return ANONYMOUS


def session_scope(request: HttpRequest) -> str:
    """As :func:`user_scope`, but an anonymous caller's own session is its scope.

    Only a session the client *sent* counts: one the view creates during
    this request does not exist yet when the scope is taken, so such a
    request stays ``anonymous``, and so must its retry (a retry resends the
    request as it was, cookies included). The session key is a secret, so
    the scope holds its digest, never the key.
    """
    scope = user_scope(request)
    if scope != ANONYMOUS:
        return scope
    session = getattr(request, "session", None)
    if session is None or session.session_key is None:
        return ANONYMOUS
    # Loading the session drops a key the store does not know (expired,
    # forged), so a made-up cookie does not get a scope of its own.
    session.keys()
    key = session.session_key
    if not key:
        return ANONYMOUS
    return "session:" + hashlib.sha256(key.encode()).hexdigest()
