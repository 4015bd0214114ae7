"""The optional replay cache (``REPLAY_CACHE``): completed responses, before the database.

The database stays the only authority on a key. The cache holds copies of
completed responses only, each put after its transaction committed and
living no longer than its record, so that every hit is an answer the
database would give too. Anything else (a miss, a fingerprint that does not
match, a cache that fails or times out) falls through to the database,
which answers as if there were no cache. See "Replay cache" in
docs/settings.rst for why purging and releasing records needs no eviction.
"""

from __future__ import annotations

import hashlib
import logging
import time
from datetime import timedelta
from typing import Any

from django.core.cache import caches
from django.db import connections

from django_idempotency.conf import idempotency_settings
from django_idempotency.info import IdempotencyInfo
from django_idempotency.keys import mask_key
from django_idempotency.responses import StoredResponse

logger = logging.getLogger(__name__)

#: Cache keys are a digest of the database, scope and key: never the key in
#: clear, and short and plain enough for every cache backend (memcached
#: refuses spaces).
KEY_PREFIX = "django_idempotency:replay:"
#: The first item of every entry; a different layout is never read.
FORMAT = 1
#: Entries that would live less than this are not put at all: a cache that
#: counts timeouts in whole seconds could otherwise round them up.
MIN_LIFETIME = 1.0


def cache_key(scope: str, key: str, using: str | None = None) -> str:
    """The cache key of (scope, key) in the database ``using`` (default: ``DATABASE``).

    The database is part of it: deployments (or tenants with a database
    each) that share one cache but not a database must never replay each
    other's responses, which their own database has no record of.
    """
    parts = (*_database_identity(using), scope, key)
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    return KEY_PREFIX + digest


def _database_identity(using: str | None) -> tuple[str, ...]:
    """What tells one database from another: its alias, backend, server and name."""
    alias = idempotency_settings.database if using is None else using
    database = connections[alias].settings_dict
    return (
        alias,
        str(database.get("ENGINE") or ""),
        str(database.get("HOST") or ""),
        str(database.get("PORT") or ""),
        str(database.get("NAME") or ""),
    )


def lookup(alias: str, info: IdempotencyInfo, using: str | None = None) -> StoredResponse | None:
    """The cached response for this request, or ``None`` to ask the database.

    ``None`` also for an entry whose fingerprint differs (the database
    answers 422 with its own signals) and for one past its lifetime (should
    the cache keep it past its timeout). The lifetime is what was left of
    its record's by the database's clock when it was put.
    ``using`` is the database the request's record lives in, by default the
    ``DATABASE`` setting's.
    """
    try:
        entry = caches[alias].get(cache_key(info.scope, info.key, using))
    except Exception:
        _log_failure("read", alias, info)
        return None
    if not isinstance(entry, tuple) or len(entry) != 6 or entry[0] != FORMAT:
        return None
    _format, fingerprint, status_code, headers, body, expires_at = entry
    if fingerprint != info.fingerprint or expires_at <= time.time():
        return None
    return StoredResponse(status_code, headers, body)


def put(
    alias: str,
    info: IdempotencyInfo,
    stored: StoredResponse,
    lifetime: timedelta,
    using: str | None = None,
) -> None:
    """Cache a committed, completed response for ``lifetime``: no longer than its record lives.

    Called only after the transaction that completed the record committed
    (``transaction.on_commit``): a response whose transaction rolled back is
    never cached. A failure is logged and otherwise ignored.
    """
    seconds = lifetime.total_seconds()
    if seconds < MIN_LIFETIME:
        return
    entry: tuple[Any, ...] = (
        FORMAT,
        info.fingerprint,
        stored.status_code,
        stored.headers,
        None if stored.body is None else bytes(stored.body),
        # Only ever shorter than the record's life: a duration from the
        # database's clock, counted from now on this host's.
        time.time() + seconds,
    )
    try:
        # Whole seconds, rounded down: the entry dies before its record does.
        caches[alias].set(cache_key(info.scope, info.key, using), entry, timeout=int(seconds))
    except Exception:
        _log_failure("write", alias, info)


def evict(alias: str, scope: str, key: str, using: str | None = None) -> None:
    """Drop the entry for (scope, key) in ``using``, for callers that delete a record early."""
    try:
        caches[alias].delete(cache_key(scope, key, using))
    except Exception:
        logger.warning(
            "Could not evict idempotency key %s in scope %r from the replay cache %r.",
            mask_key(key),
            scope,
            alias,
            exc_info=True,
        )


def _log_failure(action: str, alias: str, info: IdempotencyInfo) -> None:
    logger.warning(
        "Replay cache %r failed to %s idempotency key %s in scope %r; using the database.",
        alias,
        action,
        mask_key(info.key),
        info.scope,
        exc_info=True,
    )
