"""Real HTTP against real gunicorn worker processes sharing the test database.

Threads in one process cannot show what several app instances do; these
tests start gunicorn with four sync workers and race duplicates across
them. A worker killed mid-handler is in ``test_crashes.py``. Gunicorn is
also the server that joins repeated header lines, as WSGI servers do.
"""

from __future__ import annotations

import http.client
import json
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


class RepeatedHeaderTests:
    """Two ``Idempotency-Key`` lines reach Django joined (``k-a,k-b``): never one key."""

    @staticmethod
    def send(gunicorn: GunicornServer, keys: list[str]) -> tuple[int, str, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", gunicorn.port, timeout=REQUEST_TIMEOUT)
        body = json.dumps({"item": "book"}).encode()
        try:
            connection.putrequest("POST", "/orders/")
            connection.putheader("Content-Type", "application/json")
            connection.putheader("Content-Length", str(len(body)))
            for key in keys:
                connection.putheader("Idempotency-Key", key)
            connection.endheaders(body)
            response = connection.getresponse()
            return response.status, response.getheader("Content-Type", ""), response.read()
        finally:
            connection.close()

    def test_two_key_headers_are_refused_and_run_nothing(self, gunicorn: GunicornServer) -> None:
        status, content_type, body = self.send(gunicorn, ["k-a", "k-b"])

        assert status == 400, gunicorn.log()
        assert content_type == "application/problem+json"
        assert "more than one Idempotency-Key header" in json.loads(body)["detail"]
        assert not Order.objects.exists()
        assert not IdempotencyKey.objects.exists()

        status, _, _ = self.send(gunicorn, ["k-a"])
        assert status == 201
        assert list(IdempotencyKey.objects.values_list("key", flat=True)) == ["k-a"]

    def test_one_quoted_key_with_a_comma_is_one_key(self, gunicorn: GunicornServer) -> None:
        status, _, _ = self.send(gunicorn, ['"k-a,k-b"'])

        assert status == 201, gunicorn.log()
        assert list(IdempotencyKey.objects.values_list("key", flat=True)) == ["k-a,k-b"]


class UnstorableResponseTests:
    """Lease mode: a response that fails to render after the view acted, on real workers."""

    def test_every_retry_gets_the_refusal_and_the_view_runs_once(
        self, gunicorn: GunicornServer
    ) -> None:
        key = f"unrenderable-{time.monotonic_ns()}"

        def send() -> requests.Response:
            return requests.post(
                gunicorn.url + "/lease/unrenderable/",
                data=b"{}",
                headers={"Content-Type": "application/json", "Idempotency-Key": key},
                timeout=REQUEST_TIMEOUT,
            )

        assert send().status_code == 500
        for _ in range(2):  # whichever worker answers
            retry = send()
            assert retry.status_code == 500
            assert retry.headers["Content-Type"] == "application/problem+json"
            assert retry.headers["Idempotent-Replayed"] == "true"
            assert retry.json()["type"].endswith(":result-not-stored")
        assert Order.objects.filter(item="unrenderable").count() == 1
        record = IdempotencyKey.objects.get(key=key)
        assert (record.state, record.status_code) == (State.COMPLETED, 500)
