"""The Celery task, run by a real worker over a real broker, and its schedule."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import kombu
import pytest
import redis
from celery import Celery, current_app
from celery.beat import Scheduler
from celery.exceptions import TimeoutError as CeleryTimeoutError
from django.db import connection

from django_idempotency.models import IdempotencyKey
from django_idempotency.tasks import purge_expired_keys
from tests import celery_app
from tests.factories import IdempotencyKeyFactory

REPO = Path(__file__).resolve().parent.parent
REDIS_URL = "redis://127.0.0.1:6379/0"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
TASK_NAME = "django_idempotency.tasks.purge_expired_keys"
RESULT_TIMEOUT = 60.0


def _redis_up(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=2).ping())
    except redis.RedisError:
        return False


def _amqp_up(url: str) -> bool:
    try:
        with kombu.Connection(url, connect_timeout=2) as conn:
            conn.connect()
        return True
    except Exception:
        return False


def find_broker() -> str:
    """Redis on 127.0.0.1, else RabbitMQ; no broker at all is a failure, not a skip."""
    explicit = os.environ.get("TEST_CELERY_BROKER_URL")
    candidates = [explicit] if explicit else [REDIS_URL, AMQP_URL]
    for url in candidates:
        up = _redis_up(url) if url.startswith("redis") else _amqp_up(url)
        if up:
            return url
    pytest.fail(
        f"No Celery broker reachable (tried {', '.join(candidates)}). Start Redis or "
        "RabbitMQ on 127.0.0.1, or set TEST_CELERY_BROKER_URL.",
        pytrace=False,
    )


@dataclass
class Worker:
    process: subprocess.Popen
    log: Path

    def wait_for(self, result) -> object:  # type: ignore[no-untyped-def]
        """The task's return value, failing fast if the worker died."""
        deadline = time.monotonic() + RESULT_TIMEOUT
        while True:
            try:
                return result.get(timeout=1)
            except CeleryTimeoutError:
                if self.process.poll() is not None:
                    pytest.fail(f"The Celery worker exited:\n{self.log.read_text()}")
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"No result within {RESULT_TIMEOUT}s. Worker log:\n{self.log.read_text()}"
                    )


@pytest.fixture(scope="module")
def celery_worker(django_db_setup, tmp_path_factory) -> Iterator[Worker]:
    """A real ``celery worker`` process on the test database pytest-django created."""
    broker = find_broker()
    queue = f"django-idempotency-tests-{uuid.uuid4().hex}"
    previous_app = current_app._get_current_object()
    celery_app.make_app(broker, queue).set_current()
    log = tmp_path_factory.mktemp("celery") / "worker.log"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.celery_settings",
        "IDEMPOTENCY_TEST_DATABASE_NAME": str(connection.settings_dict["NAME"]),
        celery_app.BROKER_ENV: broker,
        celery_app.QUEUE_ENV: queue,
    }
    with log.open("w") as output:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "tests.celery_app",
                "worker",
                "--pool=solo",
                "--concurrency=1",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "--loglevel=INFO",
                "-n",
                f"{queue}@%h",
            ],
            cwd=REPO,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        yield Worker(process, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        previous_app.set_current()


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
