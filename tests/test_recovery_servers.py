"""Recovering abandoned work over gunicorn: a worker killed between two checkpoints.

The payment view (``tests/recovery_views.py``) charges the example shop's
fake provider, checkpoints, ships, checkpoints. Each step that runs is
counted outside the database, in the control directory. On PostgreSQL,
MariaDB and SQLite: gunicorn's workers share SQLite's file.
"""

from __future__ import annotations

from collections.abc import Iterator
from io import StringIO
from pathlib import Path

import pytest
import requests
from django.core.management import call_command
from django.utils import timezone

from django_idempotency.models import IdempotencyKey
from example_project.provider.models import Charge
from tests.polling import in_background, wait_until
from tests.server import GunicornServer, kill9, wait_for_exit, wait_for_file
from tests.server_fixtures import controlled

pytestmark = [pytest.mark.server, pytest.mark.django_db(transaction=True)]
State = IdempotencyKey.State


@pytest.fixture(scope="module")
def control(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("recovery-control")


@pytest.fixture(scope="module")
def server(
    django_db_setup: None, control: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GunicornServer]:
    settings = "tests.recovery_server_settings"
    with controlled(GunicornServer, settings, control, tmp_path_factory, 2) as running:
        yield running


class Payment:
    """One key's payment: send it, hold its handler after a step, kill its worker."""

    def __init__(self, server: GunicornServer, control: Path, key: str, path: str) -> None:
        self.server, self.control, self.key, self.path = server, control, key, path

    def send(self, timeout: float = 15) -> requests.Response:
        return requests.post(
            f"{self.server.url}/recovery/{self.path}",
            json={"item": "book", "amount": 10},
            headers={"Idempotency-Key": self.key},
            timeout=timeout,
        )

    def steps(self) -> list[str]:
        path = self.control / f"{self.key}.steps"
        return path.read_text().splitlines() if path.exists() else []

    def kill_after(self, step: str) -> None:
        """Send it, and kill -9 its worker while its handler waits after ``step``."""
        hold = self.control / f"{self.key}.hold-after-{step}"
        hold.touch()
        doomed = in_background(self.send)
        report = wait_for_file(self.control / f"{self.key}.pid")
        (self.control / f"{self.key}.pid").unlink()
        assert report["step"] == step
        kill9(report["pid"])
        with pytest.raises(requests.ConnectionError):
            doomed()
        wait_for_exit(report["pid"])
        hold.unlink()

    def record(self) -> IdempotencyKey:
        return IdempotencyKey.objects.get(key=self.key)

    def wait_for_the_lease(self) -> None:
        run_out = self.record().expires_at
        wait_until(lambda: timezone.now() > run_out, "the dead owner's lease to run out")


def test_a_retry_after_the_lease_resumes_after_the_last_checkpoint(server, control):
    # A 15 s lease: the retry below must arrive inside it however slow the kill was.
    payment = Payment(server, control, "kill-between-checkpoints", "pay/long-lease/")
    payment.kill_after("charged")

    held = payment.record()
    assert (held.state, held.attempt, sorted(held.checkpoints)) == (
        State.IN_PROGRESS,
        1,
        ["charged"],
    )
    early = payment.send()
    assert early.status_code == 409  # the dead owner's lease still runs
    payment.wait_for_the_lease()

    resumed = payment.send()

    assert resumed.status_code == 201, (resumed.text, server.log())
    assert resumed.json()["attempt"] == 2
    assert resumed.json()["resumed"] == ["charged"]
    assert payment.steps() == ["charge", "ship"]  # each step once
    assert Charge.objects.count() == 1
    replay = payment.send()
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.content == resumed.content


def test_a_heartbeat_keeps_a_short_lease_through_a_long_handler(server, control):
    key = "heartbeat-long-handler"

    def beat() -> requests.Response:
        return requests.post(
            f"{server.url}/recovery/beat/",
            json={"item": "book", "seconds": 6},
            headers={"Idempotency-Key": key},
            timeout=30,
        )

    started = timezone.now()
    original = in_background(beat, limit=30)
    wait_until(lambda: IdempotencyKey.objects.filter(key=key).exists(), "the claim")
    wait_until(lambda: (timezone.now() - started).total_seconds() > 3, "three seconds")

    duplicate = beat()  # past the 2 s lease it would have without its heartbeats

    assert duplicate.status_code == 409
    first = original()
    assert first.status_code == 201
    assert first.json()["attempt"] == 1
    assert beat().headers["Idempotent-Replayed"] == "true"


def test_a_reconciling_policy_settles_the_key_without_running_it_again(server, control):
    payment = Payment(server, control, "reconcile-after-kill", "pay/reconciled/")
    payment.kill_after("charged")
    payment.wait_for_the_lease()

    settled = payment.send()

    assert settled.status_code == 201, settled.text
    assert settled.json()["reconciled"] is True
    assert payment.steps() == ["charge"]
    assert payment.record().state == State.COMPLETED
    assert payment.send().headers["Idempotent-Replayed"] == "true"


def test_a_policy_that_finds_nothing_done_takes_over(server, control):
    payment = Payment(server, control, "reconcile-nothing-done", "pay/reconciled/")
    payment.kill_after("charged")
    IdempotencyKey.objects.filter(key=payment.key).update(checkpoints={})
    payment.wait_for_the_lease()

    again = payment.send()

    assert again.status_code == 201
    assert again.json()["attempt"] == 2
    assert Charge.objects.count() == 1  # the provider saw the same derive() key


def test_hold_keeps_the_claim_until_an_operator_releases_it(server, control):
    payment = Payment(server, control, "held-after-kill", "pay/held/")
    payment.kill_after("charged")
    payment.wait_for_the_lease()

    held = payment.send()
    assert held.status_code == 409
    assert held.json()["type"].endswith("request-abandoned")
    assert payment.send().status_code == 409  # every retry asks again

    out = StringIO()
    call_command("idempotency_keys", "release", payment.record().scope, payment.key, stdout=out)
    released = payment.send()

    assert released.status_code == 201, released.text
    assert released.json()["attempt"] == 2
    assert payment.steps() == ["charge", "ship"]
