"""Real HTTP against real gunicorn worker processes sharing the test database.

Threads in one process cannot show what several app instances do, nor what
a crash leaves behind; these tests start gunicorn with four sync workers,
race duplicates across them, and ``kill -9`` a worker mid-handler.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
from django.contrib.auth.models import User
from django.db import connections
from django.utils import timezone
from rest_framework.authtoken.models import Token

from django_idempotency import store
from django_idempotency.models import IdempotencyKey
from tests.drf_views import CONTROL_DIR_ENV
from tests.models import Order
from tests.polling import in_background, wait_until
from tests.server import DATABASE_NAME_ENV, GunicornServer
from tests.settings import BACKEND

pytestmark = [pytest.mark.server, pytest.mark.django_db(transaction=True)]

if BACKEND == "sqlite":
    pytestmark.append(
        pytest.mark.skip(
            reason=(
                "multi-process gunicorn tests run on the server backends (PostgreSQL, "
                "MariaDB); SQLite is the embedded single-host backend"
            )
        )
    )

KEYS = 200
DUPLICATES = 5
CLIENT_THREADS = 20
REQUEST_TIMEOUT = 30
State = IdempotencyKey.State


@pytest.fixture(scope="module")
def control_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("control")


@pytest.fixture(scope="module")
def server(
    django_db_setup: None, control_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GunicornServer]:
    """Gunicorn on a free port, on the database pytest-django created for this run."""
    name = connections["default"].settings_dict["NAME"]
    gunicorn = GunicornServer(
        {
            "DJANGO_SETTINGS_MODULE": "tests.server_settings",
            DATABASE_NAME_ENV: name,
            CONTROL_DIR_ENV: str(control_dir),
        },
        tmp_path_factory.mktemp("gunicorn"),
    )
    with gunicorn:
        yield gunicorn


@pytest.fixture
def token() -> str:
    user = User.objects.create_user("load")
    return Token.objects.create(user=user).key


def wait_for_file(path: Path, limit: float = 15) -> dict[str, Any]:
    wait_until(path.exists, f"{path.name} to appear", limit)
    return json.loads(path.read_text())


def wait_for_exit(pid: int, limit: float = 10) -> None:
    """Wait until the killed worker is gone (reaped by the gunicorn master)."""
    wait_until(lambda: not Path(f"/proc/{pid}").exists(), f"worker {pid} to exit", limit)


class LoadTests:
    def test_duplicates_across_workers_run_once(self, server: GunicornServer, token: str) -> None:
        url = f"{server.url}/drf/orders/"
        local = threading.local()

        def send(index: int) -> tuple[int, int, bytes, bool]:
            session = getattr(local, "session", None)
            if session is None:
                session = local.session = requests.Session()
            response = session.post(
                url,
                json={"item": f"item-{index}", "quantity": 1},
                headers={"Authorization": f"Token {token}", "Idempotency-Key": f"load-{index}"},
                timeout=REQUEST_TIMEOUT,
            )
            replayed = response.headers.get("Idempotent-Replayed") == "true"
            return index, response.status_code, response.content, replayed

        # Duplicates of one key are submitted next to each other, so that they
        # are in flight at the same time on different workers.
        jobs = [index for index in range(KEYS) for _ in range(DUPLICATES)]
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=CLIENT_THREADS) as pool:
            results = list(pool.map(send, jobs))
        elapsed = time.monotonic() - started

        statuses = defaultdict(int)
        by_key: dict[int, list[tuple[bytes, bool]]] = defaultdict(list)
        for index, status, content, replayed in results:
            statuses[status] += 1
            by_key[index].append((content, replayed))
        assert dict(statuses) == {201: KEYS * DUPLICATES}, server.log()
        for index, answers in by_key.items():
            assert [replayed for _, replayed in answers].count(False) == 1, index
            assert len({content for content, _ in answers}) == 1, index
        assert Order.objects.count() == KEYS
        assert sorted(Order.objects.values_list("item", flat=True)) == sorted(
            f"item-{index}" for index in range(KEYS)
        )
        assert IdempotencyKey.objects.count() == KEYS
        assert not IdempotencyKey.objects.exclude(state=State.COMPLETED).exists()
        assert len(server.answering_pids()) > 1, "every request went to one worker"
        assert elapsed < 120


class CrashTests:
    def test_kill_in_atomic_handler_leaves_nothing_and_retry_runs_once(
        self, server: GunicornServer, control_dir: Path
    ) -> None:
        key = "crash-atomic"
        url = f"{server.url}/drf/hold/"

        def send() -> requests.Response:
            return requests.post(
                url, json={"item": "held"}, headers={"Idempotency-Key": key}, timeout=15
            )

        doomed = in_background(send, limit=REQUEST_TIMEOUT + 5)
        report = wait_for_file(control_dir / f"{key}.pid")
        # The handler has written its Order, inside the transaction that holds the claim.
        assert Order.objects.count() == 0
        assert IdempotencyKey.objects.count() == 0
        (control_dir / f"{key}.pid").unlink()
        os.kill(report["pid"], signal.SIGKILL)
        with pytest.raises(requests.ConnectionError):
            doomed()
        wait_for_exit(report["pid"])
        assert Order.objects.count() == 0
        assert IdempotencyKey.objects.count() == 0

        (control_dir / f"{key}.go").touch()
        retry = send()
        assert retry.status_code == 201, retry.text
        assert "Idempotent-Replayed" not in retry.headers
        assert Order.objects.count() == 1
        record = IdempotencyKey.objects.get()
        assert record.state == State.COMPLETED
        again = send()
        assert again.status_code == 201
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.content == retry.content
        assert Order.objects.count() == 1

    def test_kill_in_lease_handler_is_taken_over_after_the_lease(
        self, server: GunicornServer, control_dir: Path
    ) -> None:
        key = "crash-lease"
        url = f"{server.url}/drf/lease-hold/"

        def send() -> requests.Response:
            return requests.post(
                url, json={"item": "held"}, headers={"Idempotency-Key": key}, timeout=15
            )

        doomed = in_background(send, limit=REQUEST_TIMEOUT + 5)
        report = wait_for_file(control_dir / f"{key}.pid")
        (control_dir / f"{key}.pid").unlink()
        # Lease mode: the claim and the effect are committed while the handler runs.
        held = IdempotencyKey.objects.get()
        assert held.state == State.IN_PROGRESS
        assert held.locked_until is not None
        assert Order.objects.count() == 1
        assert held.locked_until - timezone.now() > timedelta(seconds=1)

        before_kill = send()
        assert before_kill.status_code == 409
        assert before_kill.headers["Retry-After"] in ("1", "2")
        os.kill(report["pid"], signal.SIGKILL)
        with pytest.raises(requests.ConnectionError):
            doomed()
        wait_for_exit(report["pid"])

        if timezone.now() < held.locked_until - timedelta(milliseconds=300):
            after_kill = send()
            assert after_kill.status_code == 409
            assert int(after_kill.headers["Retry-After"]) >= 1
        # Nobody released the dead owner's claim: it waits for its lease to run out.
        assert IdempotencyKey.objects.get().owner_token == held.owner_token

        while timezone.now() <= held.locked_until:
            time.sleep(0.05)
        (control_dir / f"{key}.go").touch()
        takeover = send()
        assert takeover.status_code == 201, takeover.text
        assert "Idempotent-Replayed" not in takeover.headers
        assert takeover.json()["payment"] == report["payment"]
        record = IdempotencyKey.objects.get()
        assert record.pk == held.pk
        assert record.owner_token != held.owner_token
        assert record.state == State.COMPLETED
        assert bytes(record.response_body) == takeover.content

        # The dead owner's token can neither overwrite nor delete the new record.
        assert not store.complete(
            "default",
            held.pk,
            owner_token=held.owner_token,
            status_code=500,
            headers=[],
            body=b"stale",
            expires_at=timezone.now() + timedelta(days=9),
        )
        assert not store.release("default", held.pk, held.owner_token)
        assert bytes(IdempotencyKey.objects.get().response_body) == takeover.content

        replay = send()
        assert replay.status_code == 201
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert replay.content == takeover.content
        # The handler ran twice (that is lease mode); derive() kept the remote key.
        assert Order.objects.count() == 2
