"""The example's RabbitMQ consumer (``example_project/shop/consumer.py``), on a real broker.

Each test publishes to queues of its own (a unique name, deleted
afterwards) and runs the consumer as a process of its own on the test
database (``tests/consumer_process.py``), killing it with ``kill -9`` where
a crash matters: after the commit and before the ack, and three times in
the middle of a stream of duplicates. A poison message commits nothing
and ends in the dead-letter queue.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kombu
import pytest
from django.db import connection

from django_idempotency.models import IdempotencyKey
from tests.consumer_process import CONSUMER_DIR_ENV, CRASH_AFTER_COMMIT_ENV, DELAY_ENV, SCOPE
from tests.models import Order
from tests.polling import wait_until
from tests.server import DATABASE_NAME_ENV, kill9

ROOT = Path(__file__).resolve().parent.parent
BROKER_URL = os.environ.get("TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")
#: Seconds without a message after which a consumer that is told to stops.
IDLE = 3.0

pytestmark = [pytest.mark.concurrency, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="module")
def broker() -> str:
    try:
        with kombu.Connection(BROKER_URL, connect_timeout=5) as probe:
            probe.connect()
    except Exception as exc:
        pytest.fail(f"RabbitMQ is not reachable at {BROKER_URL} ({exc}).", pytrace=False)
    return BROKER_URL


class Queues:
    """A work queue and its dead-letter queue, named for one test, declared as the example does."""

    def __init__(self, broker: str) -> None:
        from example_project.shop.consumer import declare

        self.name = f"test-consumer-{uuid.uuid4().hex[:12]}"
        self.connection = kombu.Connection(broker)
        self.queue = declare(self.connection, self.name)

    def publish(self, messages: list[tuple[str | None, dict[str, Any]]]) -> None:
        with self.connection.Producer() as producer:
            for message_id, body in messages:
                properties = {} if message_id is None else {"message_id": message_id}
                producer.publish(
                    body,
                    exchange=self.queue.exchange,
                    routing_key=self.name,
                    serializer="json",
                    delivery_mode="persistent",
                    **properties,
                )

    def depth(self, name: str | None = None) -> int:
        """Messages ready in the queue (unacknowledged ones held by a consumer are not counted)."""
        channel = self.connection.default_channel
        return int(channel.queue_declare(name or self.name, passive=True).message_count)

    def dead_letters(self) -> list[tuple[str | None, Any]]:
        found = []
        with self.connection.SimpleQueue(f"{self.name}.dead", no_ack=True) as dead:
            while True:
                try:
                    message = dead.get(timeout=1)
                except dead.Empty:
                    return found
                found.append((message.properties.get("message_id"), message.payload))

    def delete(self) -> None:
        channel = self.connection.default_channel
        for name in (self.name, f"{self.name}.dead"):
            channel.queue_delete(name)
            channel.exchange_delete(name)
        self.connection.release()


@pytest.fixture
def queues(broker: str) -> Iterator[Queues]:
    made = Queues(broker)
    yield made
    made.delete()


class Consumer:
    """Starts consumer processes on the test database and the test's queue."""

    def __init__(self, broker: str, queues: Queues, directory: Path) -> None:
        self.broker = broker
        self.queues = queues
        self.directory = directory
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.server_settings",
            DATABASE_NAME_ENV: str(connection.settings_dict["NAME"]),
            CONSUMER_DIR_ENV: str(directory),
        }

    def start(self, *, idle: float | None = None, **env: str) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "tests.consumer_process", self.broker, self.queues.name]
        if idle is not None:
            command.append(str(idle))
        # The process writes to its own copy of the file; ours is closed at once.
        with (self.directory / "consumer.log").open("ab") as log:
            return subprocess.Popen(
                command, env={**self.env, **env}, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
            )

    def run_until_idle(self, **env: str) -> None:
        process = self.start(idle=IDLE, **env)
        assert process.wait(timeout=180) == 0, self.log()

    def lines(self, name: str) -> list[str]:
        path = self.directory / name
        return path.read_text().splitlines() if path.exists() else []

    def log(self) -> str:
        return (self.directory / "consumer.log").read_text()[-5000:]


@pytest.fixture
def consumer(broker: str, queues: Queues, tmp_path: Path) -> Consumer:
    return Consumer(broker, queues, tmp_path)


def records() -> Any:
    return IdempotencyKey.objects.filter(scope=SCOPE)


class ConsumerTests:
    def test_killed_after_the_commit_before_the_ack_is_redelivered_and_runs_once(
        self, consumer, queues
    ):
        queues.publish([("msg-1", {"quantity": 3})])

        doomed = consumer.start(**{CRASH_AFTER_COMMIT_ENV: "msg-1"})
        assert doomed.wait(timeout=60) == -9, consumer.log()

        # The effect and the record committed; the broker took the message back.
        assert list(Order.objects.values_list("item", "quantity")) == [("msg-1", 3)]
        assert records().get().state == IdempotencyKey.State.COMPLETED
        wait_until(lambda: queues.depth() == 1, "the unacknowledged message to be requeued")

        consumer.run_until_idle()

        assert consumer.lines("calls") == ["msg-1", "msg-1"]  # delivered twice
        assert consumer.lines("runs") == ["msg-1"]  # the body ran once
        assert Order.objects.count() == 1
        assert queues.depth() == 0
        assert queues.dead_letters() == []

    def test_poison_message_commits_nothing_and_is_dead_lettered(self, consumer, queues):
        queues.publish([("poison-1", {"poison": True}), ("msg-2", {})])

        consumer.run_until_idle()

        assert consumer.lines("runs") == ["poison-1", "msg-2"]
        assert list(Order.objects.values_list("item", flat=True)) == ["msg-2"]
        # Not marked done: a fixed consumer handed it again runs it.
        assert list(records().values_list("key", flat=True)) == ["msg-2"]
        assert queues.depth() == 0
        assert queues.dead_letters() == [("poison-1", {"poison": True})]
        assert "Message poison-1 failed; dead-lettered." in consumer.log()

    def test_same_id_with_another_body_is_dead_lettered_and_changes_nothing(self, consumer, queues):
        queues.publish([("msg-3", {"quantity": 1}), ("msg-3", {"quantity": 9})])

        consumer.run_until_idle()

        assert list(Order.objects.values_list("quantity", flat=True)) == [1]
        assert queues.dead_letters() == [("msg-3", {"quantity": 9})]
        assert "ArgumentsMismatch" in consumer.log()

    def test_message_without_an_id_is_dead_lettered(self, consumer, queues):
        queues.publish([(None, {"quantity": 1})])

        consumer.run_until_idle()

        assert not Order.objects.exists()
        assert queues.dead_letters() == [(None, {"quantity": 1})]


#: The proof run: messages, each published twice, and the consumer killed this often.
MESSAGES = 200
KILLS = 3


class ProofTests:
    def test_duplicates_and_three_kills_are_one_effect_per_message(self, consumer, queues):
        ids = [f"order-{index:03d}" for index in range(MESSAGES)]
        queues.publish([(message_id, {"quantity": 1}) for message_id in ids])
        queues.publish([(message_id, {"quantity": 1}) for message_id in ids])

        killed = 0
        for threshold in (MESSAGES * (k + 1) // (KILLS + 1) for k in range(KILLS)):
            process = consumer.start(**{DELAY_ENV: "0.01"})
            wait_until(
                lambda threshold=threshold: Order.objects.count() >= threshold,
                f"{threshold} orders",
                120,
            )
            kill9(process.pid)  # mid-stream: anywhere between two statements
            assert process.wait(timeout=30) == -9
            killed += 1
        consumer.run_until_idle()

        assert killed == KILLS
        items = list(Order.objects.values_list("item", flat=True))
        assert len(items) == MESSAGES, f"{len(items)} orders"  # none lost
        assert sorted(items) == ids  # none twice
        assert records().count() == MESSAGES
        assert not records().exclude(state=IdempotencyKey.State.COMPLETED).exists()
        # Every publish was handled: 400 deliveries at least, a kill's in-flight ones again.
        assert len(consumer.lines("calls")) >= 2 * MESSAGES
        assert queues.depth() == 0
        assert queues.dead_letters() == []


class ExampleCommandTests:
    """``manage.py consume_orders`` of the example project, on its own SQLite database."""

    def test_each_order_message_is_placed_once(self, queues, tmp_path):
        database = tmp_path / "example.sqlite3"
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "example_project.settings",
            "EXAMPLE_SQLITE_PATH": str(database),
            "ORDERS_FEED_BROKER_URL": BROKER_URL,
        }
        env.pop("DATABASE_URL", None)

        def manage(*arguments: str) -> str:
            completed = subprocess.run(
                [sys.executable, "manage.py", *arguments],
                cwd=ROOT,
                env=env,
                capture_output=True,
                timeout=120,
            )
            assert completed.returncode == 0, completed.stderr.decode()[-3000:]
            return completed.stdout.decode()

        manage("migrate", "--noinput", "-v", "0")
        orders = [(f"feed-{n}", {"item": f"item-{n}", "quantity": n}) for n in (1, 2, 3)]
        queues.publish(orders + orders)

        output = manage("consume_orders", "--queue", queues.name, "--exit-when-idle", str(IDLE))

        assert f"Consuming {queues.name}" in output
        with sqlite3.connect(database) as example:
            placed = example.execute("SELECT item, quantity FROM shop_order ORDER BY item")
            assert placed.fetchall() == [("item-1", 1), ("item-2", 2), ("item-3", 3)]
        assert queues.depth() == 0
