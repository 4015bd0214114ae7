"""The Celery task, run by a real worker over a real broker, and its schedule."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from celery import Celery
from celery.beat import Scheduler
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connection

from django_idempotency.models import IdempotencyKey
from django_idempotency.tasks import purge_expired_keys
from tests.celery_worker import WorkerProcess, find_broker, new_worker, publishing_to
from tests.factories import IdempotencyKeyFactory

REPO = Path(__file__).resolve().parent.parent
TASK_NAME = "django_idempotency.tasks.purge_expired_keys"
RESULT_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def celery_worker(django_db_setup, tmp_path_factory) -> Iterator[WorkerProcess]:
    """A real ``celery worker`` process on the test database pytest-django created."""
    worker = new_worker(
        find_broker(),
        str(connection.settings_dict["NAME"]),
        tmp_path_factory.mktemp("celery"),
        pool="solo",
        concurrency=1,
        result_timeout=RESULT_TIMEOUT,
    )
    with publishing_to(worker):
        yield worker.start()


@pytest.mark.django_db(transaction=True)
class WorkerTests:
    def test_worker_purges_expired_records(self, celery_worker):
        live = {
            IdempotencyKeyFactory().pk,
            IdempotencyKeyFactory(in_flight=True).pk,
        }
        IdempotencyKeyFactory.create_batch(3, expired=True)
        IdempotencyKeyFactory.create_batch(2, lease_expired=True)

        result = purge_expired_keys.delay(batch_size=2)

        assert celery_worker.wait_for(result) == 5
        assert set(IdempotencyKey.objects.values_list("pk", flat=True)) == live

    def test_worker_with_nothing_expired_returns_zero(self, celery_worker):
        record = IdempotencyKeyFactory()

        result = purge_expired_keys.delay()

        assert celery_worker.wait_for(result) == 0
        assert list(IdempotencyKey.objects.values_list("pk", flat=True)) == [record.pk]

    def test_worker_reports_an_unknown_database_as_improperly_configured(self, celery_worker):
        result = purge_expired_keys.delay(database="nowhere")

        with pytest.raises(ImproperlyConfigured, match="Unknown database 'nowhere'"):
            celery_worker.wait_for(result)


@pytest.mark.django_db
class TaskTests:
    def test_task_is_registered_under_its_documented_name(self):
        assert purge_expired_keys.name == TASK_NAME

    def test_apply_runs_the_purge(self):
        kept = IdempotencyKeyFactory()
        IdempotencyKeyFactory.create_batch(3, expired=True)

        result = purge_expired_keys.apply(kwargs={"batch_size": 2, "database": "default"})

        assert result.get() == 3
        assert list(IdempotencyKey.objects.values_list("pk", flat=True)) == [kept.pk]

    def test_unknown_database_is_improperly_configured_as_documented(self):
        result = purge_expired_keys.apply(kwargs={"database": "nowhere"})

        assert result.failed()
        # docs/purge.rst: each error is a DatabaseError or ImproperlyConfigured.
        assert isinstance(result.result, ImproperlyConfigured | DatabaseError)
        assert isinstance(result.result, ImproperlyConfigured)
        assert str(result.result) == (
            "Unknown database 'nowhere': The connection 'nowhere' doesn't exist."
        )


class BeatScheduleTests:
    def test_example_schedule_names_a_registered_task(self):
        from example_project import settings as example_settings

        app = Celery("schedule-check", set_as_current=False)
        app.config_from_object(example_settings, namespace="CELERY")
        scheduler = Scheduler(app=app, lazy=True)
        scheduler.update_from_dict(app.conf.beat_schedule)

        entry = scheduler.schedule["purge-idempotency-keys"]
        assert entry.task == TASK_NAME
        assert entry.task in app.tasks
        assert entry.schedule.run_every == timedelta(hours=1)

    @pytest.mark.django_db  # Celery's Django fix-up may touch the database on import
    def test_example_celery_app_discovers_the_task(self):
        from example_project import celery_app as example_app

        example_app.loader.import_default_modules()
        assert example_app.main == "example_project"
        assert TASK_NAME in example_app.tasks


def _example_check(extra_env: dict[str, str], prelude: str = "") -> subprocess.CompletedProcess:
    code = (
        f"{prelude}"
        "import sys\n"
        "from django.core.management import execute_from_command_line\n"
        "execute_from_command_line(['manage.py', 'check'])\n"
        "import example_project\n"
        "print('celery_app', example_project.celery_app)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "example_project.settings", **extra_env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_example_project_runs_without_a_broker():
    # Nothing listens on port 1: defining the app must not connect.
    result = _example_check({"CELERY_BROKER_URL": "redis://127.0.0.1:1/0"})

    assert result.returncode == 0, result.stderr
    assert "celery_app <Celery example_project" in result.stdout


def test_example_project_runs_without_celery_installed():
    result = _example_check({}, prelude="import sys\nsys.modules['celery'] = None\n")

    assert result.returncode == 0, result.stderr
    assert "celery_app None" in result.stdout
