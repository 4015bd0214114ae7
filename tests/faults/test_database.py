"""Scenarios 3 and 4: the server's database connections killed, the database restarted."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable

import pytest
from django.db import connection

from tests.faults import database
from tests.faults.client import RetryingClient
from tests.faults.harness import (
    CLIENT_THREADS,
    Injector,
    Scale,
    check_invariant,
    client_for,
    order_call,
    run_load,
    settle,
    wait_for,
)
from tests.faults.plugin import Row
from tests.models import Order, RemoteCharge
from tests.server import GunicornServer

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]


class ConnectionKillTests:
    def test_connections_killed_mid_handler_leave_one_effect_per_key(
        self,
        server: GunicornServer,
        sizes: Scale,
        application_name: str,
        record: Callable[[Row], None],
    ) -> None:
        name = connection.settings_dict["NAME"]
        spare = [database.own_connection_id(connection)]

        def loop(stop: threading.Event, rng: random.Random) -> int:
            killed = 0
            injector = database.connect()
            try:
                while killed < sizes.db_kills and not stop.wait(rng.uniform(0.1, 0.4)):
                    killed += database.kill_server_connections(
                        injector, name, application_name, spare
                    )
            finally:
                injector.close()
            return killed

        atomic = [
            order_call("/faults/orders/?hold=0.05", f"dbkill-a-{i}", f"dbkill-a:{i}")
            for i in range(sizes.db_kill_keys)
        ]
        lease = [
            order_call("/faults/charges/?hold=0.05", f"dbkill-l-{i}", f"dbkill-l:{i}")
            for i in range(sizes.db_kill_keys)
        ]
        calls = [call for pair in zip(atomic, lease, strict=True) for call in pair]
        killed = run_load(server, calls, loop)

        assert killed > 0, "no connection was killed"
        errors = sum(1 for call in calls for a in call.attempts if a.status == 500)
        assert errors > 0, "no request saw its connection die"
        # One load mixes both modes, so both rows count every connection killed.
        check_invariant("connections killed, atomic", atomic, Order, killed, record)
        check_invariant("connections killed, lease", lease, RemoteCharge, killed, record)


@pytest.mark.skipif(
    os.environ.get("FAULTS_DB_RESTART") != "1",
    reason="stops and starts the database server itself: opt in with FAULTS_DB_RESTART=1 "
    "(CI does; FAULTS_DB_STOP/FAULTS_DB_START override the commands)",
)
class RestartTests:
    def test_database_restart_mid_load_recovers_with_one_effect_per_key(
        self, server: GunicornServer, sizes: Scale, record: Callable[[Row], None]
    ) -> None:
        def loop(stop: threading.Event, rng: random.Random) -> int:
            if stop.wait(1.5):
                return 0  # the load ended before the restart: the assertion below says so
            database.stop_database()
            try:
                # Down long enough for every worker to meet the outage.
                time.sleep(2)
            finally:
                database.start_database()
            return 1

        calls = [
            order_call("/faults/orders/?hold=0.1", f"restart-{i}", f"restart:{i}")
            for i in range(sizes.restart_keys)
        ]
        client = client_for(server)
        try:
            with Injector(loop) as injector:
                client.send_all(calls, threads=CLIENT_THREADS)
        finally:
            if not database.accepting():
                database.start_database()
            # The test's own connection died with the server.
            connection.close()
        # Recovered by itself: a request sent after the restart needs no retry.
        wait_for(lambda: _answers(client), "the service to answer after the restart")
        settle(client, calls)

        assert injector.faults == 1, "the load ended before the database was restarted"
        assert any(a.status == 500 for call in calls for a in call.attempts)
        check_invariant("database restart", calls, Order, injector.faults, record)


def _answers(client: RetryingClient) -> bool:
    probe = order_call("/faults/orders/", f"probe-{time.monotonic_ns()}", "probe")
    return client.attempt(probe).status == 201
