"""Django's Tasks framework (``django.tasks``, or the backport on 5.2): the purge, idempotent tasks.

Idempotent tasks run here under the framework's ``ImmediateBackend``, and
in real ``db_worker`` processes of the ``django-tasks-db`` database backend
on the test database: a task enqueued twice with one key, or one result
run twice, runs its effect once.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import django
import pytest
from asgiref.sync import async_to_sync
from django.core.exceptions import ImproperlyConfigured
from django.db import connection

from django_idempotency.exceptions import ArgumentsMismatch
from django_idempotency.models import IdempotencyKey
from tests.factories import IdempotencyKeyFactory
from tests.models import Order
from tests.server import DATABASE_NAME_ENV

ROOT = Path(__file__).resolve().parent.parent

IMMEDIATE = (
    "django.tasks.backends.immediate.ImmediateBackend"
    if django.VERSION >= (6, 0)
    else "django_tasks.backends.immediate.ImmediateBackend"
)


@pytest.fixture
def immediate_tasks(settings):
    settings.TASKS = {"default": {"BACKEND": IMMEDIATE}}
    from django_idempotency.contrib import django_tasks

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

    def test_the_purge_is_enqueued_under_the_path_it_always_had(self, immediate_tasks):
        # A backend that stores tasks (django-tasks-db) stores this path and
        # the worker imports it: a web server and a worker a release apart
        # (the worker not yet upgraded) must agree on it.
        from django.utils.module_loading import import_string

        task = immediate_tasks.purge_expired_keys

        assert task.module_path == "django_idempotency.django_tasks.purge_expired_keys"
        assert import_string(task.module_path) is task
        assert task.func.__qualname__ == "purge_expired_keys"

    def test_enqueued_purge_takes_the_pace_of_the_purge(self, immediate_tasks):
        IdempotencyKeyFactory.create_batch(3, expired=True)

        result = immediate_tasks.purge_expired_keys.enqueue(
            batch_size=2, batch_seconds=None, pause=0, rate=1000
        )

        assert result.status.name == "SUCCESSFUL"
        assert result.return_value == 3
        assert not IdempotencyKey.objects.exists()

    @pytest.mark.parametrize("pace", [{"pause": -1}, {"rate": 0}, {"batch_seconds": 0}])
    def test_out_of_range_pace_fails_the_task_and_deletes_nothing(self, immediate_tasks, pace):
        IdempotencyKeyFactory(expired=True)

        result = immediate_tasks.purge_expired_keys.enqueue(**pace)

        assert result.status.name == "FAILED"
        assert IdempotencyKey.objects.count() == 1

    def test_bad_batch_size_fails_the_task_and_deletes_nothing(self, immediate_tasks):
        IdempotencyKeyFactory(expired=True)

        result = immediate_tasks.purge_expired_keys.enqueue(batch_size=0)

        assert result.status.name == "FAILED"
        assert IdempotencyKey.objects.count() == 1


@pytest.mark.parametrize(
    "module", ["django_idempotency.contrib.django_tasks", "django_idempotency.django_tasks"]
)
def test_without_a_tasks_framework_import_names_the_fix(monkeypatch, module):
    monkeypatch.setitem(sys.modules, "django.tasks", None)
    monkeypatch.setitem(sys.modules, "django_tasks", None)
    monkeypatch.delitem(sys.modules, "django_idempotency.contrib.django_tasks", raising=False)
    monkeypatch.delitem(sys.modules, "django_idempotency.django_tasks", raising=False)

    with pytest.raises(ImproperlyConfigured, match=r"django-idempotency\[tasks\]"):
        importlib.import_module(module)


# Idempotent tasks.


@pytest.fixture
def examples(immediate_tasks: Any) -> Any:
    from tests import django_task_examples

    return django_task_examples


def record_of(task: Any) -> IdempotencyKey:
    return IdempotencyKey.objects.get(scope=task.module_path)


@pytest.mark.django_db(transaction=True)
class IdempotentTaskTests:
    """Under the ImmediateBackend: the framework's own way of running a task, in this process."""

    @pytest.mark.parametrize("name", ["place_order", "place_order_lease"])
    def test_enqueued_twice_with_one_key_is_one_effect(self, examples, name):
        task = getattr(examples, name)

        first = task.enqueue("lamp", quantity=2)
        again = task.enqueue("lamp", 2)

        assert (first.status.name, again.status.name) == ("SUCCESSFUL", "SUCCESSFUL")
        assert first.return_value == again.return_value
        assert first.return_value == {
            "order": Order.objects.get().pk,
            "item": "lamp",
            "quantity": 2,
        }
        record = record_of(task)
        assert (record.key, record.state) == ("order-lamp", IdempotencyKey.State.COMPLETED)

    def test_is_a_task_of_the_framework_found_by_its_dotted_name(self, examples):
        expected = "django.tasks" if django.VERSION >= (6, 0) else "django_tasks"
        assert type(examples.place_order).__module__.startswith(expected)
        assert examples.place_order.module_path == "tests.django_task_examples.place_order"
        assert examples.place_order.name == "place_order"
        assert examples.with_context.priority == 10

    def test_key_defaults_to_the_result_id(self, examples):
        first = examples.by_result_id.enqueue("desk")
        second = examples.by_result_id.enqueue("desk")

        # Two enqueues are two pieces of work; each result is its own key.
        assert Order.objects.count() == 2
        keys = set(IdempotencyKey.objects.values_list("key", flat=True))
        assert keys == {str(first.id), str(second.id)}

    def test_same_key_with_other_arguments_fails_and_changes_nothing(self, examples):
        examples.place_order.enqueue("chair", quantity=1)
        record = record_of(examples.place_order)

        other = examples.place_order.enqueue("chair", quantity=5)

        assert other.status.name == "FAILED"
        assert other.errors[0].exception_class is ArgumentsMismatch
        assert list(Order.objects.values_list("quantity", flat=True)) == [1]
        assert record_of(examples.place_order).fingerprint == record.fingerprint

    def test_context_is_passed_when_the_task_takes_it(self, examples):
        result = examples.with_context.enqueue("bench")

        assert result.status.name == "SUCCESSFUL"
        assert result.return_value["result"] == str(result.id)
        assert result.return_value["item"] == "bench"
        again = examples.with_context.enqueue("bench")
        assert again.return_value == result.return_value  # the first run's, context and all

    def test_async_task(self, examples):
        first = examples.async_order.enqueue("rug")
        again = examples.async_order.enqueue("rug")

        assert first.status.name == again.status.name == "SUCCESSFUL"
        assert first.return_value == again.return_value == {"order": Order.objects.get().pk}

    def test_failed_task_stores_nothing_and_runs_again(self, examples):
        first = examples.failing.enqueue("vase")
        again = examples.failing.enqueue("vase")

        assert (first.status.name, again.status.name) == ("FAILED", "FAILED")
        assert not Order.objects.exists()
        assert not IdempotencyKey.objects.exists()

    def test_celerys_ignore_is_a_failure_here(self, examples):
        first = examples.stops_as_celery_would.enqueue("vase")
        again = examples.stops_as_celery_would.enqueue("vase")

        assert (first.status.name, again.status.name) == ("FAILED", "FAILED")
        assert not Order.objects.exists()
        assert not IdempotencyKey.objects.exists()

    @pytest.mark.parametrize("name", ["place_order", "place_order_lease"])
    def test_called_in_this_thread_it_is_one_effect_with_the_enqueued(self, examples, name):
        # Task.call() passes the framework's context only to a function that takes it.
        task = getattr(examples, name)

        enqueued = task.enqueue("lamp", quantity=2)
        called = task.call("lamp", 2)
        again = task.call("lamp", quantity=2)

        assert called == again == enqueued.return_value
        assert Order.objects.count() == 1
        assert record_of(task).key == "order-lamp"

    def test_an_async_task_called_in_this_thread_is_one_effect(self, examples):
        first = examples.async_order.call("rug")
        again = async_to_sync(examples.async_order.acall)("rug")

        assert first == again == {"order": Order.objects.get().pk}

    def test_a_task_that_takes_its_context_is_called_with_the_callers(self, examples):
        enqueued = examples.with_context.enqueue("bench")
        context = SimpleNamespace(attempt=1, task_result=enqueued)

        assert examples.with_context.call(context, "bench") == enqueued.return_value
        assert examples.with_context.call(context=context, name="bench") == enqueued.return_value
        assert Order.objects.count() == 1

    def test_called_without_a_context_to_key_by_it_names_the_fix(self, examples):
        with pytest.raises(TypeError, match=r"no result id to take its key from.*key="):
            examples.by_result_id.call("desk")
        assert not Order.objects.exists()
        assert not IdempotencyKey.objects.exists()

    def test_disabled_runs_every_time(self, examples, settings):
        settings.IDEMPOTENCY = {"ENABLED": False}
        examples.place_order.enqueue("lamp")
        examples.place_order.enqueue("lamp")
        assert Order.objects.count() == 2


class IdempotentTaskDefinitionTests:
    def test_key_that_is_not_callable_fails_at_definition(self, immediate_tasks):
        with pytest.raises(TypeError, match="must be a callable of the task's arguments"):
            immediate_tasks.idempotent_task(key="order-{name}")

    def test_bad_option_fails_at_definition(self, immediate_tasks):
        with pytest.raises(ImproperlyConfigured, match=r"idempotent_task\(ttl=\.\.\.\)"):
            immediate_tasks.idempotent_task(ttl=-5)

    def test_recover_is_taken_and_checked_at_definition(self, immediate_tasks):
        with pytest.raises(
            TypeError, match=r"idempotent_task\(recover=\.\.\.\) must be a callable"
        ):
            immediate_tasks.idempotent_task(key=lambda name: name, recover="hold")
        # A callable is an idempotent_function's policy, as for Celery's tasks.
        assert immediate_tasks.idempotent_task(key=lambda name: name, recover=lambda a: None)

    def test_used_on_a_task_it_says_to_replace_task(self, immediate_tasks):
        with pytest.raises(TypeError, match="in place of @task"):
            immediate_tasks.idempotent_task(immediate_tasks.purge_expired_keys)

    def test_a_function_not_at_module_level_is_refused_by_the_framework(self, immediate_tasks):
        def local(name: str) -> None: ...

        with pytest.raises(Exception, match="module level"):
            immediate_tasks.idempotent_task(local)


# The database backend's worker.

WORKER_SETTINGS = "tests.django_tasks_settings"


@pytest.fixture(scope="module")
def task_env(
    django_db_setup: None, django_db_blocker: Any, tmp_path_factory: Any
) -> dict[str, Any]:
    """The environment of the worker processes; the backend's tables made on the test database."""
    pytest.importorskip("django_tasks_db", reason="the database backend is django-tasks-db's")
    with django_db_blocker.unblock():
        name = str(connection.settings_dict["NAME"])
    from tests.django_task_examples import RUNS_DIR_ENV

    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": WORKER_SETTINGS,
        DATABASE_NAME_ENV: name,
        RUNS_DIR_ENV: str(tmp_path_factory.mktemp("task-runs")),
    }
    django_admin(env, "migrate", "django_tasks_database", "--noinput", "-v", "0")
    return env


def django_admin(env: dict[str, Any], *arguments: str) -> str:
    completed = subprocess.run(
        [sys.executable, "-m", "django", *arguments],
        env=env,
        cwd=ROOT,
        capture_output=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr.decode()[-3000:]
    return completed.stdout.decode()


def examples_command(env: dict[str, Any], *arguments: str) -> Any:
    completed = subprocess.run(
        [sys.executable, "-m", "tests.django_task_results", *arguments],
        env=env,
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stderr.decode()[-3000:]
    output = completed.stdout.decode().strip()
    return json.loads(output) if output else None


def run_workers(env: dict[str, Any], count: int, *, hold: float = 0) -> None:
    """``db_worker --batch`` processes at once, until no task is left to run."""
    from tests.django_task_examples import HOLD_ENV

    command = [sys.executable, "-m", "django", "db_worker", "--batch", "--interval", "0.05"]
    command += ["--no-startup-delay", "--no-reload"]
    workers = [
        subprocess.Popen(
            [*command, "--worker-id", f"worker-{index}"],
            env={**env, HOLD_ENV: str(hold)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for index in range(count)
    ]
    for worker in workers:
        output, _ = worker.communicate(timeout=120)
        assert worker.returncode == 0, output.decode()[-3000:]


def runs(env: dict[str, Any], name: str) -> int:
    from tests.django_task_examples import RUNS_DIR_ENV

    path = Path(env[RUNS_DIR_ENV]) / f"{name}.runs"
    return path.read_text().count("\n") if path.exists() else 0


@pytest.fixture
def unique_name() -> Iterator[str]:
    yield f"item-{uuid.uuid4().hex[:8]}"


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
class DatabaseWorkerTests:
    """Real ``db_worker`` processes of ``django-tasks-db`` on the test database."""

    @pytest.mark.parametrize("task", ["place_order", "place_order_lease"])
    def test_enqueued_twice_with_one_key_runs_its_effect_once(self, task_env, task, unique_name):
        ids = [examples_command(task_env, "enqueue", task, unique_name)["id"] for _ in range(2)]

        # Two workers take one result each and run them at the same time.
        run_workers(task_env, 2, hold=1.0)

        results = examples_command(task_env, "results", *ids)
        assert runs(task_env, unique_name) == 1
        assert list(Order.objects.values_list("item", flat=True)) == [unique_name]
        value = {"order": Order.objects.get().pk, "item": unique_name, "quantity": 1}
        for result in results:
            if task == "place_order" or result["status"] == "SUCCESSFUL":
                # Atomic mode: the duplicate waited for the original, then got its value.
                assert result == {"status": "SUCCESSFUL", "return_value": value, "error": None}
            else:
                # Lease mode: a duplicate that met the original in flight fails, changing nothing.
                assert result["error"] == "django_idempotency.exceptions.CallInFlight"
        assert any(result["status"] == "SUCCESSFUL" for result in results)

    def test_a_result_run_again_runs_its_effect_once(self, task_env, unique_name):
        [result_id] = [examples_command(task_env, "enqueue", "by_result_id", unique_name)["id"]]
        run_workers(task_env, 1)
        [first] = examples_command(task_env, "results", result_id)

        # As after a worker died with the result still RUNNING: put back and run again.
        examples_command(task_env, "requeue", result_id)
        run_workers(task_env, 1)

        [again] = examples_command(task_env, "results", result_id)
        assert first["status"] == again["status"] == "SUCCESSFUL"
        assert again["return_value"] == first["return_value"]
        assert runs(task_env, unique_name) == 1
        assert Order.objects.count() == 1
        assert IdempotencyKey.objects.get().key == result_id
