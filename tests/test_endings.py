"""How a handler ends, under every adapter: the conformance table of SPEC §4.6.

One parametrised table: ``ADAPTERS`` (rows) x ``ENDINGS`` x ``MODES``. What
each cell must come to is one function of the ending and the mode,
:func:`expected`, and every outcome is checked the same way for every
adapter, on real servers (gunicorn for the sync adapters, uvicorn for the
async ones), a real Celery worker and the real database:

- ``stored``: the record is completed with the response; a retry replays it
  (``Idempotent-Replayed: true``, same status, same body); the handler ran once;
- ``rolled back`` (atomic mode): no record is left and the handler's rows are
  gone; a retry runs the handler again, and the next one replays;
- ``released`` (lease mode): no record is left, at once (not when the lease
  runs out); a retry runs the handler again at once, and the next one replays;
- ``held`` (lease mode, the effect unknown): the dead owner's claim stays; a
  retry gets 409 with ``Retry-After`` until the lease runs out, then takes over.

Runs of the handler are counted outside the database (a line per run in a
file) as well as by its committed rows. A cell that does not apply to an
adapter is not in the table (:func:`applies`): the framework's control flow
is Celery's, a client's disconnect needs a client connection, and killing
the database connection needs a database server. The ``_form`` rows send
what a browser sends (SPEC 9): a form with the key in its field, a CSRF
token masked afresh on every attempt, and ``Accept`` preferring HTML, so
a 409 comes back as a page with the same status and ``Retry-After``.
A new adapter joins by
adding a row to ``ADAPTERS`` (and its views, or its driver in
``tests/endings_cells.py``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import states
from django.db import connection
from django.utils import timezone

from django_idempotency.models import IdempotencyKey
from tests.celery_worker import WorkerProcess, running_worker
from tests.drf_views import CONTROL_DIR_ENV
from tests.endings_cells import (
    IN_FLIGHT,
    CallerProcesses,
    Cell,
    FunctionCell,
    HttpCell,
    TaskCell,
)
from tests.polling import wait_until
from tests.server import DATABASE_NAME_ENV, GunicornServer, UvicornServer
from tests.server_fixtures import controlled
from tests.settings import BACKEND

pytestmark = [pytest.mark.server, pytest.mark.django_db(transaction=True)]

State = IdempotencyKey.State

STORED = "stored"
ROLLED_BACK = "rolled back"
RELEASED = "released"
HELD = "held"

MODES = ("atomic", "lease")


@dataclass(frozen=True)
class Ending:
    name: str
    #: Which adapters it applies to: "http" (a client connection), "task", "options"
    #: (a view given per-view options: not the middleware's), or "any".
    needs: str = "any"
    #: Killing a connection needs a database server (not SQLite's file).
    needs_database_server: bool = False


ENDINGS = [
    Ending("ok"),  # 2xx, or a task's value
    Ending("stored_4xx", needs="http"),  # 400 with a body
    Ending("5xx", needs="http"),  # 503
    Ending("raises"),
    Ending("transient", needs="http"),  # 429
    # A 202, which the view's ``store`` option refuses (views with options only).
    Ending("store_refused", needs="options"),
    # The client closes its socket while the handler runs, or after it returned
    # and before its response is stored (a response whose rendering is slow;
    # for the middleware, a slow middleware listed after it).
    Ending("disconnect_before", needs="http"),
    Ending("disconnect_after", needs="http"),
    # Celery's control flow: the body ended on purpose, or asked to run again.
    Ending("ignore", needs="task"),
    Ending("replace", needs="task"),
    Ending("retry", needs="task"),
    Ending("reject", needs="task"),
    Ending("kill9"),  # the worker process, mid-handler
    # The handler's database connection, killed mid-handler (the handler
    # then runs a query), or after its last statement and before the store.
    Ending("db_kill_mid", needs_database_server=True),
    Ending("db_kill_after", needs_database_server=True),
]


def expected(ending: str, mode: str) -> str:
    """SPEC §4.6: how a cell must end, from its ending and its mode alone."""
    atomic = mode == "atomic"
    failed = ROLLED_BACK if atomic else RELEASED
    if ending in ("ok", "stored_4xx", "ignore", "replace"):
        return STORED
    if ending in ("disconnect_before", "disconnect_after"):
        # The handler runs to completion and its response is stored.
        return STORED
    if ending == "kill9":
        return ROLLED_BACK if atomic else HELD
    if ending == "db_kill_after":
        # Atomic: the transaction died with the effect; lease: the effect has
        # run, so the response is stored on a fresh connection.
        return ROLLED_BACK if atomic else STORED
    # 5xx, raises, transient, store_refused, retry, reject, db_kill_mid: a failure.
    return failed


@dataclass(frozen=True)
class Adapter:
    name: str
    #: Who plays its cells: the fixture of a server or worker.
    runner: str
    #: Which of "http", "task" its endings may need.
    kind: str
    #: HTTP: the views' prefix in tests/endings_urls.py; the mode follows it.
    path: str = ""
    #: HTTP: sent as a browser's form, the key in its field (SPEC 9).
    form: bool = False
    #: HTTP: its views have the ``store`` option (tests/endings_views.py's ``kept``).
    #: The plain function views and the middleware do not, so that the table
    #: also runs every ending with none.
    store: bool = True

    def applies(self, ending: Ending) -> bool:
        if ending.needs == "options":
            return self.kind == "http" and self.store
        return ending.needs in ("any", self.kind)


ADAPTERS = [
    Adapter("function", "gunicorn", "http", "/endings/function/", store=False),
    Adapter("class_based", "gunicorn", "http", "/endings/class_based/"),
    Adapter("api_view", "gunicorn", "http", "/endings/api_view/"),
    Adapter("mixin_apiview", "gunicorn", "http", "/endings/mixin_apiview/"),
    Adapter("mixin_viewset", "gunicorn", "http", "/endings/mixin_viewset/"),
    Adapter("drf_dispatch", "gunicorn", "http", "/endings/drf_dispatch/"),
    Adapter("adrf", "uvicorn", "http", "/endings/adrf/"),
    Adapter("adrf_dispatch", "uvicorn", "http", "/endings/adrf_dispatch/"),
    Adapter("async_function", "uvicorn", "http", "/endings/async_function/"),
    Adapter("async_class_based", "uvicorn", "http", "/endings/async_class_based/"),
    Adapter("async_dispatch", "uvicorn", "http", "/endings/async_dispatch/"),
    # IdempotencyMiddleware on undecorated views: atomic, or lease mode for a
    # transaction.non_atomic_requests view; under ASGI a sync and an async view.
    Adapter("middleware_wsgi", "gunicorn", "http", "/endings/middleware/", store=False),
    Adapter("middleware_asgi", "uvicorn", "http", "/endings/middleware/", store=False),
    Adapter(
        "middleware_asgi_async_view", "uvicorn", "http", "/endings/async_middleware/", store=False
    ),
    # The same middleware on a DRF view that protects nothing itself: its build.
    Adapter("middleware_drf_wsgi", "gunicorn", "http", "/endings/middleware_drf/", store=False),
    Adapter("middleware_drf_asgi", "uvicorn", "http", "/endings/middleware_drf/", store=False),
    # A browser's form, the key in its field: a decorator, the DRF mixin's
    # form parser, and the middleware under ASGI.
    Adapter("function_form", "gunicorn", "http", "/endings/function/", form=True, store=False),
    Adapter("mixin_apiview_form", "gunicorn", "http", "/endings/mixin_apiview/", form=True),
    Adapter(
        "middleware_asgi_form", "uvicorn", "http", "/endings/middleware/", form=True, store=False
    ),
    Adapter("celery_task", "celery", "task"),
    # Protected calls, each from a caller process (tests/endings_function.py):
    # idempotent_function, a task of Django's Tasks framework enqueued (on its
    # ImmediateBackend), and an async one awaited through Task.acall().
    Adapter("idempotent_function", "function", "function"),
    Adapter("django_task_enqueue", "function", "function"),
    Adapter("django_task_acall", "function", "function"),
]


def applies(adapter: Adapter, ending: Ending) -> bool:
    if ending.needs_database_server and BACKEND == "sqlite":
        return False
    return adapter.applies(ending)


CELLS = [
    pytest.param((adapter, ending.name, mode), id=f"{adapter.name}-{ending.name}-{mode}")
    for adapter in ADAPTERS
    for ending in ENDINGS
    if applies(adapter, ending)
    for mode in MODES
]


# The servers and the worker, one of each for the module.


class EndingsGunicorn(GunicornServer):
    probe_path = "/endings/ping/"


class EndingsUvicorn(UvicornServer):
    """Uvicorn on ``tests.endings_asgi``, which reports each client that went away."""

    probe_path = "/endings/ping/"

    def arguments(self) -> list[str]:
        arguments = super().arguments()
        factory = arguments.index("django.core.asgi:get_asgi_application")
        arguments[factory] = "tests.endings_asgi:application"
        return arguments


@pytest.fixture(scope="module")
def endings_control(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("endings-control")


@pytest.fixture(scope="module")
def gunicorn_runner(
    django_db_setup: None, endings_control: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GunicornServer]:
    settings = "tests.endings_settings"
    with controlled(EndingsGunicorn, settings, endings_control, tmp_path_factory, 3) as server:
        yield server


@pytest.fixture(scope="module")
def uvicorn_runner(
    django_db_setup: None, endings_control: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GunicornServer]:
    settings = "tests.endings_settings"
    with controlled(EndingsUvicorn, settings, endings_control, tmp_path_factory, 2) as server:
        yield server


@pytest.fixture(scope="module")
def celery_runner(
    django_db_setup: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    with running_worker(tmp_path_factory.mktemp("endings-worker"), concurrency=2) as worker:
        yield worker


@pytest.fixture(scope="module")
def function_runner(
    django_db_setup: None, endings_control: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CallerProcesses]:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.endings_settings",
        DATABASE_NAME_ENV: str(connection.settings_dict["NAME"]),
        CONTROL_DIR_ENV: str(endings_control),
    }
    callers = CallerProcesses(env, tmp_path_factory.mktemp("endings-callers"))
    try:
        yield callers
    finally:
        callers.close()


@pytest.fixture
def cell(request: pytest.FixtureRequest, endings_control: Path) -> Cell:
    adapter, ending, mode = request.param
    runner = request.getfixturevalue(f"{adapter.runner}_runner")
    key = f"{adapter.name}-{ending}-{mode}-{uuid.uuid4().hex[:8]}"
    atomic = mode == "atomic"
    if isinstance(runner, WorkerProcess):
        return TaskCell(key, ending, atomic, runner.task_dir, worker=runner)
    if isinstance(runner, CallerProcesses):
        return FunctionCell(
            key, ending, atomic, endings_control, caller=adapter.name, callers=runner
        )
    return HttpCell(
        key,
        ending,
        atomic,
        endings_control,
        server=runner,
        path=adapter.path,
        notices_disconnect=isinstance(runner, UvicornServer),
        form=adapter.form,
    )


# The outcomes, checked the same way for every adapter.


def success(cell: Cell) -> int | str:
    return 201 if isinstance(cell, HttpCell) else states.SUCCESS


def in_flight(cell: Cell) -> int | str:
    return 409 if isinstance(cell, HttpCell) else IN_FLIGHT


def stored_status(cell: Cell) -> int | str:
    if isinstance(cell, HttpCell):
        return 400 if cell.ending == "stored_4xx" else 201
    return "IGNORED" if cell.ending == "ignore" else states.SUCCESS


def failure_status(cell: Cell) -> int | str | None:
    if isinstance(cell, HttpCell):
        return {"5xx": 503, "transient": 429, "store_refused": 202, "kill9": None}.get(
            cell.ending, 500
        )
    if isinstance(cell, FunctionCell) and cell.ending == "kill9":
        return None  # the calling process died with it
    return states.FAILURE


def describe(record: IdempotencyKey | None) -> str:
    if record is None:
        return "no record"
    return f"a record {record.state} (status {record.status_code})"


def runs(cell: Cell) -> int:
    return len(cell.runs())


def check_replay(cell: Cell, replay: Any, original: Any) -> None:
    """A retry of completed work: the stored answer, and the handler did not run."""
    record = cell.record()
    if isinstance(cell, HttpCell):
        assert replay.replayed, f"the retry was not a replay: {replay.status} {replay.body!r}"
        assert record is not None
        assert replay.status == record.status_code
        body = original.body if original is not None else bytes(record.response_body)
        assert replay.body == body
    elif original is not None and cell.ending not in ("ignore", "replace"):
        assert replay.status == states.SUCCESS
        assert replay.body == original.body


def check_stored(cell: Cell) -> None:
    first = cell.first
    if first is not None:
        assert first.status == stored_status(cell), (first.status, first.body)
        assert not first.replayed
    # A client that went away never saw the answer: its retry waits it out.
    replay = cell.again(settle=True)
    assert runs(cell) == 1, (
        f"the handler ran {runs(cell)} times; the retry got {replay.status} {replay.body!r}"
    )
    record = cell.record()
    assert record is not None, "nothing was stored: the key was given back or rolled back"
    assert record.state == State.COMPLETED, describe(record)
    assert cell.rows() == 1, f"{cell.rows()} of the handler's rows committed, not 1"
    if isinstance(cell, HttpCell):
        assert record.status_code == stored_status(cell)
    check_replay(cell, replay, first)
    if isinstance(cell, TaskCell) and cell.ending == "replace":
        assert cell.replacements() == 1, f"the replacement ran {cell.replacements()} times"
    assert runs(cell) == 1


def check_failed(cell: Cell, rows_left: int) -> None:
    """Rolled back (no rows left) or released (the run's rows stay): nothing stored, runs again."""
    if cell.retried_by_framework:
        # Celery ran the body again by itself (a retry, a requeued message).
        retry = cell.first
        assert retry is not None
    else:
        first = cell.first
        if failure_status(cell) is None:
            assert first is None
        else:
            assert first is not None, "the first attempt got no answer"
            assert first.status == failure_status(cell), (first.status, first.body)
        record = cell.record()
        assert record is None, f"{describe(record)} is left after the failure"
        assert runs(cell) == 1
        assert cell.rows() == rows_left, f"{cell.rows()} rows, not {rows_left}"
        retry = cell.again()
        assert retry.status == success(cell), f"the retry got {retry.status} {retry.body!r}"
        assert not retry.replayed
    assert runs(cell) == 2, f"the handler ran {runs(cell)} times, not twice"
    assert cell.rows() == rows_left + 1
    record = cell.record()
    assert record is not None and record.state == State.COMPLETED, describe(record)
    # The failure gave the key back, so the second run claimed it afresh: a
    # claim held on and taken over once its lease ran out would be attempt 2.
    assert record.attempt == 1, f"the second run took over a held claim ({record.attempt})"
    check_replay(cell, cell.again(), retry)
    assert runs(cell) == 2


def check_rolled_back(cell: Cell) -> None:
    check_failed(cell, rows_left=0)


def check_released(cell: Cell) -> None:
    check_failed(cell, rows_left=1)


def check_held(cell: Cell) -> None:
    assert cell.first is None or cell.first.status == failure_status(cell)
    held = cell.record()
    assert held is not None, "the dead owner's claim was released"
    assert held.state == State.IN_PROGRESS, describe(held)
    assert held.locked_until is not None
    # Held for the lease its protection was given (a heartbeat may have lengthened it).
    lease = held.locked_until - held.created_at
    assert lease >= timedelta(seconds=cell.lease_seconds - 0.1), f"held for {lease} only"
    assert runs(cell) == 1
    assert cell.rows() == 1
    run_out = held.locked_until + timedelta(milliseconds=50)
    if not isinstance(cell, TaskCell):
        takeover = None
        if timezone.now() < held.locked_until - timedelta(milliseconds=300):
            early = cell.again()
            if early.status == in_flight(cell):
                if cell.tells_retry_after:
                    assert early.retry_after is not None and float(early.retry_after) > 0
            else:
                # Sent inside the lease, but served only after it ran out (the
                # server was still starting a worker in place of the killed one).
                assert timezone.now() > held.locked_until, (
                    f"a retry inside the lease got {early.status}"
                )
                takeover = early
        if takeover is None:
            record = cell.record()
            assert record is not None and record.owner_token == held.owner_token
            wait_until(lambda: timezone.now() > run_out, "the dead owner's lease to run out")
            takeover = cell.again()
        assert takeover.status == success(cell), (takeover.status, takeover.body)
        assert not takeover.replayed
    else:
        # The duplicate is put off (TaskInFlight) until the lease runs out.
        takeover = cell.again()
        assert takeover.status == states.SUCCESS, takeover.status
        assert cell.runs()[1] >= held.locked_until.timestamp() - 0.05
    assert runs(cell) == 2
    assert cell.rows() == 2
    record = cell.record()
    assert record is not None and record.state == State.COMPLETED, describe(record)
    assert record.owner_token != held.owner_token
    check_replay(cell, cell.again(), takeover)
    assert runs(cell) == 2


CHECKS = {
    STORED: check_stored,
    ROLLED_BACK: check_rolled_back,
    RELEASED: check_released,
    HELD: check_held,
}


@pytest.mark.parametrize("cell", CELLS, indirect=True)
def test_ending(cell: Cell) -> None:
    mode = "atomic" if cell.atomic else "lease"
    cell.play()
    CHECKS[expected(cell.ending, mode)](cell)
