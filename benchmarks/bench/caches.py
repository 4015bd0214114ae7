"""The Redis cache the bench settings give the replay cache."""

from __future__ import annotations

import os


def redis_cache(prefix: str) -> dict:
    """The Redis server of ``BENCH_REDIS_URL``, keys under ``prefix``.

    The short timeouts make a Redis server that is not running fail the
    first call quickly: the rows that need it are left out, not stalled.
    """
    return {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"),
        "KEY_PREFIX": prefix,
        "OPTIONS": {"socket_connect_timeout": 1, "socket_timeout": 1},
    }
