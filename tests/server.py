"""Run gunicorn or uvicorn on the test database, for tests over real HTTP and real processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import requests

#: The environment variable naming the test database; read by ``tests.server_settings``.
DATABASE_NAME_ENV = "IDEMPOTENCY_SERVER_DATABASE_NAME"
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


class GunicornServer:
    """One gunicorn master with ``WORKERS`` sync workers on 127.0.0.1.

    Started with :meth:`start`, which returns once the server answers HTTP,
    and stopped with :meth:`stop`. Its output goes to ``log_dir`` so that a
    failing test can show what the server said.
    """

    def __init__(self, env: Mapping[str, str], log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **env}
        self.error_log = log_dir / "gunicorn-error.log"
        self.access_log = log_dir / "gunicorn-access.log"
        self.process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "gunicorn",
            "--workers",
            str(WORKERS),
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

    #: Shown in errors about the server.
    name = "gunicorn"

    def start(self, probe_path: str = "/drf/orders/summary/") -> None:
        """Start the server and wait until a request gets any HTTP answer.

        On any failure the server is stopped before the error propagates, so
        a broken start never leaves workers behind.
        """
        self.process = subprocess.Popen(
            self.command(),
            env=self.env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            self._wait_until_answering(probe_path)
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
        return self.error_log.read_text() if self.error_log.exists() else ""

    def answering_pids(self) -> set[int]:
        """The worker PIDs that have answered a request so far, from the access log."""
        if not self.access_log.exists():
            return set()
        lines = self.access_log.read_text().splitlines()
        # Gunicorn writes the PID atom as "<1234>".
        return {int(line.split()[0].strip("<>")) for line in lines if line}


class UvicornServer(GunicornServer):
    """Uvicorn serving Django's ASGI application, with ``workers`` processes.

    Its output (uvicorn logs to stderr) goes to ``log_dir``; the other
    methods are the gunicorn harness's.
    """

    name = "uvicorn"

    def __init__(self, env: Mapping[str, str], log_dir: Path, workers: int = WORKERS) -> None:
        super().__init__(env, log_dir)
        self.workers = workers
        self.error_log = log_dir / "uvicorn.log"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "uvicorn",
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

    def start(self, probe_path: str = "/async/ping/") -> None:
        self._log_file = self.error_log.open("wb")
        self.process = subprocess.Popen(
            self.command(), env=self.env, cwd=ROOT, stdout=self._log_file, stderr=subprocess.STDOUT
        )
        try:
            self._wait_until_answering(probe_path)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        super().stop()
        log_file = getattr(self, "_log_file", None)
        if log_file is not None:
            log_file.close()
