"""Async views and the middleware over real HTTP, under uvicorn worker processes.

Four workers race duplicates against the async ORM, and one worker shows
that duplicates waiting for an in-flight original never hold up its event
loop. A worker killed mid-handler is in ``test_crashes.py``.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from django_idempotency.models import IdempotencyKey
from tests.clients import http_post
from tests.databases import claims_waiting
from tests.models import Order
from tests.polling import in_background, wait_until
from tests.server import GunicornServer, UvicornServer, wait_for_file
from tests.server_fixtures import (  # noqa: F401  fixtures used by name
    SERVER_TESTS,
    control_dir_fixture,
    controlled,
    uvicorn_fixture,
)

pytestmark = SERVER_TESTS

#: How long the in-flight original is held, in seconds.
HOLD = 2.0
WAITING_DUPLICATES = 20
KEYS = 100
DUPLICATES = 10
CLIENT_THREADS = 20
REQUEST_TIMEOUT = 30
State = IdempotencyKey.State


@pytest.fixture(scope="module")
def one_worker(
    django_db_setup: None, control_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GunicornServer]:
    """One worker, one event loop: what waits there waits next to everything else."""
    settings = "tests.asgi_settings"
    with controlled(UvicornServer, settings, control_dir, tmp_path_factory, workers=1) as uvicorn:
        yield uvicorn


@pytest.mark.parametrize(
    "path", ["/async/orders/", "/async/orders/plain/"], ids=["decorator", "middleware"]
)
def test_duplicates_across_workers_run_once(uvicorn: UvicornServer, path: str) -> None:
    url = uvicorn.url + path
    sessions: dict[int, requests.Session] = {}

    def send(index: int) -> tuple[int, int, bytes, dict[str, str]]:
        session = sessions.setdefault(threading.get_ident(), requests.Session())
        response = session.post(
            url,
            json={"item": f"item-{index}"},
            # A new connection per request, so that duplicates spread over the workers.
            headers={"Idempotency-Key": f"load-{index}", "Connection": "close"},
            timeout=REQUEST_TIMEOUT,
        )
        return index, response.status_code, response.content, dict(response.headers)

    # Duplicates of one key are submitted next to each other, so that they
    # are in flight at the same time on different workers.
    jobs = [index for index in range(KEYS) for _ in range(DUPLICATES)]
    with ThreadPoolExecutor(max_workers=CLIENT_THREADS) as pool:
        results = list(pool.map(send, jobs))

    statuses: dict[int, int] = defaultdict(int)
    by_key: dict[int, list[tuple[int, bytes, dict[str, str]]]] = defaultdict(list)
    for index, status, content, headers in results:
        statuses[status] += 1
        by_key[index].append((status, content, headers))
    assert set(statuses) <= {201, 409}, (dict(statuses), uvicorn.log())
    pids = set()
    for index, answers in by_key.items():
        created = [(c, h) for s, c, h in answers if s == 201]
        originals = [c for c, h in created if h.get("Idempotent-Replayed") != "true"]
        assert len(originals) == 1, index
        assert {c for c, _ in created} == {originals[0]}, index
        for status, _, headers in answers:
            if status == 409:
                assert int(headers["Retry-After"]) >= 1
        pids.add(json.loads(originals[0])["pid"])
    # One order and one audit row per key: the async ORM and sync_to_async both ran once.
    assert Order.objects.count() == 2 * KEYS
    assert sorted(
        Order.objects.exclude(item__startswith="audit:").values_list("item", flat=True)
    ) == sorted(f"item-{index}" for index in range(KEYS))
    assert IdempotencyKey.objects.filter(state=State.COMPLETED).count() == KEYS
    assert IdempotencyKey.objects.count() == KEYS
    assert len(pids) > 1, "every key was first run by one worker"


def test_handler_that_raises_leaves_nothing_and_the_retry_runs_once(uvicorn: UvicornServer) -> None:
    url = f"{uvicorn.url}/async/orders/"
    failed = http_post(url, {"item": "doomed", "raise": True}, "raises")
    assert failed.status_code == 500
    assert Order.objects.count() == 0
    assert IdempotencyKey.objects.count() == 0

    retry = http_post(url, {"item": "doomed"}, "raises")
    assert retry.status_code == 201, retry.text
    again = http_post(url, {"item": "doomed"}, "raises")
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == retry.content
    assert Order.objects.count() == 2  # the order and its audit row, once


def test_waiting_duplicates_do_not_hold_up_the_event_loop(
    one_worker: UvicornServer, control_dir: Path
) -> None:
    key = "async-in-flight"
    url = f"{one_worker.url}/async/orders/?wait_for_go=1"
    original = in_background(lambda: http_post(url, {"item": "held"}, key))
    report = wait_for_file(control_dir / f"{key}.pid")
    (control_dir / f"{key}.pid").unlink()
    held_since = time.monotonic()

    with ThreadPoolExecutor(max_workers=WAITING_DUPLICATES) as pool:
        duplicates = [
            pool.submit(http_post, url, {"item": "held"}, key) for _ in range(WAITING_DUPLICATES)
        ]
        wait_until(
            lambda: claims_waiting() >= WAITING_DUPLICATES,
            "the duplicates to wait for the original's row lock",
            limit=10,
        )
        latencies: list[float] = []
        # Ping for as long as the original is held (at least HOLD seconds).
        while len(latencies) < 20 or time.monotonic() - held_since < HOLD:
            started = time.monotonic()
            ping = requests.get(f"{one_worker.url}/async/ping/", timeout=5)
            latencies.append(time.monotonic() - started)
            assert ping.json()["pid"] == report["pid"]
        assert not any(future.done() for future in duplicates), "the duplicates did not wait"
        (control_dir / f"{key}.go").touch()
        first = original()
        held_for = time.monotonic() - held_since
        answers = [future.result() for future in duplicates]

    assert first.status_code == 201
    for answer in answers:
        assert answer.status_code == 201, answer.text
        assert answer.headers["Idempotent-Replayed"] == "true"
        assert answer.content == first.content
    # Every unrelated request was answered in a small fraction of the time the
    # original was held, while twenty duplicates waited on the same worker.
    assert held_for >= HOLD
    assert max(latencies) < held_for / 5, latencies
    assert Order.objects.count() == 2
