"""Statements and records the tests (and the benchmarks) need below the protocol.

A claim to hand to ``store.claim`` directly, and the administrator's view
of the database server: a session's lock timeout.

Importing this module touches neither the settings nor the models, so a
script may import it before it configures Django; call its functions after.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from django.db import connection
from django.utils import timezone

if TYPE_CHECKING:
    from django_idempotency.store import NewClaim


def new_claim(
    key: str, *, scope: str = "s", expires_in: timedelta = timedelta(hours=1)
) -> NewClaim:
    """An atomic-mode claim of ``key`` made now, expiring ``expires_in`` from now.

    A negative ``expires_in`` makes a claim that has already expired.
    """
    from django_idempotency.store import NewClaim

    now = timezone.now()
    return NewClaim(
        scope=scope,
        key=key,
        fingerprint="f" * 64,
        owner_token="",
        created_at=now,
        expires_at=now + expires_in,
        locked_until=None,
    )


def lock_timeout() -> str:
    """PostgreSQL: the default connection's ``lock_timeout``, as ``SHOW`` prints it."""
    with connection.cursor() as cursor:
        cursor.execute("SHOW lock_timeout")
        return str(cursor.fetchone()[0])
