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
    record. A cookie the session store does not know counts as no session
    (Django deletes it in the answer, so a later retry comes without it),
    unless the key already has a record in that cookie's scope: a view that
    rotates or ends the session (a guest signing up and logged in) deletes it
    before a duplicate sent with it arrives, and that duplicate must meet the
    first in its scope. A session the view creates during this request does
    not exist yet when the scope is taken, so such a request stays
    anonymous, and so must its retry (a retry resends the request as it was,
    cookies included). The session key is a secret, so the scope holds its
    digest, never the key. Called without the key (``user_scope(request)``
    from a scope function of your own), a cookie the store does not know
    counts as no session.

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


def scope_of(
    request: HttpRequest, http_request: HttpRequest, own: Mapping[str, Any], key: str | None = None
) -> str:
    """:func:`user_scope` given what ``adapters.reach`` gives, and the key, which the core has.

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
        # The cookie as sent; a session a project set without one: its key, as it stands.
        sent = (
            http_request.COOKIES.get(settings.SESSION_COOKIE_NAME)
            or http_request.session.session_key
        )
        if sent and _unknown(http_request.session):
            # Gone from the store: deleted by this key's first request (a login rotates
            # the session), whose scope its retries must meet, or unknown before it
            # (evicted, made up), when the first was anonymous, and so are they: Django
            # deletes such a cookie in each answer, and a later retry comes without it.
            scope = _session_scope(sent) + narrowed
            return scope if key is not None and _has_record(scope, key) else ANONYMOUS + narrowed
    if sent:
        return _session_scope(sent) + narrowed
    return ANONYMOUS + narrowed


def _unknown(session: Any) -> bool:
    """Whether the session store has no session under the key the request sent."""
    session.keys()  # loading drops a key the store does not know
    return session.session_key is None


def _has_record(scope: str, key: str) -> bool:
    """Whether ``key`` has a record in ``scope``: a session's, which only its holder reaches."""
    from django_idempotency import store
    from django_idempotency.conf import idempotency_settings

    return store.has_record(idempotency_settings.database, scope, key)


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
