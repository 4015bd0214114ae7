"""Sections 2, 3 and 5: a bounded HTTP load generator against a local gunicorn or uvicorn.

Every loop here is bounded twice, by a request count and by a deadline, and
sends traffic only to the local server it started.
"""

from __future__ import annotations

import http.client
import itertools
import json
import math
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.bench.views import NONCE_HEADER
from benchmarks.statements import BODY
from tests.server import GunicornServer, UvicornServer

REQUEST_TIMEOUT = 30.0
PAYLOAD = json.dumps(BODY).encode()


class BenchServer(GunicornServer):
    """The test suite's gunicorn (4 sync workers) on the bench settings, without an access log.

    The access log writes a line per request, which is noise here.
    """

    def __init__(self, env: dict[str, str]) -> None:
        self._log_dir = tempfile.TemporaryDirectory(prefix="bench-gunicorn-")
        super().__init__(
            {**env, "DJANGO_SETTINGS_MODULE": "benchmarks.bench.settings"}, Path(self._log_dir.name)
        )

    def command(self) -> list[str]:
        command = super().command()
        for option in ("--access-logfile", "--access-logformat"):
            index = command.index(option)
            del command[index : index + 2]
        return command

    def stop(self) -> None:
        super().stop()
        self._log_dir.cleanup()


class BenchAsgiServer(UvicornServer):
    """The test suite's uvicorn (4 workers) on the bench settings, with pooled connections."""

    def __init__(self, env: dict[str, str]) -> None:
        self._log_dir = tempfile.TemporaryDirectory(prefix="bench-uvicorn-")
        super().__init__(
            {**env, "DJANGO_SETTINGS_MODULE": "benchmarks.bench.settings", "BENCH_ASGI": "1"},
            Path(self._log_dir.name),
        )

    def stop(self) -> None:
        super().stop()
        self._log_dir.cleanup()


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: a latency some request really had."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def post(
    connection: http.client.HTTPConnection, path: str, key: str, nonce: str, close: bool = False
) -> int:
    """One POST; 0 when the connection failed (counted, never retried)."""
    headers = {"Content-Type": "application/json", "Idempotency-Key": key, NONCE_HEADER: nonce}
    if close:
        headers["Connection"] = "close"
    try:
        connection.request("POST", path, body=PAYLOAD, headers=headers)
        response = connection.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        connection.close()
        return 0


@dataclass
class LoadRun:
    """One timed run of ``count`` requests."""

    seconds: float
    latencies: list[float]
    statuses: Counter = field(default_factory=Counter)

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.seconds

    @property
    def failures(self) -> int:
        return sum(n for status, n in self.statuses.items() if status == 0 or status >= 500)


def hammer(
    port: int,
    path: str,
    keys: Sequence[str],
    threads: int,
    deadline: float,
    close: bool = False,
) -> LoadRun:
    """Send one request per key from ``threads`` threads, as fast as the server answers.

    Sync gunicorn workers close each connection after answering;
    ``http.client`` then opens a new one for the next request, as a client
    of such a server would. ``close`` asks a keep-alive server (uvicorn) to
    do the same, so that both servers are measured alike.
    """
    order = iter(range(len(keys)))
    lock = threading.Lock()
    latencies: list[float] = []
    statuses: Counter = Counter()

    def work() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT)
        mine: list[float] = []
        seen: Counter = Counter()
        try:
            while time.monotonic() < deadline:
                with lock:
                    index = next(order, None)
                if index is None:
                    break
                started = time.perf_counter()
                status = post(connection, path, keys[index], uuid.uuid4().hex, close)
                if close:
                    connection.close()
                mine.append(time.perf_counter() - started)
                seen[status] += 1
        finally:
            connection.close()
            with lock:
                latencies.extend(mine)
                statuses.update(seen)

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for future in [pool.submit(work) for _ in range(threads)]:
            future.result()
    return LoadRun(time.perf_counter() - started, latencies, statuses)


def new_keys(count: int) -> list[str]:
    return [str(uuid.uuid4()) for _ in range(count)]


def cycle(keys: Sequence[str], count: int) -> list[str]:
    return list(itertools.islice(itertools.cycle(keys), count))


@dataclass
class Storm:
    """``duplicates`` simultaneous requests with one key: who answered what, how fast."""

    key: str
    #: nonce -> (status, latency in seconds)
    answers: dict[str, tuple[int, float]]


def storm(
    pool: ThreadPoolExecutor, port: int, path: str, duplicates: int, deadline: float
) -> Storm:
    """Release ``duplicates`` requests with one key at the same instant.

    A barrier, not a sleep, lines the threads up; each opens its connection
    before the barrier so that the requests leave together.
    """
    key = str(uuid.uuid4())
    barrier = threading.Barrier(duplicates)
    timeout = max(1.0, deadline - time.monotonic())

    def one(nonce: str) -> tuple[str, int, float]:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT)
        try:
            connection.connect()
            barrier.wait(timeout=timeout)
            started = time.perf_counter()
            status = post(connection, path, key, nonce)
            return nonce, status, time.perf_counter() - started
        except (OSError, threading.BrokenBarrierError):
            return nonce, 0, math.nan
        finally:
            connection.close()

    futures = [pool.submit(one, uuid.uuid4().hex) for _ in range(duplicates)]
    answers = {}
    for future in futures:
        nonce, status, latency = future.result()
        answers[nonce] = (status, latency)
    return Storm(key, answers)
