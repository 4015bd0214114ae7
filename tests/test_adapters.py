"""``adapters``: one object per framework, registered in one place, asked by the core."""

from __future__ import annotations

from typing import Any

import pytest
from django.http import HttpRequest
from django.test import RequestFactory
from rest_framework.request import Request

from django_idempotency import adapters
from django_idempotency.body import django_request
from django_idempotency.contrib import celery, drf
from django_idempotency.core import PLAIN, guard_for


class Wrapper:
    """A framework's own request around Django's."""

    def __init__(self, inner: HttpRequest) -> None:
        self.inner = inner


class SubWrapper(Wrapper):
    pass


@pytest.fixture
def registry() -> Any:
    saved = list(adapters.REGISTERED)
    yield adapters
    adapters.REGISTERED[:] = saved
    adapters._BY_CLASS.clear()


def test_the_installed_frameworks_register_one_adapter_each():
    names = [adapter.name for adapter in adapters.REGISTERED]

    assert drf.ADAPTER in adapters.REGISTERED
    assert celery.ADAPTER in adapters.REGISTERED
    assert len(names) == len(set(names))


def test_a_frameworks_request_and_its_subclasses_find_its_adapter(registry):
    inner = RequestFactory().post("/")
    adapter = adapters.Adapter(
        name="wrapping", request_class=Wrapper, django_request=lambda request: request.inner
    )
    registry.register(adapter)

    assert registry.for_request(Wrapper(inner)) is adapter
    assert registry.for_request(SubWrapper(inner)) is adapter
    assert django_request(SubWrapper(inner)) is inner
    assert registry.for_request(inner) is None


def test_a_request_no_framework_claims_is_its_own_django_request():
    request = RequestFactory().post("/")
    unknown = object()

    assert django_request(request) is request
    assert django_request(unknown) is unknown
    assert guard_for(request) is PLAIN


def test_registering_again_replaces_the_adapter_of_that_name(registry):
    first = adapters.Adapter(name="wrapping", request_class=Wrapper, django_request=id)
    second = adapters.Adapter(name="wrapping", request_class=Wrapper, django_request=id)
    registry.register(first)
    registry.for_request(Wrapper(HttpRequest()))  # remembered for its class

    registry.register(second)

    assert [each for each in registry.REGISTERED if each.name == "wrapping"] == [second]
    assert registry.for_request(Wrapper(HttpRequest())) is second


def test_drfs_request_gets_drfs_guard():
    inner = RequestFactory().post("/")
    request = Request(inner)

    guard = guard_for(request)

    assert guard is not PLAIN
    assert guard.answer is drf.error_response
    assert django_request(request) is inner


def test_celerys_control_flow_is_known_through_its_adapter_alone(registry):
    from celery.exceptions import Ignore, SoftTimeLimitExceeded

    from django_idempotency import engine, functions

    ended = functions.VALUES.ended_on_purpose
    assert functions.VALUES.ending(Ignore()) is engine.Ending.COMPLETED
    assert functions.VALUES.ending(SoftTimeLimitExceeded()) is engine.Ending.UNKNOWN
    with pytest.raises(Ignore):
        functions.decode(ended)

    registry.REGISTERED[:] = [each for each in registry.REGISTERED if each is not celery.ADAPTER]

    assert functions.VALUES.ending(Ignore()) is engine.plain_ending(Ignore())
    with pytest.raises(RuntimeError, match="install Celery"):
        functions.decode(ended)


EARLY_APP = """
from django.apps import AppConfig
from django.core.exceptions import ImproperlyConfigured


class EarlyConfig(AppConfig):
    name = "early_app"

    def ready(self):
        # Decorates a view before django_idempotency's ready() has run.
        from rest_framework.decorators import api_view

        from django_idempotency import idempotent

        def create(request):
            return None

        try:
            idempotent(api_view(["POST"])(create))
        except ImproperlyConfigured as exc:
            print("refused:", exc)
        else:
            print("accepted")
"""

EARLY_PROJECT = """
import django
from django.conf import settings
settings.configure(
    INSTALLED_APPS=[
        "django.contrib.contenttypes",
        "django.contrib.auth",
        "rest_framework",
        "early_app",
        "django_idempotency",
    ],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    USE_TZ=True,
)
django.setup()
"""


def test_a_view_decorated_before_the_apps_ready_still_meets_drfs_adapter(tmp_path):
    # An app listed before django_idempotency decorates its views in its
    # own ready(): DRF's placement check must already apply to them.
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "early_app").mkdir()
    (tmp_path / "early_app" / "__init__.py").write_text("")
    (tmp_path / "early_app" / "apps.py").write_text(EARLY_APP)
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])

    result = subprocess.run(
        [sys.executable, "-c", EARLY_PROJECT],
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout, result.stdout
    assert "@api_view" in result.stdout
