"""Starting, killing and restarting real ``celery worker`` processes for the tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kombu
import pytest
import redis
from celery import current_app
from celery.exceptions import TimeoutError as CeleryTimeoutError

from tests import celery_app
from tests.server import kill9
from tests.tasks import TASK_DIR_ENV

REPO = Path(__file__).resolve().parent.parent
RESULT_TIMEOUT = 120.0
REDIS_URL = "redis://127.0.0.1:6379/0"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"


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
class WorkerProcess:
    """One ``celery worker`` (a pool's parent and its children) in its own process group."""

    broker: str
    queue: str
    database: str
    task_dir: Path
    log: Path
    concurrency: int = 4
    pool: str = "prefork"
    result_timeout: float = RESULT_TIMEOUT
    #: The worker's Django settings and Celery app modules, and more of its environment.
    settings: str = "tests.celery_settings"
    app: str = "tests.celery_app"
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = field(default=None, init=False)

    def start(self) -> WorkerProcess:
        env = {
            **os.environ,
            **self.env,
            "DJANGO_SETTINGS_MODULE": self.settings,
            "IDEMPOTENCY_TEST_DATABASE_NAME": self.database,
            celery_app.BROKER_ENV: self.broker,
            celery_app.QUEUE_ENV: self.queue,
            TASK_DIR_ENV: str(self.task_dir),
        }
        name = f"{self.queue}-{time.monotonic_ns()}@%h"
        options = [
            f"--pool={self.pool}",
            f"--concurrency={self.concurrency}",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--loglevel=INFO",
            "-n",
            name,
        ]
        with self.log.open("a") as output:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", self.app, "worker", *options],
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
        kill9(self.process.pid, group=True)
        self.process.wait(timeout=20)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill9(self.process.pid, group=True)
            self.process.wait()

    def wait_for(self, result: Any, propagate: bool = True) -> Any:
        """The task's return value, failing fast if the worker died."""
        deadline = time.monotonic() + self.result_timeout
        while True:
            try:
                return result.get(timeout=1, propagate=propagate)
            except CeleryTimeoutError:
                assert self.process is not None
                if self.process.poll() is not None:
                    pytest.fail(f"The Celery worker exited:\n{self.log.read_text()[-5000:]}")
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"No result within {self.result_timeout}s. Worker log:\n"
                        f"{self.log.read_text()[-5000:]}"
                    )

    def runs(self, label: str) -> int:
        """How many times a body called ``checkpoint(label)``."""
        started = self.task_dir / f"{label}.started"
        return len(started.read_text().splitlines()) if started.exists() else 0


def new_worker(broker: str, database: str, directory: Path, **options: Any) -> WorkerProcess:
    """A worker (not started yet) on a queue of its own, its files in ``directory``."""
    queue = f"django-idempotency-tasks-{uuid.uuid4().hex}"
    task_dir = directory / "bodies"
    task_dir.mkdir(exist_ok=True)
    log = directory / f"{queue}.log"
    return WorkerProcess(broker, queue, database, task_dir, log, **options)


@contextmanager
def running_worker(directory: Path, **options: Any) -> Iterator[WorkerProcess]:
    """A started worker on the test database, its queue the one the tests publish to."""
    from django.db import connection

    worker = new_worker(find_broker(), str(connection.settings_dict["NAME"]), directory, **options)
    with publishing_to(worker):
        yield worker.start()


@contextmanager
def publishing_to(worker: WorkerProcess) -> Iterator[WorkerProcess]:
    """Make the tests' Celery app publish to the worker's queue; stop the worker after."""
    previous = current_app._get_current_object()
    celery_app.make_app(worker.broker, worker.queue).set_current()
    try:
        yield worker
    finally:
        worker.stop()
        previous.set_current()
