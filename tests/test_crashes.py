"""A server worker killed with ``kill -9`` mid-handler, under gunicorn and under uvicorn.

Each handler writes its effect, reports its PID and waits for the test's
go-ahead; the test kills the worker while it waits. In atomic mode the
database rolls the effect back with the claim and the retry runs once; in
lease mode the dead worker's claim holds until its lease runs out, then a
retry takes the key over. The Celery worker's crash tests are in
``test_tasks.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
from django.utils import timezone

from django_idempotency import store
from django_idempotency.models import IdempotencyKey
from tests.models import Order
from tests.polling import in_background, wait_until
from tests.server import GunicornServer, kill9, wait_for_exit, wait_for_file
from tests.server_fixtures import (  # noqa: F401  fixtures used by name
    SERVER_TESTS,
    control_dir_fixture,
    gunicorn_fixture,
    uvicorn_fixture,
)

pytestmark = SERVER_TESTS

State = IdempotencyKey.State


@dataclass(frozen=True)
class Target:
    """Where the holding handlers are on one kind of server, and what one run writes."""

    server: str  # the fixture
    key_prefix: str
    atomic_path: str
    lease_path: str
    #: The Orders one run of the handler writes.
    effects: int
    #: The report's field telling whether the handler ran inside a transaction.
    transaction_field: str


TARGETS = [
    Target("gunicorn", "", "/drf/hold/", "/drf/lease-hold/", 1, "in_atomic_block"),
    Target(
        "uvicorn",
        "async-",
        "/async/orders/?wait_for_go=1",
        "/async/orders/short-lease/?wait_for_go=1",
        2,
        "in_transaction",
    ),
]


@pytest.fixture(params=TARGETS, ids=lambda target: target.server)
def target(request: pytest.FixtureRequest) -> Target:
    return request.param


@pytest.fixture
def server(target: Target, request: pytest.FixtureRequest) -> GunicornServer:
    return request.getfixturevalue(target.server)


@dataclass
class Holder:
    """A request whose handler has written its effect and waits for the go-ahead."""

    go: Path
    send: Callable[[], requests.Response]
    doomed: Callable[[], Any]
    report: dict[str, Any]

    def kill(self) -> None:
        """Kill the worker that runs the handler; its client loses the connection."""
        kill9(self.report["pid"])
        with pytest.raises(requests.ConnectionError):
            self.doomed()
        wait_for_exit(self.report["pid"])

    def release(self) -> None:
        """Let the next run of the handler answer."""
        self.go.touch()


def hold(server: GunicornServer, target: Target, control_dir: Path, *, atomic: bool) -> Holder:
    """Send a request in the background until its handler holds, in atomic or lease mode."""
    key = f"{target.key_prefix}crash-{'atomic' if atomic else 'lease'}"
    url = server.url + (target.atomic_path if atomic else target.lease_path)

    def send() -> requests.Response:
        return requests.post(
            url, json={"item": "held"}, headers={"Idempotency-Key": key}, timeout=15
        )

    doomed = in_background(send)
    report = wait_for_file(control_dir / f"{key}.pid")
    (control_dir / f"{key}.pid").unlink()
    assert report[target.transaction_field] is atomic
    return Holder(control_dir / f"{key}.go", send, doomed, report)


def test_kill_in_atomic_handler_leaves_nothing_and_retry_runs_once(
    server: GunicornServer, target: Target, control_dir: Path
) -> None:
    holder = hold(server, target, control_dir, atomic=True)
    send = holder.send
    # The handler has written its effect, inside the transaction that holds the claim.
    assert Order.objects.count() == 0
    assert IdempotencyKey.objects.count() == 0
    holder.kill()
    assert Order.objects.count() == 0
    assert IdempotencyKey.objects.count() == 0

    holder.release()
    retry = send()
    assert retry.status_code == 201, retry.text
    assert "Idempotent-Replayed" not in retry.headers
    assert Order.objects.count() == target.effects
    assert IdempotencyKey.objects.get().state == State.COMPLETED
    again = send()
    assert again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == retry.content
    assert Order.objects.count() == target.effects


def test_kill_in_lease_handler_is_taken_over_after_the_lease(
    server: GunicornServer, target: Target, control_dir: Path
) -> None:
    holder = hold(server, target, control_dir, atomic=False)
    send = holder.send
    # Lease mode: the claim and the effect are committed while the handler runs.
    held = IdempotencyKey.objects.get()
    assert held.state == State.IN_PROGRESS
    assert held.locked_until is not None
    assert Order.objects.count() == target.effects
    assert held.locked_until - timezone.now() > timedelta(seconds=1)

    before_kill = send()
    assert before_kill.status_code == 409
    assert before_kill.headers["Retry-After"] in ("1", "2")
    holder.kill()

    if timezone.now() < held.locked_until - timedelta(milliseconds=300):
        after_kill = send()
        assert after_kill.status_code == 409
        assert int(after_kill.headers["Retry-After"]) >= 1
    # Nobody released the dead owner's claim: it waits for its lease to run out.
    assert IdempotencyKey.objects.get().owner_token == held.owner_token

    run_out = held.locked_until + timedelta(milliseconds=50)
    wait_until(lambda: timezone.now() > run_out, "the dead owner's lease to run out")
    holder.release()
    takeover = send()
    assert takeover.status_code == 201, (takeover.text, server.log())
    assert "Idempotent-Replayed" not in takeover.headers
    assert takeover.json()["payment"] == holder.report["payment"]
    record = IdempotencyKey.objects.get()
    assert record.pk == held.pk
    assert record.owner_token != held.owner_token
    assert record.state == State.COMPLETED
    assert bytes(record.response_body) == takeover.content

    # The dead owner's token can neither overwrite nor delete the new record.
    stale = store.StoredResponse(500, [], b"stale")
    assert not store.complete(
        "default", held.pk, stale, owner_token=held.owner_token, ttl=timedelta(days=9)
    )
    assert not store.release("default", held.pk, held.owner_token)
    assert bytes(IdempotencyKey.objects.get().response_body) == takeover.content

    replay = send()
    assert replay.status_code == 201
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.content == takeover.content
    # The handler ran twice (that is lease mode), and only twice; derive()
    # kept the remote key.
    assert Order.objects.count() == 2 * target.effects
