"""Playing one cell of the endings table (``tests/test_endings.py``) on a real server or worker.

A cell is one adapter, one ending and one mode, under a key of its own. Its
:meth:`~Cell.play` sends the first request (or publishes the first message)
and makes it end the cell's way: the handler answers, raises, holds while
the client disconnects, the worker is killed, or its database connection is
killed. After that the table's checks ask the same questions of every cell:
what the first attempt got, what a retry gets (:meth:`~Cell.again`), how
many times the handler ran (a file the handler appends to, outside the
database), how many of its rows committed, and what the record says.
"""

from __future__ import annotations

import ast
import contextlib
import json
import re
import select
import socket
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlencode

import requests
from celery import states
from celery.result import AsyncResult

from django_idempotency.models import IdempotencyKey
from tests import endings_function, endings_tasks
from tests.celery_worker import WorkerProcess
from tests.databases import kill_connection
from tests.models import Order
from tests.polling import in_background, wait_until
from tests.server import ROOT, GunicornServer, kill9, wait_for_exit, wait_for_file

#: A function's answer when the package would not run its body alongside the original.
IN_FLIGHT = "IN_FLIGHT"
#: How long a retry keeps asking while the original is still in flight.
SETTLE_LIMIT = 15.0
REQUEST_TIMEOUT = 15.0
#: Seconds a protected call may take in a caller process.
CALL_LIMIT = 25.0  # past a hold's own limit (HOLD_LIMIT), inside in_background's
#: What a browser asks for when it submits a form: HTML first.
BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


@dataclass(frozen=True)
class Answer:
    """What one attempt got back: an HTTP response, or a task's final state and value."""

    status: int | str
    body: bytes | None = None
    #: HTTP: the replay header said so. Tasks cannot tell (``None``).
    replayed: bool | None = None
    retry_after: str | None = None


@dataclass
class Cell:
    """One adapter x ending x mode, under ``key``; subclasses know their server."""

    key: str
    ending: str
    atomic: bool
    #: Where the handler's files are: its runs, its reports, the go-ahead.
    control: Path
    #: The first attempt's answer; ``None`` when it never got one (disconnect, kill).
    first: Answer | None = field(default=None, init=False)
    #: The framework ran the handler again by itself (Celery's retry, a requeue).
    retried_by_framework: bool = field(default=False, init=False)
    #: Seconds a dead owner's claim holds: the lease its handler's protection was given.
    lease_seconds: ClassVar[float]

    @property
    def tells_retry_after(self) -> bool:
        """Whether an answer that the original is still in flight says when to come back."""
        return True

    def play(self) -> None:
        raise NotImplementedError

    def again(self, *, settle: bool = False) -> Answer:
        """A retry of the same work; with ``settle``, past answers that it is still in flight."""
        raise NotImplementedError

    # What the handler left behind.

    def runs(self) -> list[float]:
        """When each run of the handler started (epoch seconds)."""
        path = self.control / f"{self.key}.runs"
        if not path.exists():
            return []
        return [float(line.split()[1]) for line in path.read_text().splitlines()]

    def rows(self) -> int:
        return Order.objects.filter(item=self.key).count()

    def record(self) -> IdempotencyKey | None:
        return IdempotencyKey.objects.filter(key=self.key).first()

    def go(self) -> None:
        (self.control / f"{self.key}.go").touch()

    def held_report(self, what: str = "held") -> dict[str, Any]:
        return wait_for_file(self.control / f"{self.key}.{what}")


@dataclass
class HttpCell(Cell):
    """A cell on gunicorn or uvicorn: the views under ``path`` (tests/endings_views.py)."""

    lease_seconds = 2  # the servers' LEASE (tests/endings_settings.py)

    server: GunicornServer = field(kw_only=True)
    path: str = field(kw_only=True)
    #: The server tells the application that a client went away (ASGI does, WSGI cannot).
    notices_disconnect: bool = field(kw_only=True)
    #: Sent as a browser sends a form: the key in its field, no header (SPEC 9).
    form: bool = field(kw_only=True, default=False)

    @property
    def target(self) -> str:
        return f"{self.path}{'atomic' if self.atomic else 'lease'}/?ending={self.ending}"

    def request(self) -> tuple[bytes, dict[str, str]]:
        """The body and headers of one attempt: JSON and the header, or a browser's form.

        A browser's form carries the key in its field and a CSRF token masked
        afresh at every render, and asks for HTML.
        """
        if not self.form:
            body = json.dumps({"key": self.key}).encode()
            return body, {"Content-Type": "application/json", "Idempotency-Key": self.key}
        fields = {"idempotency_key": self.key, "csrfmiddlewaretoken": uuid.uuid4().hex}
        headers = {
            "Content-Type": "application/x-www-form-urlencoded",
            "Accept": BROWSER_ACCEPT,
            # Not the key's header: it names the cell for tests/endings_asgi.py's reports.
            "X-Endings-Cell": self.key,
        }
        return urlencode(fields).encode(), headers

    def send(self) -> Answer:
        body, headers = self.request()
        response = requests.post(
            self.server.url + self.target, data=body, headers=headers, timeout=REQUEST_TIMEOUT
        )
        return Answer(
            response.status_code,
            response.content,
            response.headers.get("Idempotent-Replayed") == "true",
            response.headers.get("Retry-After"),
        )

    def again(self, *, settle: bool = False) -> Answer:
        if not settle:
            return self.send()
        answers: list[Answer] = []

        def answered() -> bool:
            answers.append(self.send())
            return answers[-1].status != 409

        wait_until(answered, f"{self.key} to be out of flight", SETTLE_LIMIT)
        return answers[-1]

    def play(self) -> None:
        if self.ending in ("disconnect_before", "disconnect_after"):
            self._disconnect()
        elif self.ending == "kill9":
            self._kill_worker()
        elif self.ending == "db_kill_mid":
            self._kill_connection()
        else:
            self.first = self.send()

    def _disconnect(self) -> None:
        """Close the client's socket while the handler holds, or while its response renders."""
        client = self._open_request()
        try:
            self.held_report("held" if self.ending == "disconnect_before" else "rendering")
        finally:
            client.close()
        if self.notices_disconnect:
            # Let the disconnect reach the application before the handler may go on.
            disconnected = self.control / f"{self.key}.disconnected"
            wait_until(disconnected.exists, f"the server to see {self.key}'s client go", 10)
        self.go()

    def _open_request(self) -> socket.socket:
        body, headers = self.request()
        lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        head = (
            f"POST {self.target} HTTP/1.1\r\n"
            f"Host: 127.0.0.1:{self.server.port}\r\n"
            f"Content-Length: {len(body)}\r\n"
            f"{lines}\r\n"
        )
        client = socket.create_connection(("127.0.0.1", self.server.port), timeout=10)
        client.sendall(head.encode() + body)
        return client

    def _kill_worker(self) -> None:
        doomed = in_background(self.send)
        pid = self.held_report()["pid"]
        kill9(pid)
        try:
            doomed()
        except requests.ConnectionError:
            pass
        else:
            raise AssertionError(f"the killed worker {pid} answered")
        wait_for_exit(pid)
        self.go()

    def _kill_connection(self) -> None:
        first = in_background(self.send)
        kill_connection(self.held_report()["connection"])
        self.go()
        self.first = first()


@dataclass
class TaskCell(Cell):
    """A cell on a real Celery worker: ``tests.endings_tasks``, published by the test."""

    lease_seconds = endings_tasks.LEASE_SECONDS
    worker: WorkerProcess = field(kw_only=True)
    results: list[AsyncResult] = field(default_factory=list, init=False)

    @property
    def task(self) -> Any:
        return endings_tasks.endings_atomic if self.atomic else endings_tasks.endings_lease

    def publish(self) -> AsyncResult:
        result = self.task.apply_async(args=[self.key, self.ending])
        self.results.append(result)
        return result

    def finish(self, result: AsyncResult, *, may_be_ignored: bool = True) -> Answer:
        """The message's final state: a stored result, or the worker's log that it was ignored.

        A replaced task is logged as ignored before its replacement, which
        takes over its id, stores the result: that one is waited for.
        """
        ignored = f"[{result.id}] ignored"

        def done() -> bool:
            if result.state in states.READY_STATES:
                return True
            return may_be_ignored and ignored in self.log()

        wait_until(done, f"task {result.id} to finish", 60)
        if result.state not in states.READY_STATES:
            return Answer("IGNORED")
        if result.state != states.SUCCESS:
            return Answer(result.state)
        return Answer(states.SUCCESS, json.dumps(result.result, sort_keys=True).encode())

    def log(self) -> str:
        return self.worker.log.read_text()

    def again(self, *, settle: bool = False) -> Answer:
        # A task never answers "in flight": the duplicate retries until it can finish.
        return self.finish(self.publish())

    def play(self) -> None:
        result = self.publish()
        if self.ending == "kill9":
            pid = self.held_report()["pid"]
            kill9(pid)
            wait_for_exit(pid)
            self.go()
        elif self.ending == "db_kill_mid":
            kill_connection(self.held_report()["connection"])
            self.go()
        self.retried_by_framework = self.ending in ("retry", "reject")
        if self.retried_by_framework:
            self.first = self.logged_success(result)
        else:
            self.first = self.finish(result, may_be_ignored=self.ending != "replace")

    def logged_success(self, result: AsyncResult) -> Answer:
        """The value of the run of ``result`` that succeeded, as the worker logged it.

        A body that Celery runs again by itself (``self.retry()``, a message
        rejected back onto the queue) keeps its task id, and Celery writes
        the first run's state (``RETRY``) after it has published the second
        run: with more than one worker process, the second run's ``SUCCESS``
        can reach the result backend first and be overwritten, so the
        backend is no witness of how the task ended. The worker's log line
        for the successful run is, and it carries the value.
        """
        succeeded = re.compile(rf"\[{re.escape(result.id)}\] succeeded in \S+s: (.*)$", re.M)
        found: list[str] = []

        def logged() -> bool:
            found[:] = succeeded.findall(self.log())
            return bool(found)

        wait_until(logged, f"the worker to log that task {result.id} succeeded", 60)
        value = ast.literal_eval(found[-1])
        return Answer(states.SUCCESS, json.dumps(value, sort_keys=True).encode())

    def replacements(self) -> int:
        path = self.control / f"{self.key}.replacement"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def retried_in_flight(self, result: AsyncResult) -> bool:
        """Whether the worker put this message off while the key was in flight."""
        put_off = re.compile(rf"\[{re.escape(result.id)}\] retry: .*TaskInFlight")
        return put_off.search(self.log()) is not None


class CallerProcesses:
    """Processes that make protected calls (``tests/endings_function.py``), started once.

    A call takes an idle one (a spare has already set Django up); one killed
    mid-call (the ``kill9`` ending) is dropped, and another starts in its
    place. Each writes its standard error to a log of its own.
    """

    SPARES = 2

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.lock = threading.Lock()
        self.started: list[tuple[subprocess.Popen[bytes], Path]] = []
        self.idle = [self.start() for _ in range(self.SPARES)]

    def start(self) -> subprocess.Popen[bytes]:
        log = self.logs / f"caller-{len(self.started)}.log"
        with log.open("wb") as errors:
            process = subprocess.Popen(
                [sys.executable, "-m", "tests.endings_function"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errors,
                env=self.env,
                cwd=ROOT,
            )
        self.started.append((process, log))
        return process

    def call(self, **asked: str) -> dict[str, Any] | None:
        """One call's outcome; ``None`` when its process was killed before it answered."""
        with self.lock:
            process = self.idle.pop(0) if self.idle else self.start()
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(json.dumps(asked).encode() + b"\n")
        process.stdin.flush()
        ready, _, _ = select.select([process.stdout], [], [], CALL_LIMIT)
        if not ready:
            self.replace(process)
            raise AssertionError(f"a call took over {CALL_LIMIT} s: {self.errors(process)}")
        line = process.stdout.readline()
        if line:
            answer = json.loads(line)
            assert answer.pop("key") == asked["key"], f"another call's answer: {line!r}"
            with self.lock:
                self.idle.append(process)
            return answer
        code = process.wait(timeout=CALL_LIMIT)
        self.replace(process)
        assert code == -9, f"a caller ended with {code}: {self.errors(process)}"
        return None

    def replace(self, process: subprocess.Popen[bytes]) -> None:
        """Start a caller in place of one killed or stuck (which is killed)."""
        if process.poll() is None:
            process.kill()
            process.wait()
        with self.lock:
            self.idle.append(self.start())

    def errors(self, process: subprocess.Popen[bytes]) -> str:
        [log] = [log for started, log in self.started if started is process]
        return log.read_text()[-3000:]

    def close(self) -> None:
        """Ends every caller: a closed standard input is its signal to stop."""
        for process, _ in self.started:
            assert process.stdin is not None and process.stdout is not None
            with contextlib.suppress(BrokenPipeError):
                process.stdin.close()
        for process, _ in self.started:
            try:
                process.wait(timeout=CALL_LIMIT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            assert process.stdout is not None
            process.stdout.close()


@dataclass
class FunctionCell(Cell):
    """A cell of a protected call (``tests/endings_function.py``'s ``CALLERS``) from a process.

    The call's outcome is ``SUCCESS`` and the value, ``FAILURE``, or
    ``IN_FLIGHT`` and its ``retry_after``, which a task enqueued on Django's
    Tasks framework is not told (its result keeps the error's class only).
    """

    lease_seconds = endings_function.LEASE_SECONDS
    caller: str = field(kw_only=True)
    callers: CallerProcesses = field(kw_only=True)

    @property
    def tells_retry_after(self) -> bool:
        return self.caller != "django_task_enqueue"

    def call(self) -> Answer | None:
        """One call; ``None`` when its process was killed before it answered."""
        mode = "atomic" if self.atomic else "lease"
        outcome = self.callers.call(caller=self.caller, key=self.key, ending=self.ending, mode=mode)
        if outcome is None:
            return None
        body = None
        if outcome["status"] == states.SUCCESS:
            body = json.dumps(outcome["value"], sort_keys=True).encode()
        retry_after = outcome.get("retry_after")
        return Answer(
            outcome["status"], body, None, None if retry_after is None else str(retry_after)
        )

    def again(self, *, settle: bool = False) -> Answer:
        answers: list[Answer | None] = []

        def answered() -> bool:
            answers.append(self.call())
            return not settle or (answers[-1] is not None and answers[-1].status != IN_FLIGHT)

        wait_until(answered, f"{self.key} to be out of flight", SETTLE_LIMIT)
        answer = answers[-1]
        assert answer is not None
        return answer

    def play(self) -> None:
        if self.ending == "kill9":
            doomed = in_background(self.call)
            pid = self.held_report()["pid"]
            kill9(pid)
            assert doomed() is None, f"the killed process {pid} answered"
            self.go()
        elif self.ending == "db_kill_mid":
            first = in_background(self.call)
            kill_connection(self.held_report()["connection"])
            self.go()
            self.first = first()
        else:
            self.first = self.call()
