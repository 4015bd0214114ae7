"""The server tests' fixtures and marks, over :mod:`tests.server`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from tests.server import WORKERS, GunicornServer, UvicornServer, running
from tests.settings import BACKEND

#: The marks of a test module that talks to a server: multi-process tests
#: need a database server that the processes share.
SERVER_TESTS = [
    pytest.mark.server,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        BACKEND == "sqlite",
        reason=(
            "multi-process server tests run on the server backends (PostgreSQL, MariaDB); "
            "SQLite is the embedded single-host backend"
        ),
    ),
]


@pytest.fixture(scope="module", name="control_dir")
def control_dir_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the holding views report their PID and wait for the test's go-ahead."""
    return tmp_path_factory.mktemp("control")


def controlled(
    server_class: type[GunicornServer],
    settings: str,
    control_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    workers: int = WORKERS,
) -> AbstractContextManager[GunicornServer]:
    """:func:`running`, with the holding views reporting to ``control_dir``."""
    from tests.drf_views import CONTROL_DIR_ENV  # needs the apps loaded

    log_dir = tmp_path_factory.mktemp(server_class.name)
    env = {CONTROL_DIR_ENV: str(control_dir)}
    return running(server_class, settings, log_dir, env, workers=workers)


@pytest.fixture(scope="module", name="gunicorn")
def gunicorn_fixture(
    django_db_setup: None, control_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GunicornServer]:
    """Gunicorn with four sync workers on the test settings."""
    with controlled(
        GunicornServer, "tests.server_settings", control_dir, tmp_path_factory
    ) as server:
        yield server


@pytest.fixture(scope="module", name="uvicorn")
def uvicorn_fixture(
    django_db_setup: None, control_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GunicornServer]:
    """Uvicorn with four workers, the middleware installed (``tests.asgi_settings``)."""
    settings = "tests.asgi_settings"
    with controlled(UvicornServer, settings, control_dir, tmp_path_factory) as server:
        yield server
