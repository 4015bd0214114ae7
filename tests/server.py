"""Real server processes for the tests: gunicorn or uvicorn on the test database, and kill -9.

:func:`running` starts either server with a settings module on the database
pytest-django created; :meth:`GunicornServer.worker_pids` lists its workers
and :func:`kill9` kills a process (or a whole process group) as a crash
would, the one way every crash test here kills a server or Celery worker.
The fixtures built on it are in :mod:`tests.server_fixtures`; this module
does not import pytest, so that the benchmarks can start servers with it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests
from django.db import connections

from tests.polling import wait_until

#: The environment variable naming the test database; read by ``tests.server_settings``.
DATABASE_NAME_ENV = "IDEMPOTENCY_SERVER_DATABASE_NAME"
#: The environment variable naming ``FILE_UPLOAD_TEMP_DIR``; read by ``tests.body_server_settings``.
UPLOAD_TEMP_DIR_ENV = "IDEMPOTENCY_UPLOAD_TEMP_DIR"
ROOT = Path(__file__).resolve().parent.parent
WORKERS = 4
START_LIMIT = 30.0
STOP_LIMIT = 10.0
#: Gunicorn's access log: worker PID, status and path, so a test can see which
#: workers answered.
ACCESS_LOG_FORMAT = "%(p)s %(s)s %(U)s"


def free_port() -> int:
    """A port nobody listens on now; the OS picks it, so parallel runs do not clash."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# What a pid a test kills must never name: with pids wrapping at 32768 on a
# busy machine, the worker a test meant may be gone and its pid taken by the
# test run itself (a shell, pytest, tox) by the time the kill comes.
_NEVER_KILLED = (b"pytest", b"dev.py", b"tox", b".ci/run")


def kill9(pid: int, *, group: bool = False) -> None:
    """``kill -9`` the process, or with ``group`` its whole process group: nothing cleans up.

    A pid that now names a shell or the test run itself raises
    ``ProcessLookupError``, as it would had it not been taken again: the
    process the test meant is gone.
    """
    if group:
        os.killpg(pid, signal.SIGKILL)
        return
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        raise ProcessLookupError(pid) from None
    argv = command.split(b"\0")
    if argv[0].endswith((b"sh", b"bash")) or any(
        arg.endswith(name) for arg in argv for name in _NEVER_KILLED
    ):
        raise ProcessLookupError(pid)
    os.kill(pid, signal.SIGKILL)


def wait_for_exit(pid: int, limit: float = 10) -> None:
    """Wait until a killed process is gone: exited and reaped by its parent."""
    wait_until(lambda: not Path(f"/proc/{pid}").exists(), f"process {pid} to exit", limit)


def wait_for_file(path: Path, limit: float = 15) -> dict[str, Any]:
    """The JSON a server-side view wrote to ``path``, once it is there."""
    wait_until(path.exists, f"{path.name} to appear", limit)
    return json.loads(path.read_text())


class GunicornServer:
    """One gunicorn master with ``WORKERS`` sync workers on 127.0.0.1.

    Started with :meth:`start`, which returns once the server answers HTTP,
    and stopped with :meth:`stop`. Its output goes to ``log_dir`` so that a
    failing test can show what the server said.
    """

    #: Shown in errors about the server, and the module run with ``python -m``.
    name = "gunicorn"
    #: A path :meth:`start` requests until the server answers.
    probe_path = "/drf/orders/summary/"

    def __init__(self, env: Mapping[str, str], log_dir: Path, workers: int = WORKERS) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **env}
        self.workers = workers
        self.output = log_dir / f"{self.name}.out"
        self.error_log = log_dir / f"{self.name}-error.log"
        self.access_log = log_dir / f"{self.name}-access.log"
        self.process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", self.name, *self.arguments()]

    def arguments(self) -> list[str]:
        return [
            "--workers",
            str(self.workers),
            "--worker-class",
            "sync",
            "--bind",
            f"127.0.0.1:{self.port}",
            "--timeout",
            "30",
            "--graceful-timeout",
            "5",
            "--chdir",
            str(ROOT),
            "--error-logfile",
            str(self.error_log),
            "--access-logfile",
            str(self.access_log),
            "--access-logformat",
            ACCESS_LOG_FORMAT,
            "django.core.wsgi:get_wsgi_application()",
        ]

    def start(self, probe_path: str | None = None) -> None:
        """Start the server and wait until a request gets any HTTP answer.

        On any failure the server is stopped before the error propagates, so
        a broken start never leaves workers behind.
        """
        with self.output.open("wb") as output:
            self.process = subprocess.Popen(
                self.command(), env=self.env, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT
            )
        try:
            self._wait_until_answering(probe_path or self.probe_path)
        except BaseException:
            self.stop()
            raise

    def _wait_until_answering(self, probe_path: str) -> None:
        assert self.process is not None
        deadline = time.monotonic() + START_LIMIT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.process.returncode}:\n{self.log()}"
                )
            try:
                requests.get(self.url + probe_path, timeout=2)
            except (requests.ConnectionError, requests.Timeout):
                # Not listening yet, or listening while the workers still boot.
                time.sleep(0.1)
                continue
            return
        raise RuntimeError(f"{self.name} did not answer within {START_LIMIT} s:\n{self.log()}")

    def __enter__(self) -> GunicornServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop gracefully, then by force: a test run must never leave workers behind."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_LIMIT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=STOP_LIMIT)

    def worker_pids(self) -> list[int]:
        """The live worker processes (children of the master), for tests that kill them."""
        assert self.process is not None
        master = str(self.process.pid)
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                # "pid (comm) state ppid ...": comm may hold spaces, so split after ")".
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # the process exited while we looked
            if fields[1] == master and fields[0] != "Z":
                pids.append(int(stat.parent.name))
        return sorted(pids)

    def log(self) -> str:
        """What the server said: its error log and its own output."""
        return "".join(path.read_text() for path in (self.error_log, self.output) if path.exists())

    def answering_pids(self) -> set[int]:
        """The worker PIDs that have answered a request so far, from the access log."""
        if not self.access_log.exists():
            return set()
        lines = self.access_log.read_text().splitlines()
        # Gunicorn writes the PID atom as "<1234>".
        return {int(line.split()[0].strip("<>")) for line in lines if line}


class UvicornServer(GunicornServer):
    """Uvicorn serving Django's ASGI application, with ``workers`` processes.

    Uvicorn logs to its output, in ``log_dir``; the other methods are the
    gunicorn harness's.
    """

    name = "uvicorn"
    probe_path = "/async/ping/"

    def arguments(self) -> list[str]:
        return [
            "--factory",
            "django.core.asgi:get_asgi_application",
            "--workers",
            str(self.workers),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--app-dir",
            str(ROOT),
            "--no-access-log",
            "--timeout-graceful-shutdown",
            "5",
        ]


@contextmanager
def running(
    server_class: type[GunicornServer],
    settings: str,
    log_dir: Path,
    env: Mapping[str, str] | None = None,
    workers: int = WORKERS,
) -> Iterator[GunicornServer]:
    """A server on ``settings`` and on the test database, stopped on the way out.

    Call it where pytest-django's database exists (a fixture that depends
    on ``django_db_setup``); ``env`` is added to the server's environment.
    """
    name = connections["default"].settings_dict["NAME"]
    environment = {"DJANGO_SETTINGS_MODULE": settings, DATABASE_NAME_ENV: name, **(env or {})}
    with server_class(environment, log_dir, workers=workers) as server:
        yield server
