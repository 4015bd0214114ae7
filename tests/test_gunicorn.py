"""Real HTTP against real gunicorn worker processes sharing the test database.

Threads in one process cannot show what several app instances do; these
tests start gunicorn with four sync workers and race duplicates across
them. A worker killed mid-handler is in ``test_crashes.py``.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token

from django_idempotency.models import IdempotencyKey
from tests.models import Order
from tests.server import GunicornServer
from tests.server_fixtures import (  # noqa: F401  fixtures used by name
    SERVER_TESTS,
    control_dir_fixture,
    gunicorn_fixture,
)

pytestmark = SERVER_TESTS

KEYS = 200
DUPLICATES = 5
CLIENT_THREADS = 20
REQUEST_TIMEOUT = 30
State = IdempotencyKey.State


@pytest.fixture
def token() -> str:
    user = User.objects.create_user("load")
    return Token.objects.create(user=user).key


class LoadTests:
    def test_duplicates_across_workers_run_once(self, gunicorn: GunicornServer, token: str) -> None:
        url = f"{gunicorn.url}/drf/orders/"
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
        assert dict(statuses) == {201: KEYS * DUPLICATES}, gunicorn.log()
        for index, answers in by_key.items():
            assert [replayed for _, replayed in answers].count(False) == 1, index
            assert len({content for content, _ in answers}) == 1, index
        assert Order.objects.count() == KEYS
        assert sorted(Order.objects.values_list("item", flat=True)) == sorted(
            f"item-{index}" for index in range(KEYS)
        )
        assert IdempotencyKey.objects.count() == KEYS
        assert not IdempotencyKey.objects.exclude(state=State.COMPLETED).exists()
        assert len(gunicorn.answering_pids()) > 1, "every request went to one worker"
        assert elapsed < 120
