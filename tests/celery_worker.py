"""Starting, killing and restarting real ``celery worker`` processes for the tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from celery.exceptions import TimeoutError as CeleryTimeoutError

from tests import celery_app
from tests.tasks import TASK_DIR_ENV

REPO = Path(__file__).resolve().parent.parent
RESULT_TIMEOUT = 120.0


@dataclass
class WorkerProcess:
    """One ``celery worker`` (a prefork parent and its children) in its own process group."""

    broker: str
    queue: str
    database: str
    task_dir: Path
    log: Path
    concurrency: int = 4
    process: subprocess.Popen | None = field(default=None, init=False)

    def start(self) -> WorkerProcess:
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.celery_settings",
            "IDEMPOTENCY_TEST_DATABASE_NAME": self.database,
            celery_app.BROKER_ENV: self.broker,
            celery_app.QUEUE_ENV: self.queue,
            TASK_DIR_ENV: str(self.task_dir),
        }
        with self.log.open("a") as output:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "tests.celery_app",
                    "worker",
                    "--pool=prefork",
                    f"--concurrency={self.concurrency}",
                    "--without-gossip",
                    "--without-mingle",
                    "--without-heartbeat",
                    "--loglevel=INFO",
                    "-n",
                    f"{self.queue}-{time.monotonic_ns()}@%h",
                ],
                cwd=REPO,
                env=env,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group, so kill -9 reaches every child
            )
        return self

    def kill9(self) -> None:
        """``kill -9`` the parent and every child at once: nothing gets to clean up."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=20)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def wait_for(self, result: Any, propagate: bool = True) -> Any:
        """The task's return value, failing fast if the worker died."""
        deadline = time.monotonic() + RESULT_TIMEOUT
        while True:
            try:
                return result.get(timeout=1, propagate=propagate)
            except CeleryTimeoutError:
                assert self.process is not None
                if self.process.poll() is not None:
                    pytest.fail(f"The Celery worker exited:\n{self.log.read_text()[-5000:]}")
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"No result within {RESULT_TIMEOUT}s. Worker log:\n"
                        f"{self.log.read_text()[-5000:]}"
                    )

    def runs(self, label: str) -> int:
        """How many times a body called ``checkpoint(label)``."""
        started = self.task_dir / f"{label}.started"
        return len(started.read_text().splitlines()) if started.exists() else 0
