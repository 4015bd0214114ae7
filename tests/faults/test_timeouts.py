"""Scenario 5: the client gives up on every attempt long before the handler finishes."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.faults.harness import Scale, check_invariant, client_for, order_call, settle
from tests.faults.plugin import Row
from tests.models import Order, RemoteCharge
from tests.server import WORKERS, GunicornServer

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]

HOLD = 1.0
CLIENT_TIMEOUT = 0.3


class ClientTimeoutTests:
    def run(self, server: GunicornServer, sizes: Scale, path: str, prefix: str) -> list:
        calls = [
            order_call(f"{path}?hold={HOLD}", f"{prefix}-{i}", f"{prefix}:{i}")
            for i in range(sizes.slow_keys)
        ]
        # One client per worker: the abandoned originals keep their workers
        # busy, and more clients would only queue behind them.
        client = client_for(server, timeout=CLIENT_TIMEOUT, max_delay=1.5, max_attempts=20)
        client.send_all(calls, threads=WORKERS)
        settle(client, calls)
        for call in calls:
            first, *retries = call.attempts
            assert first.status is None and first.error == "ReadTimeout", call.attempts
            # While the original runs: timeouts or 409; then its stored response.
            *waiting, final = retries
            assert all(a.status in (None, 409) for a in waiting), call.attempts
            assert final.status == 201 and final.replayed, call.attempts
        return calls

    def test_timed_out_original_completes_and_retries_get_its_response_atomic(
        self, server: GunicornServer, sizes: Scale, record: Callable[[Row], None]
    ) -> None:
        calls = self.run(server, sizes, "/faults/orders/short-wait/", "timeout-atomic")
        timeouts = sum(1 for call in calls for a in call.attempts if a.status is None)
        check_invariant("client timeouts, atomic", calls, Order, timeouts, record)

    def test_timed_out_original_completes_and_retries_get_its_response_lease(
        self, server: GunicornServer, sizes: Scale, record: Callable[[Row], None]
    ) -> None:
        calls = self.run(server, sizes, "/faults/charges/", "timeout-lease")
        timeouts = sum(1 for call in calls for a in call.attempts if a.status is None)
        check_invariant("client timeouts, lease", calls, RemoteCharge, timeouts, record)
