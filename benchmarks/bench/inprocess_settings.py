"""Settings of the in-process rows: one backend per process, no peers, two replay caches.

``BENCH_BACKEND`` is ``postgresql``, ``mariadb`` or ``sqlite``;
``BENCH_CONN_MAX_AGE`` is ``0`` (a connection per request) or more
(persistent); ``BENCH_DB_PORT`` may point PostgreSQL at the latency relay;
``BENCH_PG_PREPARED=1`` turns on server-side binding and prepared statements.
The test database is created and dropped by :mod:`benchmarks.inprocess`.
"""

from __future__ import annotations

import os
import tempfile

from benchmarks.bench.caches import redis_cache

BACKEND = os.environ.get("BENCH_BACKEND", "postgresql")
NAME = os.environ.get("BENCH_DATABASE_NAME", f"bench_inprocess_{os.getpid()}")
CONN_MAX_AGE = int(os.environ.get("BENCH_CONN_MAX_AGE", "600"))

SECRET_KEY = "bench-only-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "benchmarks.bench.inprocess_urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_idempotency",
    "benchmarks.bench",
]
MIDDLEWARE: list[str] = []


def _server(engine: str, env: str, port: str, user: str) -> dict:
    """A database server, as ``{env}HOST``/``{env}PORT``/``{env}USER``/``{env}PASSWORD`` say.

    ``BENCH_DB_PORT``, when set, replaces the port (the latency relay).
    """
    return {
        "ENGINE": f"django.db.backends.{engine}",
        "HOST": os.environ.get(f"{env}HOST", "127.0.0.1"),
        "PORT": os.environ.get("BENCH_DB_PORT", os.environ.get(f"{env}PORT", port)),
        "USER": os.environ.get(f"{env}USER", user),
        "PASSWORD": os.environ.get(f"{env}PASSWORD", ""),
    }


if BACKEND == "postgresql":
    _database = _server("postgresql", "PG", "5432", "postgres")
    if os.environ.get("BENCH_PG_PREPARED") == "1":
        # Django's own options: bind parameters on the server and prepare a
        # statement from its fifth execution on a connection.
        _database["OPTIONS"] = {"server_side_binding": True, "prepare_threshold": 5}
elif BACKEND == "mariadb":
    _database = {**_server("mysql", "MYSQL_", "3306", "root"), "OPTIONS": {"charset": "utf8mb4"}}
else:
    _path = os.path.join(tempfile.gettempdir(), f"{NAME}.sqlite3")
    _database = {
        "ENGINE": "django.db.backends.sqlite3",
        "OPTIONS": {"transaction_mode": "IMMEDIATE"},
        "TEST": {"NAME": _path},
    }
    NAME = _path
DATABASES = {
    "default": {**_database, "NAME": NAME, "CONN_MAX_AGE": CONN_MAX_AGE, "TEST": {"NAME": NAME}}
}

CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "locmem": {
        "BACKEND": "django.core.cache.backends.locmem.LocMemCache",
        "LOCATION": "bench-replays",
        "OPTIONS": {"MAX_ENTRIES": 1_000_000},
    },
    "redis": redis_cache(f"bench-{os.getpid()}"),
}
