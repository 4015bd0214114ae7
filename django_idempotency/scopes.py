"""Scope functions: who owns a key.

Keys are unique only within a scope: the scope keeps one client from ever
receiving another client's stored response.

``request.user`` is set before the scope is taken only when Django (or DRF,
before the mixin) authenticated the request; a view that authenticates its
caller itself does so too late. Hence the session and ``Authorization``
fallbacks of :func:`user_scope`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.http import HttpRequest
from django.http.request import HttpHeaders
from django.utils.crypto import salted_hmac

from django_idempotency.adapters import NOT_A_FRAMEWORKS, reach
from django_idempotency.fields import KEY_COLUMN_LENGTH

ANONYMOUS = "anonymous"
#: What a fitted value starts with when it is a digest (:func:`fit_key_column`).
DIGEST_PREFIX = "sha256:"
#: The hex digits of the ``Authorization`` header's digest kept in the scope.
CREDENTIAL_DIGEST_LENGTH = 32
# Must never change. The middleware introduced these scopes (hence the name); the same
# salt keeps their records replayable to retries sent across an upgrade: another salt
# gives such a retry another scope, and it runs again.
_CREDENTIAL_SALT = "django_idempotency.middleware.credential"


def user_scope(request: HttpRequest) -> str:
    """``user:<pk>`` for an authenticated user; else its session, its credentials, or ``anonymous``.

    A browser without a user (a guest checkout) is scoped by the session
    cookie it sent, so that two browsers sending the same key never share a
    record. The cookie counts as sent, whether the session store still knows
    it or not: a view that rotates or ends the session (a guest signing up
    and logged in) deletes it before a duplicate sent with it arrives, and
    that duplicate must meet the first in its scope, whatever the session
    backend. A session the view creates during this request does not exist
    yet when the scope is taken, so such a request stays anonymous, and so
    must its retry (a retry resends the request as it was, cookies
    included). The session key is a secret, so the scope holds its digest,
    never the key.

    A caller without a user that sends an ``Authorization`` header has a
    keyed digest of it added, ``anonymous|credential:<digest>`` or, with a
    session, ``session:<digest>|credential:<digest>``, so that two such
    callers never share a scope. Credentials sent any other way
    (an API key in another header, in the query string or in the body) are
    not seen: use a scope function of your own for them.
    """
    if isinstance(request, HttpRequest):
        return scope_of(request, request, NOT_A_FRAMEWORKS)
    http_request, own, _ = reach(request)
    return scope_of(request, http_request, own)


def scope_of(request: HttpRequest, http_request: HttpRequest, own: Mapping[str, Any]) -> str:
    """:func:`user_scope` given what ``adapters.reach`` gives, which the core has.

    What was set on a framework's request itself (``own``) comes first.
    """
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return f"user:{user.pk}"
    headers = own.get("headers")
    if headers is None:
        headers = (
            http_request.__dict__.get("headers")
            if isinstance(http_request, HttpRequest)
            else http_request.headers
        )
    if headers is None:
        # Without building request.headers for one header.
        credentials = http_request.META.get("HTTP_AUTHORIZATION")
    elif type(headers) is HttpHeaders:
        # HttpHeaders.get's lower-cased lookup, without its KeyError round trip.
        found = headers._store.get("authorization")
        credentials = None if found is None else found[1]
    else:
        credentials = headers.get("Authorization")
    # Two credentials sent from one cookie jar (a proxy, a shared client) stay apart.
    narrowed = _credential(credentials) if credentials else ""
    session = own.get("session")
    if session is not None:
        sent = session.session_key  # a framework's request's own session, as it stands
    elif getattr(http_request, "session", None) is None:
        sent = None
    else:
        # The cookie as sent, whether the store still knows it or not: a view that rotates
        # or ends the session (login, logout) deletes it before a duplicate sent with it
        # arrives, and an expired or evicted one must not split a double click either. A
        # session a project set without the cookie: its key, as it stands.
        sent = (
            http_request.COOKIES.get(settings.SESSION_COOKIE_NAME)
            or http_request.session.session_key
        )
    if sent:
        return _session_scope(sent) + narrowed
    return ANONYMOUS + narrowed


def _session_scope(sent: str) -> str:
    return "session:" + hashlib.sha256(sent.encode()).hexdigest()


def session_scope(request: HttpRequest) -> str:
    """The same as :func:`user_scope`; kept for the settings that name it."""
    return user_scope(request)


def _credential(credentials: str) -> str:
    """``|credential:`` and a keyed digest of the ``Authorization`` header, to narrow a scope.

    Keyed (HMAC with ``SECRET_KEY``): a Basic header holds a password, which
    a plain hash would expose to guessing.
    """
    digest = salted_hmac(_CREDENTIAL_SALT, credentials, algorithm="sha256").hexdigest()
    return f"|credential:{digest[:CREDENTIAL_DIGEST_LENGTH]}"


def fit_key_column(value: str) -> str:
    """``value``, or its digest when the scope or key column cannot hold it.

    Truncating would let two long values collide. A value that spells a
    digest is digested too, so that no value can be stored as another's.
    """
    if len(value) <= KEY_COLUMN_LENGTH and not value.startswith(DIGEST_PREFIX):
        return value
    return DIGEST_PREFIX + hashlib.sha256(value.encode()).hexdigest()
