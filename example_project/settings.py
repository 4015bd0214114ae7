"""Settings of the example shop: SQLite by default, DATABASE_URL to switch."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

from corsheaders.defaults import default_headers

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-project-not-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "[::1]", "testserver"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "corsheaders",
    "drf_spectacular",
    "django_idempotency",
    "example_project.shop",
    "example_project.provider",
]
MIDDLEWARE = [
    "corsheaders.middleware.CorsMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "example_project.urls"
WSGI_APPLICATION = "example_project.wsgi.application"
ASGI_APPLICATION = "example_project.asgi.application"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

# Take the write lock at BEGIN so concurrent duplicates queue up cleanly.
_sqlite_options: dict = {"timeout": 5, "transaction_mode": "IMMEDIATE"}
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("EXAMPLE_SQLITE_PATH", str(BASE_DIR / "example.sqlite3")),
        "OPTIONS": _sqlite_options,
    }
}
if os.environ.get("DATABASE_URL"):
    # postgres://user:pass@host:5432/name or mysql://root@127.0.0.1:3306/name
    import dj_database_url

    DATABASES["default"] = dj_database_url.parse(os.environ["DATABASE_URL"])
    if DATABASES["default"]["ENGINE"] == "django.db.backends.mysql":
        DATABASES["default"].setdefault("OPTIONS", {})["charset"] = "utf8mb4"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"

IDEMPOTENCY = {
    "TTL": 24 * 3600,
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    # drf-spectacular; with drf_spectacular in INSTALLED_APPS the protected
    # operations document Idempotency-Key on their own (/api/schema/).
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}
SPECTACULAR_SETTINGS = {"TITLE": "Example shop", "VERSION": "1.0.0"}

# A browser front end on another origin can only read the response headers
# CORS exposes: expose the replay marker and the 409's Retry-After.
CORS_ALLOWED_ORIGINS = ["http://localhost:3000", "http://127.0.0.1:3000"]
# ...and let it send the key: a custom request header needs a preflight.
CORS_ALLOW_HEADERS = (*default_headers, "idempotency-key")
CORS_EXPOSE_HEADERS = ["Idempotent-Replayed", "Retry-After", "Location"]

# The payment view's lease. Real leases must outlive the longest request the
# server allows (minutes); the demo keeps it short so a takeover after a
# simulated crash takes seconds.
EXAMPLE_PAYMENT_LEASE = timedelta(seconds=float(os.environ.get("EXAMPLE_PAYMENT_LEASE", "5")))
# The secret the fake provider signs its webhooks with (Standard Webhooks:
# whsec_ and base64, as a provider's dashboard shows it). Set your own in production.
PROVIDER_WEBHOOK_SECRET = os.environ.get(
    "PROVIDER_WEBHOOK_SECRET", "whsec_ZXhhbXBsZS1wcm92aWRlci1ub3Qtc2VjcmV0LWtleQ=="
)
# Lets the walkthrough's own gunicorn kill a worker mid-payment; never set it in production.
# The checkout's payment step, in seconds: slow enough to double-click.
EXAMPLE_CHECKOUT_SECONDS = float(os.environ.get("EXAMPLE_CHECKOUT_SECONDS", "1"))
EXAMPLE_ALLOW_CRASH = os.environ.get("EXAMPLE_ALLOW_CRASH") == "1"

# Celery (optional: the project runs without it, and without a broker).
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("EXAMPLE_CELERY_QUEUE", "celery")
# A directory: the walkthrough's own worker kills itself once per receipt in
# the middle of send_receipt; never set it in production.
EXAMPLE_CRASH_TASKS_ONCE = os.environ.get("EXAMPLE_CRASH_TASKS_ONCE", "")
# The orders feed (manage.py consume_orders): a RabbitMQ queue of order messages.
ORDERS_FEED_BROKER_URL = os.environ.get(
    "ORDERS_FEED_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//"
)
ORDERS_FEED_QUEUE = os.environ.get("ORDERS_FEED_QUEUE", "shop.orders")
CELERY_BEAT_SCHEDULE = {
    "purge-idempotency-keys": {
        "task": "django_idempotency.tasks.purge_expired_keys",
        "schedule": timedelta(hours=1),
    },
}
