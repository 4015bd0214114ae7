"""Fixtures of the fault suite: the server, the scale, the report's rows.

What scenarios share lives in :mod:`tests.faults.harness`; session-wide
hooks (scale, the SQLite skip, the report) in :mod:`tests.faults.plugin`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from tests.faults.database import APPLICATION_NAME_ENV
from tests.faults.harness import SCALES, Scale
from tests.faults.plugin import Row, record_row, scale
from tests.polling import wait_until as wait_for
from tests.server import WORKERS, GunicornServer, running


@pytest.fixture(scope="session")
def sizes() -> Scale:
    return SCALES[scale()]


@pytest.fixture(scope="session")
def application_name() -> str:
    return f"django-idempotency-faults-{os.getpid()}"


@pytest.fixture(scope="session")
def faults_server(
    django_db_setup: None, application_name: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GunicornServer]:
    """One gunicorn for the whole suite; scenarios leave it healthy for the next one.

    Started with the fault settings (persistent, health-checked connections)
    on the database pytest-django created. A server that cannot start is an
    error, never a skip.
    """
    settings = "tests.faults.server_settings"
    log_dir = tmp_path_factory.mktemp("faults-gunicorn")
    env = {APPLICATION_NAME_ENV: application_name}
    with running(GunicornServer, settings, log_dir, env) as gunicorn:
        yield gunicorn


@pytest.fixture
def server(faults_server: GunicornServer) -> GunicornServer:
    """The session's server, once it again has all its workers (a crash test killed some)."""
    wait_for(lambda: len(faults_server.worker_pids()) == WORKERS, "gunicorn to respawn workers")
    return faults_server


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Callable[[Row], None]:
    return lambda row: record_row(request.node, row)
