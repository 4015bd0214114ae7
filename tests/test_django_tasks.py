"""The purge as a Django Tasks framework task (``django.tasks``, or the backport on 5.2)."""

from __future__ import annotations

import importlib
import sys

import django
import pytest
from django.core.exceptions import ImproperlyConfigured

from django_idempotency.models import IdempotencyKey
from tests.factories import IdempotencyKeyFactory

IMMEDIATE = (
    "django.tasks.backends.immediate.ImmediateBackend"
    if django.VERSION >= (6, 0)
    else "django_tasks.backends.immediate.ImmediateBackend"
)


@pytest.fixture
def immediate_tasks(settings):
    settings.TASKS = {"default": {"BACKEND": IMMEDIATE}}
    from django_idempotency import django_tasks

    return django_tasks


@pytest.mark.django_db
class PurgeTaskTests:
    def test_enqueued_purge_deletes_only_expired_records(self, immediate_tasks):
        IdempotencyKeyFactory.create_batch(3, expired=True)
        live = IdempotencyKeyFactory()

        result = immediate_tasks.purge_expired_keys.enqueue(batch_size=2)

        assert result.status.name == "SUCCESSFUL"
        assert result.return_value == 3
        assert list(IdempotencyKey.objects.values_list("pk", flat=True)) == [live.pk]

    def test_uses_the_framework_django_provides(self, immediate_tasks):
        task = immediate_tasks.purge_expired_keys
        expected = "django.tasks" if django.VERSION >= (6, 0) else "django_tasks"
        assert type(task).__module__.startswith(expected)
        assert task.module_path == "django_idempotency.django_tasks.purge_expired_keys"

    def test_bad_batch_size_fails_the_task_and_deletes_nothing(self, immediate_tasks):
        IdempotencyKeyFactory(expired=True)

        result = immediate_tasks.purge_expired_keys.enqueue(batch_size=0)

        assert result.status.name == "FAILED"
        assert IdempotencyKey.objects.count() == 1


def test_without_a_tasks_framework_import_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "django.tasks", None)
    monkeypatch.setitem(sys.modules, "django_tasks", None)
    monkeypatch.delitem(sys.modules, "django_idempotency.django_tasks", raising=False)

    with pytest.raises(ImproperlyConfigured, match=r"django-idempotency\[tasks\]"):
        importlib.import_module("django_idempotency.django_tasks")
