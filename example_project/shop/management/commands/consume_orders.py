"""``manage.py consume_orders``: place the orders of a RabbitMQ queue, once per message."""

from __future__ import annotations

from typing import Any

import kombu
from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from example_project.shop.consumer import consume, declare
from example_project.shop.orders_feed import place_order


class Command(BaseCommand):
    help = (
        "Consume order messages from RabbitMQ: each message id is placed once, its "
        "record committed with the order before the message is acknowledged."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--queue", default=settings.ORDERS_FEED_QUEUE)
        parser.add_argument("--broker", default=settings.ORDERS_FEED_BROKER_URL)
        parser.add_argument(
            "--exit-when-idle",
            type=float,
            metavar="SECONDS",
            help="Stop once no message has come for this many seconds (default: run forever).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        with kombu.Connection(options["broker"]) as connection:
            queue = declare(connection, options["queue"])
            self.stdout.write(f"Consuming {queue.name} (dead letters go to {queue.name}.dead)")
            consume(connection, queue, place_order, idle_timeout=options["exit_when_idle"])
