"""Run by tox's ``base`` env: the package works with Django alone.

No DRF, no Celery, no test settings: a bare project protects a view, an
async view and (through the middleware) an undecorated view, and a retry
of each replays. It fails if importing the package pulls in an optional
dependency.
"""

from __future__ import annotations

import importlib.util
import sys

import django
from django.conf import settings
from django.http import JsonResponse
from django.urls import path

for optional in ("rest_framework", "celery", "drf_spectacular", "opentelemetry"):
    if importlib.util.find_spec(optional) is not None:
        sys.exit(f"{optional} is installed; the base env must not have it")


def create(request):  # type: ignore[no-untyped-def]
    from django_idempotency import idempotent

    @idempotent
    def view(request):  # type: ignore[no-untyped-def]
        return JsonResponse({"ok": True}, status=201)

    return view(request)


async def create_async(request):  # type: ignore[no-untyped-def]
    from django_idempotency import idempotent

    @idempotent
    async def view(request):  # type: ignore[no-untyped-def]
        return JsonResponse({"ok": "async"}, status=201)

    return await view(request)


def plain(request):  # type: ignore[no-untyped-def]
    return JsonResponse({"ok": "plain"}, status=201)


urlpatterns = [
    path("create/", create),
    path("create-async/", create_async),
    path("plain/", plain),
]

settings.configure(
    INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "django_idempotency"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    ROOT_URLCONF=__name__,
    MIDDLEWARE=["django_idempotency.middleware.IdempotencyMiddleware"],
    USE_TZ=True,
    ALLOWED_HOSTS=["testserver"],
)
django.setup()

from django.core.management import call_command  # noqa: E402
from django.test import Client  # noqa: E402

call_command("check")
call_command("migrate", verbosity=0)
client = Client()
for url in ("/create/", "/create-async/", "/plain/"):
    first = client.post(
        url, b"{}", content_type="application/json", headers={"Idempotency-Key": url}
    )
    retry = client.post(
        url, b"{}", content_type="application/json", headers={"Idempotency-Key": url}
    )
    assert first.status_code == retry.status_code == 201, (
        url,
        first.status_code,
        retry.status_code,
    )
    assert retry["Idempotent-Replayed"] == "true", url

# Functions need no Celery either (only django_idempotency.contrib.celery does).
from django_idempotency import idempotent_function  # noqa: E402

runs = []


@idempotent_function(key=lambda n: f"k-{n}")
def smoke(n: int) -> dict:
    runs.append(n)
    return {"runs": len(runs)}


values = [smoke(1) for _ in range(2)]
assert values == [{"runs": 1}, {"runs": 1}] and runs == [1], (values, runs)
for module in ("rest_framework", "celery", "drf_spectacular", "opentelemetry"):
    assert module not in sys.modules, f"{module} was imported"
print("base: django-idempotency works with Django alone")
