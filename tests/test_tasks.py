"""Celery (tasks.py): the purge task and idempotent tasks, in process with
``.apply()`` and on real workers over a real broker.

The purge runs on a solo worker; the idempotent-task worker tests run a
prefork worker with 4 processes on the suite's database and a real broker
(Redis, else RabbitMQ). The crash tests ``kill -9`` a worker while a body
holds its transaction (or its lease) open, start a new one, and count the
effects of the redelivered message.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from celery import Celery, shared_task
from celery.beat import Scheduler
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connection, connections
from django.test import override_settings
from django.utils import timezone

from django_idempotency import clock as database_clock
from django_idempotency import signals
from django_idempotency.contrib.celery import idempotent_task, purge_expired_keys
from django_idempotency.exceptions import TaskArgumentsMismatch, TaskInFlight, UnstorableResult
from django_idempotency.models import IdempotencyKey
from django_idempotency.purge import purge_expired
from tests import tasks
from tests.celery_worker import (
    WorkerProcess,
    find_broker,
    new_worker,
    publishing_to,
    running_worker,
)
from tests.factories import IdempotencyKeyFactory
from tests.models import Order, RemoteCharge
from tests.polling import wait_until
from tests.tasks import (
    charge_and_hold,
    charge_then_fail,
    count_down,
    count_down_lease,
    count_down_noting,
    end_of_chain,
    fail_next_run,
    flaky_lease_order,
    flaky_order,
    hand_over,
    hold_order,
    lease_order,
    lose_connection,
    outlive_soft_limit,
    place_order,
    place_other_order,
    plain_stop_in_a_function,
    poll_under_one_key,
    slow_order,
    stop_in_a_function,
    stop_once,
    unstorable_lease_charge,
    unstorable_order,
    walk_tree,
)

REPO = Path(__file__).resolve().parent.parent
TASK_NAME = "django_idempotency.tasks.purge_expired_keys"
RESULT_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def celery_worker(django_db_setup, tmp_path_factory) -> Iterator[WorkerProcess]:
    """A real ``celery worker`` process on the test database pytest-django created."""
    directory = tmp_path_factory.mktemp("celery")
    options = {"pool": "solo", "concurrency": 1, "result_timeout": RESULT_TIMEOUT}
    with running_worker(directory, **options) as worker:
        yield worker


@pytest.mark.django_db(transaction=True)
class PurgeWorkerTests:
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

    def test_apply_takes_the_pace_of_the_purge(self):
        kept = IdempotencyKeyFactory()
        IdempotencyKeyFactory.create_batch(3, expired=True)

        result = purge_expired_keys.apply(
            kwargs={"batch_size": 2, "batch_seconds": None, "pause": 0, "rate": 1000}
        )

        assert result.get() == 3
        assert list(IdempotencyKey.objects.values_list("pk", flat=True)) == [kept.pk]

    def test_out_of_range_pace_fails_the_task_and_deletes_nothing(self):
        IdempotencyKeyFactory(expired=True)

        result = purge_expired_keys.apply(kwargs={"pause": -1})

        assert result.failed()
        assert isinstance(result.result, ValueError)
        assert "pause must be a number of batch durations, 0 or more" in str(result.result)
        assert IdempotencyKey.objects.count() == 1

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


#: A project without Celery in INSTALLED_APPS or its settings: the app alone.
BARE_PROJECT = """
import sys
import django
from django.conf import settings
settings.configure(
    INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "django_idempotency"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    USE_TZ=True,
)
django.setup()
from django.core.management import call_command
call_command("check")
"""

#: Makes ``import celery`` find a namespace package (a ``celery/`` directory
#: without ``__init__.py``), which has none of Celery's names.
CELERY_AS_NAMESPACE = """
import importlib.machinery, sys
class NamespaceCelery:
    def find_spec(self, name, path=None, target=None):
        if name != "celery":
            return None
        spec = importlib.machinery.ModuleSpec("celery", None, is_package=True)
        spec.submodule_search_locations = [{directory!r}]
        return spec
sys.meta_path.insert(0, NamespaceCelery())
"""


def _bare_project(code: str, prelude: str = "", **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", prelude + BARE_PROJECT + code],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


LOADED = "print('loaded', sorted(m for m in ('celery', 'kombu', 'billiard') if m in sys.modules))\n"


def test_start_up_does_not_import_celery():
    # Celery is installed here, but a project that does not use it never pays for importing it.
    result = _bare_project(LOADED)

    assert result.returncode == 0, result.stderr
    assert "loaded []" in result.stdout


def test_start_up_works_with_a_celery_namespace_directory(tmp_path):
    (tmp_path / "celery").mkdir()

    result = _bare_project(LOADED, prelude=CELERY_AS_NAMESPACE.format(directory=str(tmp_path)))

    assert result.returncode == 0, result.stderr
    assert "System check identified no issues" in result.stdout


def test_start_up_works_with_a_broken_celery_install(tmp_path):
    (tmp_path / "celery").mkdir()
    (tmp_path / "celery" / "__init__.py").write_text("raise ImportError('half uninstalled')\n")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])

    result = _bare_project(LOADED, PYTHONPATH=path)

    assert result.returncode == 0, result.stderr
    assert "System check identified no issues" in result.stdout


def test_celerys_control_flow_is_known_once_celery_is_in_use():
    # Nothing imported Celery's integration: Celery's own exceptions, once
    # raised, are enough for a body that ends with them to count as ended on purpose.
    result = _bare_project(
        "from django_idempotency import engine, functions\n"
        "assert 'django_idempotency.contrib.celery' not in sys.modules\n"
        "from celery.exceptions import Ignore, SoftTimeLimitExceeded\n"
        "assert functions.VALUES.ending(Ignore()) is engine.Ending.COMPLETED\n"
        "assert functions.VALUES.ending(SoftTimeLimitExceeded()) is engine.Ending.UNKNOWN\n"
        "print('known')\n"
    )

    assert result.returncode == 0, result.stderr
    assert "known" in result.stdout


def test_a_call_whose_first_ended_on_purpose_ends_so_where_celery_was_not_loaded():
    result = _bare_project(
        "from django_idempotency import functions\n"
        "try:\n"
        "    functions.decode(functions.VALUES.ended_on_purpose)\n"
        "except BaseException as exc:\n"
        "    print('raised', type(exc).__module__, type(exc).__name__)\n"
    )

    assert result.returncode == 0, result.stderr
    assert "raised celery.exceptions Ignore" in result.stdout


STORM_KEYS = 100
STORM_PUBLISHES = 10


def _record(task_name: str) -> IdempotencyKey:
    return IdempotencyKey.objects.get(scope=task_name)


# In process: .apply() runs the task with an id, as a worker would.


@pytest.mark.django_db
class ApplyTests:
    def test_redelivered_task_id_replays_the_stored_value(self):
        first = hold_order.apply(args=["a"], task_id="task-1")
        again = hold_order.apply(args=["a"], task_id="task-1")

        assert first.get() == again.get() == {"order": Order.objects.get().pk}
        record = _record(hold_order.name)
        assert (record.key, record.state) == ("task-1", IdempotencyKey.State.COMPLETED)

    def test_signals_are_sent_with_the_function_and_no_request(self):
        sent = []

        def receiver(signal, sender, request, idempotency, **kwargs):  # type: ignore[no-untyped-def]
            sent.append((signal, f"{sender.__module__}.{sender.__qualname__}", request))

        watched = [signals.key_claimed, signals.response_stored, signals.response_replayed]
        for signal in watched:
            signal.connect(receiver)
        try:
            place_order.apply(args=["signalled"])
            place_order.apply(args=["signalled"])
        finally:
            for signal in watched:
                signal.disconnect(receiver)

        # The task's own function, as in the log records' idempotency_view.
        assert sent == [(signal, "tests.tasks.place_order", None) for signal in watched]

    def test_new_task_id_is_new_work_by_default(self):
        hold_order.apply(args=["a"], task_id="task-1")
        hold_order.apply(args=["a"], task_id="task-2")

        assert Order.objects.count() == 2

    def test_key_function_makes_two_publishes_one_effect(self):
        first = place_order.apply(args=["book"])
        second = place_order.apply(args=["book"], kwargs={"pause": 0})

        assert first.id != second.id
        assert first.get() == second.get() == {"label": "book", "order": Order.objects.get().pk}
        assert _record(place_order.name).key == "order-book"

    def test_equal_keys_of_different_tasks_never_meet(self):
        place_order.apply(args=["x"])
        place_other_order.apply(args=["x"])

        assert Order.objects.count() == 2
        records = IdempotencyKey.objects.values_list("scope", "key")
        assert sorted(records) == [
            (place_order.name, "order-x"),
            (place_other_order.name, "order-x"),
        ]

    def test_arguments_are_canonicalised_like_json_bodies(self):
        place_order.apply(args=["book"], kwargs={"pause": 0})
        place_order.apply(args=["book"], kwargs={"pause": 0.0})
        place_order.apply(args=["book", 0])
        place_order.apply(kwargs={"label": "book"})

        assert Order.objects.count() == 1

    def test_bound_task_is_not_an_argument(self):
        first = charge_and_hold.apply(args=["bound"], task_id="bound-1")
        again = charge_and_hold.apply(kwargs={"label": "bound"}, task_id="bound-1")

        assert again.get() == first.get()
        assert RemoteCharge.objects.count() == 1

    def test_same_key_with_other_arguments_fails_and_changes_nothing(self):
        place_order.apply(args=["book"])
        before = IdempotencyKey.objects.values().get()

        result = place_order.apply(args=["book"], kwargs={"pause": 0.01})

        assert result.failed()
        assert isinstance(result.result, TaskArgumentsMismatch)
        assert "different arguments" in str(result.result)
        assert IdempotencyKey.objects.values().get() == before
        assert Order.objects.count() == 1

    def test_unstorable_return_value_fails_before_anything_commits(self):
        result = unstorable_order.apply(args=["u"])

        assert result.failed()
        assert isinstance(result.result, UnstorableResult)
        assert "cannot be stored as JSON" in str(result.result)
        assert Order.objects.count() == 0
        assert IdempotencyKey.objects.count() == 0

    def test_lease_mode_stores_the_value_and_passes_derive_to_the_body(self):
        first = charge_and_hold.apply(args=["lease"], task_id="lease-1")
        again = charge_and_hold.apply(args=["lease"], task_id="lease-1")

        value = first.get()
        assert again.get() == value
        assert RemoteCharge.objects.get().reference == value["reference"]
        record = _record(charge_and_hold.name)
        assert record.state == IdempotencyKey.State.COMPLETED
        assert record.locked_until is None
        assert record.expires_at > timezone.now() + timedelta(hours=23)

    def test_lease_mode_in_flight_duplicate_is_retried_later(self):
        charge_and_hold.apply(args=["lease"], task_id="lease-1")
        IdempotencyKey.objects.update(
            state=IdempotencyKey.State.IN_PROGRESS,
            created_at=timezone.now() - timedelta(seconds=10),
            locked_until=timezone.now() + timedelta(seconds=30),
            expires_at=timezone.now() + timedelta(seconds=30),
        )

        result = charge_and_hold.apply(args=["lease"], task_id="lease-1")

        # .apply() cannot schedule a retry, so it shows the reason instead:
        # come back after about as long as the original has run (10 s), not
        # the rest of its lease (30 s).
        assert isinstance(result.result, TaskInFlight)
        assert 10 <= result.result.retry_after <= 12
        assert RemoteCharge.objects.count() == 1

    def test_a_task_replacing_itself_eagerly_runs_each_step_once(self):
        # apply() runs the replacement in place, under the same id: as part
        # of the replaced run, inside its claim.
        result = count_down.apply(args=["eager", 2])

        assert result.get() == {"done": "eager"}
        assert sorted(Order.objects.values_list("item", flat=True)) == [
            "eager-0",
            "eager-1",
            "eager-2",
        ]
        assert _record(count_down.name).key == result.id

    def test_a_message_that_ended_on_purpose_ends_so_when_sent_again(self):
        # Not a success: no result stored for it, no chain continued after it.
        first = stop_once.apply(args=["stop"], task_id="message-1")
        again = stop_once.apply(args=["stop"], task_id="message-1")

        assert (first.state, again.state) == ("IGNORED", "IGNORED")
        assert Order.objects.filter(item="stop").count() == 1
        record = _record(stop_once.name)
        assert (record.state, record.status_code) == (IdempotencyKey.State.COMPLETED, 204)

    def test_a_task_whose_function_ended_on_purpose_ends_so_when_sent_again(self):
        # What follows the call in the task never ran the first time: a
        # redelivered message must not run it now, with the call's None.
        first = plain_stop_in_a_function.apply(args=["again"], task_id="message-2")
        again = plain_stop_in_a_function.apply(args=["again"], task_id="message-2")

        assert (first.state, again.state) == ("IGNORED", "IGNORED")
        assert Order.objects.filter(item="again").count() == 1

    def test_an_eager_replacement_runs_with_the_replaced_runs_idempotency(self):
        result = count_down_noting.apply(args=["noted", 2])

        assert result.get() == {"done": "noted", "key": result.id}
        record = _record(count_down_noting.name)
        assert set(record.checkpoints) == {"step-2", "step-1", "step-0"}

    def test_called_directly_without_an_id_runs_unprotected(self):
        assert hold_order("direct") == {"order": Order.objects.get().pk}
        assert IdempotencyKey.objects.count() == 0

    def test_called_directly_with_a_key_function_is_protected(self):
        place_order("direct")
        place_order("direct")

        assert Order.objects.count() == 1

    def test_disabled_runs_every_time(self):
        with override_settings(IDEMPOTENCY={"ENABLED": False}):
            place_order.apply(args=["off"])
            place_order.apply(args=["off"])

        assert Order.objects.count() == 2
        assert IdempotencyKey.objects.count() == 0

    def test_purge_deletes_expired_task_records(self):
        place_order.apply(args=["old"])
        hold_order.apply(args=["new"])
        IdempotencyKey.objects.filter(key="order-old").update(
            expires_at=timezone.now() - timedelta(seconds=1)
        )

        assert purge_expired() == 1
        assert list(IdempotencyKey.objects.values_list("scope", flat=True)) == [hold_order.name]

    def test_admin_lists_task_records(self, admin_client, settings):
        settings.ROOT_URLCONF = "tests.test_admin"  # the admin's URLconf
        place_order.apply(args=["listed"])

        response = admin_client.get("/admin/django_idempotency/idempotencykey/")

        assert response.status_code == 200
        assert place_order.name in response.content.decode()


@pytest.fixture
def refused_updates() -> Iterator[None]:
    """Make the database refuse every update of the key table, as a failing store would."""
    table = IdempotencyKey._meta.db_table
    statements = {
        "postgresql": (
            [
                "CREATE FUNCTION refuse_update() RETURNS trigger AS "
                "$$ BEGIN RAISE EXCEPTION 'update refused'; END $$ LANGUAGE plpgsql",
                f"CREATE TRIGGER refuse_update BEFORE UPDATE ON {table} "
                "FOR EACH ROW EXECUTE FUNCTION refuse_update()",
            ],
            [f"DROP TRIGGER refuse_update ON {table}", "DROP FUNCTION refuse_update()"],
        ),
        "mysql": (
            [
                f"CREATE TRIGGER refuse_update BEFORE UPDATE ON {table} FOR EACH ROW "
                "SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'update refused'"
            ],
            ["DROP TRIGGER refuse_update"],
        ),
        "sqlite": (
            [
                f"CREATE TRIGGER refuse_update BEFORE UPDATE ON {table} "
                "BEGIN SELECT RAISE(ABORT, 'update refused'); END"
            ],
            ["DROP TRIGGER refuse_update"],
        ),
    }
    create, drop = statements[connection.vendor]
    with connection.cursor() as cursor:
        for statement in create:
            cursor.execute(statement)
    yield
    connection.close()  # it may be the one a test killed
    with connections["default"].cursor() as cursor:
        for statement in drop:
            cursor.execute(statement)


server_only = pytest.mark.skipif(
    connection.vendor == "sqlite", reason="a server-side connection to kill"
)


@pytest.fixture
def no_leftover_flags() -> Iterator[None]:
    yield
    lose_connection.clear()
    fail_next_run.clear()


@pytest.mark.django_db(transaction=True)
class ReleasedClaimTests:
    """Lease mode: a claim given back with checkpoints stays bound to the call that made them."""

    @pytest.fixture(autouse=True)
    def no_failures_left(self) -> Iterator[None]:
        yield
        tasks.fail_after_charging.clear()

    def test_other_arguments_fail_and_the_same_call_resumes(self):
        tasks.fail_after_charging.append(True)
        failed = charge_then_fail.apply(args=["a", 10])
        assert failed.failed() and isinstance(failed.result, RuntimeError)
        before = IdempotencyKey.objects.values().get()
        assert (before["owner_token"], set(before["checkpoints"])) == ("", {"charged"})

        other = charge_then_fail.apply(args=["a", 99])

        assert other.failed()
        assert isinstance(other.result, TaskArgumentsMismatch)
        assert IdempotencyKey.objects.values().get() == before
        assert charge_then_fail.apply(args=["a", 10]).get() == {
            "amount": 10,
            "resumed": ["charged"],
        }
        assert RemoteCharge.objects.count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("no_leftover_flags")
class LeaseAfterTheBodyTests:
    """Lease mode once the body has run: its effect is done, so the key is never released."""

    key = "lease-order-once"

    def orders(self) -> int:
        return Order.objects.filter(item="once").count()

    @pytest.mark.usefixtures("refused_updates")
    def test_result_that_cannot_be_stored_keeps_the_key_claimed(self, caplog):
        with caplog.at_level(logging.ERROR, "django_idempotency"):
            first = lease_order.apply(args=["once"])

        assert first.get() == {"order": Order.objects.get().pk}
        # Nor can a refusal be written (every UPDATE is refused): the lease keeps it.
        assert _record(lease_order.name).state == IdempotencyKey.State.IN_PROGRESS
        assert "could not be stored" in caplog.text
        assert self.key not in caplog.text
        redelivered = lease_order.apply(args=["once"])
        assert isinstance(redelivered.result, TaskInFlight)
        assert self.orders() == 1

    def test_unstorable_value_completes_the_key_with_a_refusal(self):
        first = lease_order.apply(args=["once"], kwargs={"unstorable": True})

        assert isinstance(first.result, UnstorableResult)
        assert "cannot be stored as JSON" in str(first.result)
        record = _record(lease_order.name)
        assert (record.state, record.status_code) == (IdempotencyKey.State.COMPLETED, 507)
        redelivered = lease_order.apply(args=["once"], kwargs={"unstorable": True})
        assert isinstance(redelivered.result, UnstorableResult)
        # Nor once the lease would have run out: the body has acted.
        with database_clock.shifted(timedelta(hours=1)):
            late = lease_order.apply(args=["once"], kwargs={"unstorable": True})
        assert isinstance(late.result, UnstorableResult)
        assert self.orders() == 1

    @server_only
    def test_body_answering_after_losing_its_connection_is_stored(self):
        lose_connection.set()
        first = lease_order.apply(args=["once"])
        connection.close()  # as the worker does after a task

        assert first.get() == {"order": Order.objects.get().pk}
        assert _record(lease_order.name).state == IdempotencyKey.State.COMPLETED
        assert lease_order.apply(args=["once"]).get() == first.get()
        assert self.orders() == 1

    @server_only
    def test_body_raising_after_losing_its_connection_releases(self):
        lose_connection.set()
        fail_next_run.set()
        first = lease_order.apply(args=["once"])
        connection.close()

        # The body's own error, not the dead connection's.
        assert isinstance(first.result, RuntimeError)
        assert "the body failed after writing" in str(first.result)
        assert not IdempotencyKey.objects.exists()
        redelivered = lease_order.apply(args=["once"])
        assert redelivered.successful()
        assert _record(lease_order.name).state == IdempotencyKey.State.COMPLETED
        assert self.orders() == 2  # the failed run's write, and the redelivery's


class DefinitionTests:
    def test_above_shared_task_fails_at_import(self):
        def misplaced() -> None: ...

        with pytest.raises(TypeError, match="below @shared_task"):
            idempotent_task(shared_task(misplaced))

    def test_above_app_task_with_options_fails_at_import(self):
        app = Celery("definition-check", set_as_current=False)

        def misplaced_on_app() -> None: ...

        with pytest.raises(TypeError, match="below @shared_task"):
            idempotent_task(atomic=False)(app.task(shared=False)(misplaced_on_app))

    def test_key_that_is_not_callable_fails_at_definition(self):
        with pytest.raises(TypeError, match=r"key=\.\.\.\) must be a callable"):
            idempotent_task(key="order-1")

    def test_a_misspelt_option_is_suggested_among_every_option(self):
        with pytest.raises(TypeError) as raised:
            idempotent_task(kye=lambda order_id: order_id)

        assert "Did you mean 'key'?" in str(raised.value)
        assert "Valid options are: key, recover, atomic, ttl, wait, lease." in str(raised.value)

    @pytest.mark.parametrize(
        ("options", "message"),
        [
            # The settings table's rules and hints, as for a view's options.
            ({"atomic": "yes"}, "atomic=...) has an invalid value: 'yes'. Use True"),
            ({"wait": -1}, "wait=...) has an invalid value: -1. Use a number of seconds"),
            ({"ttl": "1h"}, "ttl=...) has an invalid value: '1h'. Use a positive timedelta"),
            ({"lease": 0}, "lease=...) has an invalid value: 0. Use a positive timedelta"),
        ],
    )
    def test_bad_option_fails_at_definition(self, options, message):
        with pytest.raises(ImproperlyConfigured, match=re.escape("idempotent_task(" + message)):
            idempotent_task(**options)

    def test_publish_with_wrong_arguments_is_refused_before_sending(self):
        # Celery checks arguments against the body's own signature.
        with pytest.raises(TypeError):
            place_order.apply_async(args=["book"], kwargs={"colour": "red"})

    def test_key_function_must_return_a_string(self):
        @shared_task(name="tests.definition.bad_key")
        @idempotent_task(key=lambda n: n)
        def bad_key(n: int) -> None: ...

        # The error names the task, as the task's own name.
        with pytest.raises(
            TypeError,
            match=r"^The key function of task 'tests\.definition\.bad_key' must return a "
            "non-empty string, not int",
        ):
            bad_key(1)


# On a real worker.


@pytest.fixture(scope="module")
def broker() -> str:
    return find_broker()


@pytest.fixture(scope="module")
def prefork_worker(django_db_setup, tmp_path_factory):
    """A prefork worker with 4 processes, shared by the module's worker tests."""
    with running_worker(tmp_path_factory.mktemp("prefork"), concurrency=4) as worker:
        yield worker


@pytest.fixture
def crash_worker(db, broker, tmp_path) -> Iterator[WorkerProcess]:
    """A worker of the test's own, to be killed and started again."""
    worker = new_worker(broker, str(connection.settings_dict["NAME"]), tmp_path, concurrency=1)
    with publishing_to(worker):
        yield worker


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
class WorkerTests:
    def test_storm_of_duplicates_is_one_effect_per_key(self, prefork_worker):
        labels = [f"storm-{n}" for n in range(STORM_KEYS)]
        sent = [
            (label, place_order.apply_async(args=[label], kwargs={"pause": 0.01}))
            for _ in range(STORM_PUBLISHES)
            for label in labels
        ]

        values = defaultdict(list)
        for label, result in sent:
            values[label].append(prefork_worker.wait_for(result))

        orders = dict(Order.objects.values_list("item", "pk"))
        effects = Counter(Order.objects.values_list("item", flat=True))
        print(
            f"\nstorm on {connection.vendor}: {len(sent)} publishes of {STORM_KEYS} keys "
            f"-> {sum(effects.values())} effects, "
            f"{sum(len(v) for v in values.values())} results"
        )
        assert sum(effects.values()) == STORM_KEYS
        assert set(effects.values()) == {1}
        for label in labels:
            assert values[label] == [{"label": label, "order": orders[label]}] * STORM_PUBLISHES
        assert IdempotencyKey.objects.filter(scope=place_order.name).count() == STORM_KEYS

    def test_autoretry_after_a_write_and_raise_is_one_effect(self, prefork_worker):
        result = flaky_order.delay("flaky", 2)

        assert prefork_worker.wait_for(result) == {"order": Order.objects.get().pk, "run": 3}
        assert prefork_worker.runs("flaky") == 3
        assert Order.objects.filter(item="flaky").count() == 1

    def test_lease_mode_autoretry_runs_again_after_release(self, prefork_worker):
        result = flaky_lease_order.delay("flaky-lease", 2)

        assert prefork_worker.wait_for(result)["run"] == 3
        assert prefork_worker.runs("flaky-lease") == 3
        assert Order.objects.filter(item="flaky-lease").count() == 1
        assert _record(flaky_lease_order.name).state == IdempotencyKey.State.COMPLETED

    def test_same_key_with_other_arguments_fails_on_the_worker(self, prefork_worker):
        original = prefork_worker.wait_for(place_order.delay("mismatch"))
        before = IdempotencyKey.objects.values().get()

        duplicate = place_order.delay("mismatch", pause=0.5)
        prefork_worker.wait_for(duplicate, propagate=False)

        assert duplicate.state == "FAILURE"
        assert isinstance(duplicate.result, TaskArgumentsMismatch)
        assert IdempotencyKey.objects.values().get() == before
        assert Order.objects.get().pk == original["order"]

    def test_unstorable_value_fails_on_the_worker(self, prefork_worker):
        result = unstorable_order.delay("unstorable")
        prefork_worker.wait_for(result, propagate=False)

        assert result.state == "FAILURE"
        assert isinstance(result.result, UnstorableResult)
        assert Order.objects.count() == 0
        assert IdempotencyKey.objects.count() == 0

    def test_lease_mode_unstorable_value_is_one_charge_however_often_autoretry_asks(
        self, prefork_worker
    ):
        result = unstorable_lease_charge.delay("unstorable-lease")
        prefork_worker.wait_for(result, propagate=False)

        assert result.state == "FAILURE"
        assert isinstance(result.result, UnstorableResult)
        assert prefork_worker.runs("unstorable-lease") == 1
        assert Order.objects.filter(item="unstorable-lease").count() == 1
        record = IdempotencyKey.objects.get()
        assert (record.state, record.status_code) == (IdempotencyKey.State.COMPLETED, 507)

    def test_duplicate_outlasting_wait_is_retried_then_replays(self, prefork_worker):
        hold = prefork_worker.task_dir / "slow.hold"
        hold.touch()
        try:
            original = slow_order.delay("slow", True)
            wait_until(lambda: prefork_worker.runs("slow") == 1, "the original to start")
            duplicate = slow_order.delay("slow", True)
            retried = f"slow_order[{duplicate.id}] retry: Retry in 1s: TaskInFlight"
            wait_until(lambda: retried in prefork_worker.log.read_text(), "a retry", 60)
        finally:
            hold.unlink()

        value = prefork_worker.wait_for(original)
        assert prefork_worker.wait_for(duplicate) == value
        assert prefork_worker.runs("slow") == 1
        assert Order.objects.count() == 1

    def test_lease_duplicate_is_retried_until_the_original_completes(self, prefork_worker):
        label = "lease-duplicate"
        hold = prefork_worker.task_dir / f"{label}.hold"
        hold.touch()
        try:
            original = charge_and_hold.delay(label)
            wait_until(lambda: prefork_worker.runs(label) == 1, "the original to start")
            # The same message again, as a visibility timeout would deliver it.
            charge_and_hold.apply_async(args=[label], task_id=original.id)
            retried = f"charge_and_hold[{original.id}] retry: Retry in"
            wait_until(lambda: retried in prefork_worker.log.read_text(), "a retry", 60)
        finally:
            hold.unlink()

        value = prefork_worker.wait_for(original)
        succeeded = f"charge_and_hold[{original.id}] succeeded"
        wait_until(
            lambda: prefork_worker.log.read_text().count(succeeded) == 2, "the duplicate", 60
        )
        assert prefork_worker.runs(label) == 1
        assert RemoteCharge.objects.get().pk == value["charge"]
        assert Order.objects.count() == 1

    @pytest.mark.parametrize("task", [count_down, count_down_lease], ids=["atomic", "lease"])
    def test_a_task_replacing_itself_runs_each_step_once(self, prefork_worker, task):
        # Each replacement has the task's id: its key is that id and its step.
        label = f"count-{task.name.rsplit('.', 1)[-1]}"
        result = task.delay(label, 3)

        assert prefork_worker.wait_for(result) == {"done": label}
        # The last step can end before the step that published it commits:
        # Celery logs each replaced step's end once its body has committed.
        ignored = f"{task.name}[{result.id}] ignored"
        wait_until(
            lambda: prefork_worker.log.read_text().count(ignored) == 3, "the replaced steps", 60
        )
        assert sorted(Order.objects.values_list("item", flat=True)) == [
            f"{label}-{step}" for step in range(4)
        ]
        assert prefork_worker.runs(label) == 4
        records = IdempotencyKey.objects.filter(scope=task.name)
        assert sorted(records.values_list("key", flat=True)) == [
            result.id,
            *(f"{result.id}:replaced:{n}" for n in (1, 2, 3)),
        ]
        assert set(records.values_list("state", flat=True)) == {IdempotencyKey.State.COMPLETED}

    def test_a_replaced_chain_member_sent_again_runs_the_rest_once(self, prefork_worker):
        # The first run handed the rest of its chain to its replacement. Sent
        # again, it ends as it did (ignored), so Celery does not continue the
        # chain a second time from the original message.
        label, first_id = "chained", str(uuid.uuid4())
        tail = end_of_chain.si(label).set(task_id=str(uuid.uuid4()))

        def send() -> None:
            hand_over.apply_async(args=[label], task_id=first_id, chain=[dict(tail)])

        ignored = f"hand_over[{first_id}] ignored"
        send()
        prefork_worker.wait_for(end_of_chain.AsyncResult(tail.id))  # committed
        send()
        wait_until(
            lambda: prefork_worker.log.read_text().count(ignored) == 2, "the copy to end", 60
        )

        assert f"hand_over[{first_id}] succeeded" not in prefork_worker.log.read_text()
        assert prefork_worker.runs(f"{label}-first") == 1
        assert prefork_worker.runs(f"{label}-replacement") == 1
        assert Order.objects.filter(item=f"{label}-tail").count() == 1

    def test_a_replacement_under_its_first_steps_key_ends_and_says_so(self, prefork_worker):
        # key= names the work: a replacement with the same arguments is a
        # duplicate of the step that replaced itself, so it ends ignored;
        # the worker's log says why the work stopped, without the key.
        label = "under-one-key"
        result = poll_under_one_key.delay(label)
        warned = f"Task {poll_under_one_key.name!r} ends ignored: its key= names work"
        wait_until(lambda: warned in prefork_worker.log.read_text(), "the warning", 60)

        assert prefork_worker.runs(label) == 1
        assert f"poll-{label}" not in prefork_worker.log.read_text()
        record = _record(poll_under_one_key.name)
        assert (record.state, record.status_code) == (IdempotencyKey.State.COMPLETED, 204)
        assert result.state == "PENDING"

    def test_a_task_calling_itself_directly_runs_the_calls_in_its_own_run(self, prefork_worker):
        result = walk_tree.delay(1)

        assert prefork_worker.wait_for(result) == {
            "node": 1,
            "children": [{"node": 2, "children": []}, {"node": 3, "children": []}],
        }
        assert sorted(Order.objects.values_list("item", flat=True)) == [
            "node-1",
            "node-2",
            "node-3",
        ]
        assert IdempotencyKey.objects.get(scope=walk_tree.name).key == result.id

    @pytest.mark.parametrize("task", [stop_in_a_function, plain_stop_in_a_function])
    def test_ignore_raised_in_a_function_commits_its_writes(self, prefork_worker, task):
        # Celery's Ignore ends the task on purpose, from the function it calls too.
        label = f"stop-{task.name.rsplit('.', 1)[-1]}"
        result = task.delay(label)
        ignored = f"[{result.id}] ignored"
        wait_until(lambda: ignored in prefork_worker.log.read_text(), "the task to stop", 60)

        assert Order.objects.filter(item=label).count() == 1
        applied = IdempotencyKey.objects.get(key=f"apply-{label}")
        assert applied.state == IdempotencyKey.State.COMPLETED
        if task is stop_in_a_function:
            assert Order.objects.filter(item=f"{label}-task").count() == 1
            assert _record(task.name).state == IdempotencyKey.State.COMPLETED

    def test_lease_body_cut_short_by_the_soft_time_limit_keeps_its_claim(self, prefork_worker):
        # Interrupted wherever it stood, the body's effect is unknown: never released.
        result = outlive_soft_limit.delay("soft")
        prefork_worker.wait_for(result, propagate=False)

        assert result.state == "FAILURE"
        assert type(result.result).__name__ == "SoftTimeLimitExceeded"
        assert RemoteCharge.objects.filter(item="soft").count() == 1
        assert _record(outlive_soft_limit.name).state == IdempotencyKey.State.IN_PROGRESS


def _wait_for_run(worker: WorkerProcess, label: str) -> None:
    wait_until(lambda: worker.runs(label) >= 1, f"{label} to start", 60)


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
class CrashTests:
    def test_atomic_body_killed_mid_transaction_has_one_effect(self, crash_worker):
        label = "crash-atomic"
        hold = crash_worker.task_dir / f"{label}.hold"
        hold.touch()
        crash_worker.start()
        result = hold_order.delay(label)
        _wait_for_run(crash_worker, label)

        crash_worker.kill9()
        hold.unlink()
        # The transaction died with its connection: no order, no record.
        assert Order.objects.count() == 0
        assert IdempotencyKey.objects.count() == 0

        crash_worker.start()
        value = crash_worker.wait_for(result)

        print(
            f"\natomic crash on {connection.vendor}: {crash_worker.runs(label)} runs "
            f"-> {Order.objects.count()} effect"
        )
        assert value == {"order": Order.objects.get().pk}
        assert crash_worker.runs(label) == 2
        assert _record(hold_order.name).key == result.id

    def test_lease_body_killed_is_taken_over_after_the_lease(self, crash_worker):
        label = "crash-lease"
        hold = crash_worker.task_dir / f"{label}.hold"
        hold.touch()
        crash_worker.start()
        result = charge_and_hold.delay(label)
        _wait_for_run(crash_worker, label)
        claimed = _record(charge_and_hold.name)
        assert claimed.state == IdempotencyKey.State.IN_PROGRESS

        crash_worker.kill9()
        hold.unlink()
        crash_worker.start()
        # The same message again at once, inside the dead owner's lease, as a
        # broker that redelivers early would send it: put off, not run.
        charge_and_hold.apply_async(args=[label], task_id=result.id)
        put_off = f"charge_and_hold[{result.id}] retry: Retry in"
        wait_until(lambda: put_off in crash_worker.log.read_text(), "the early copy's retry", 60)
        value = crash_worker.wait_for(result)

        print(
            f"\nlease crash on {connection.vendor}: {crash_worker.runs(label)} runs -> "
            f"{RemoteCharge.objects.count()} charge, {Order.objects.count()} order"
        )
        assert timezone.now() >= claimed.locked_until
        assert crash_worker.runs(label) == 2
        assert RemoteCharge.objects.get().pk == value["charge"]
        assert Order.objects.count() == 1
        record = _record(charge_and_hold.name)
        assert record.state == IdempotencyKey.State.COMPLETED
        # Taken over only once the dead owner's lease had run out.
        assert record.created_at >= claimed.locked_until
