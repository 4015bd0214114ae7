"""Settings of the bench project: PostgreSQL, no authentication, persistent connections.

``BENCH_DATABASE_NAME`` names the database (``benchmarks.suite`` creates and
drops it); ``PGHOST``/``PGPORT``/``PGUSER``/``PGPASSWORD`` reach the server.
``BENCH_CONN_MAX_AGE=0`` opens a connection per request instead;
``BENCH_OURS_ONLY=1`` leaves the peers out, and ``BENCH_REPLAY_CACHE=redis``
then turns our replay cache on (the peers would refuse an ``IDEMPOTENCY``
dict with our keys).
"""

from __future__ import annotations

import os

from benchmarks.bench import peers
from benchmarks.bench.caches import redis_cache

SECRET_KEY = "bench-only-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "benchmarks.bench.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("BENCH_DATABASE_NAME", "bench_idempotency"),
        "HOST": os.environ.get("PGHOST", "127.0.0.1"),
        "PORT": os.environ.get("PGPORT", "5432"),
        "USER": os.environ.get("PGUSER", "postgres"),
        "PASSWORD": os.environ.get("PGPASSWORD", ""),
        # Production setups keep connections open (or pool them); opening one
        # per request would hide every package's overhead behind its cost.
        "CONN_MAX_AGE": int(os.environ.get("BENCH_CONN_MAX_AGE", "600")),
    }
}
if os.environ.get("BENCH_ASGI") == "1":
    # Under ASGI each request's database work runs in a thread of its own, so
    # a connection kept per thread would not be reused: pool them instead.
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    DATABASES["default"]["OPTIONS"] = {"pool": {"min_size": 4, "max_size": 8}}
OURS_ONLY = os.environ.get("BENCH_OURS_ONLY") == "1"
_PEERS = [] if OURS_ONLY else peers.installed()
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "rest_framework",
    "django_idempotency",
    "benchmarks.bench",
]
MIDDLEWARE: list[str] = []
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.AllowAny"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "UNAUTHENTICATED_USER": None,
}
# No IDEMPOTENCY dict: ours and drf-idempotency both read a setting of that
# name and each rejects the other's keys, so both run on their defaults.

# django-idempotency-key keeps responses in process memory by default, which
# four worker processes do not share; its documented shared option is a
# Django cache, here the database cache on the same PostgreSQL server.
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.db.DatabaseCache",
        "LOCATION": "bench_cache",
        # Django's default of 300 s would expire stored responses during the
        # run; 24 hours is the retry window ours and drf-idempotency keep.
        "TIMEOUT": 24 * 60 * 60,
        # Django culls a third of the table past 300 entries by default,
        # which would turn replays back into first requests.
        "OPTIONS": {"MAX_ENTRIES": 10_000_000},
    }
}
IDEMPOTENCY_KEY = {
    "STORAGE": {"CLASS": "idempotency_key.storage.CacheKeyStorage", "CACHE_NAME": "default"},
}
# djangorestframework-idempotency-key has no default for its lock timeout.
IDEMPOTENCY_KEY_LOCK_TIMEOUT = 60

# The path-limited peer middlewares go outside django-idempotency-key's: a
# replay they answer skips the view, and django-idempotency-key raises
# ImproperlyConfigured for any 2xx response whose view it did not see.
for _peer in _PEERS:
    if _peer.module == "drf_idempotency":
        INSTALLED_APPS.append("drf_idempotency")
        MIDDLEWARE.append("benchmarks.bench.peer_views.DrfIdempotencyOnItsPath")
    elif _peer.module == "rest_framework_idempotency_key":
        INSTALLED_APPS.append("rest_framework_idempotency_key")
        MIDDLEWARE.append("benchmarks.bench.peer_views.DrfIdempotencyKeyOnItsPath")
if any(peer.variant == "dik" for peer in _PEERS):
    # Views opt in with @idempotency_key; all other views are exempt.
    MIDDLEWARE.append("idempotency_key.middleware.ExemptIdempotencyKeyMiddleware")

if OURS_ONLY and os.environ.get("BENCH_REPLAY_CACHE") == "redis":
    CACHES["replay"] = redis_cache(os.environ.get("BENCH_REDIS_PREFIX", "bench"))
    IDEMPOTENCY = {"REPLAY_CACHE": "replay"}
