"""Scenarios 1 and 2: duplicates under load, and worker processes killed during it."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import pytest

from tests.faults.client import Call
from tests.faults.harness import Scale, check_invariant, order_call, run_load
from tests.faults.plugin import Row
from tests.models import Order, RemoteCharge
from tests.server import GunicornServer, kill9

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]


class LoadTests:
    def test_concurrent_copies_of_every_key_leave_one_effect_each(
        self, server: GunicornServer, sizes: Scale, record: Callable[[Row], None]
    ) -> None:
        # The copies of one key are next to each other in the queue, so that
        # they are in flight at the same time on different workers.
        calls = [
            order_call("/faults/orders/", f"load-{index}", f"load:{index}")
            for index in range(sizes.load_keys)
            for _ in range(sizes.load_copies)
        ]
        run_load(server, calls)

        row = check_invariant("load with duplicates", calls, Order, 0, record)
        assert row.server_errors == 0
        assert row.keys == sizes.load_keys
        for index in range(0, len(calls), sizes.load_copies):
            copies = calls[index : index + sizes.load_copies]
            fresh = [call for call in copies if not call.final.replayed]  # type: ignore[union-attr]
            assert len(fresh) == 1, [call.attempts for call in copies]


def kill_workers(server: GunicornServer, limit: int) -> Callable[..., int]:
    def loop(stop: threading.Event, rng: random.Random) -> int:
        kills = 0
        while kills < limit and not stop.wait(rng.uniform(0.3, 0.8)):
            workers = server.worker_pids()
            if workers:
                try:
                    kill9(rng.choice(workers))
                except ProcessLookupError:
                    continue  # it died on its own between the listing and the kill
                kills += 1
        return kills

    return loop


class CrashTests:
    def run(
        self, server: GunicornServer, sizes: Scale, path: str, prefix: str
    ) -> tuple[list[Call], int]:
        calls = [
            order_call(path, f"{prefix}-{index}", f"{prefix}:{index}")
            for index in range(sizes.crash_keys)
            for _ in range(2)
        ]
        kills = run_load(server, calls, kill_workers(server, sizes.crash_kills))
        assert kills >= min(3, sizes.crash_kills), "too few workers were killed"
        return calls, kills

    def test_killed_workers_in_atomic_mode_leave_one_effect_per_key(
        self, server: GunicornServer, sizes: Scale, record: Callable[[Row], None]
    ) -> None:
        calls, kills = self.run(server, sizes, "/faults/orders/?hold=0.05", "crash-atomic")
        check_invariant("worker crashes, atomic", calls, Order, kills, record)

    def test_killed_workers_in_lease_mode_leave_one_remote_effect_per_key(
        self, server: GunicornServer, sizes: Scale, record: Callable[[Row], None]
    ) -> None:
        calls, kills = self.run(server, sizes, "/faults/charges/?hold=0.05", "crash-lease")
        check_invariant("worker crashes, lease", calls, RemoteCharge, kills, record)
