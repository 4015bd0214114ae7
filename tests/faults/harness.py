"""What the fault scenarios share: scales, calls, fault injectors, the invariant.

Fixtures that use these live in ``conftest.py``; test modules import from here.
"""

from __future__ import annotations

import json
import random
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db.models import Model

from django_idempotency.models import IdempotencyKey
from tests.faults.client import Call, RetryingClient
from tests.faults.plugin import Row
from tests.polling import wait_until as wait_for
from tests.server import GunicornServer

__all__ = [
    "CLIENT_THREADS",
    "SCALES",
    "Injector",
    "Scale",
    "check_invariant",
    "client_for",
    "order_call",
    "run_load",
    "settle",
    "wait_for",
]


@dataclass(frozen=True)
class Scale:
    load_keys: int
    load_copies: int
    crash_keys: int
    crash_kills: int
    db_kill_keys: int
    db_kills: int
    restart_keys: int
    slow_keys: int
    hostile_keys: int
    conflict_keys: int


#: Each size at full scale and at CI scale.
_SIZES = {
    "load_keys": (1000, 100),
    "load_copies": (10, 10),
    "crash_keys": (600, 150),
    "crash_kills": (20, 6),
    "db_kill_keys": (600, 150),
    "db_kills": (60, 20),
    "restart_keys": (400, 200),
    "slow_keys": (40, 12),
    "hostile_keys": (400, 80),
    "conflict_keys": (20, 5),
}
SCALES = {
    scale: Scale(**{name: sizes[index] for name, sizes in _SIZES.items()})
    for index, scale in enumerate(("full", "ci"))
}
CLIENT_THREADS = 40


def client_for(server: GunicornServer, **options: Any) -> RetryingClient:
    return RetryingClient(server.url, seed=1, **options)


def order_call(path: str, key: str, label: str, tenant: str = "t1") -> Call:
    return Call(
        key=key,
        path=path,
        body=json.dumps({"item": label}).encode(),
        headers={
            "Idempotency-Key": key,
            "Content-Type": "application/json",
            "X-Tenant": tenant,
        },
        label=label,
        scope=f"tenant:{tenant}",
    )


class Injector:
    """Runs a fault loop in a thread while the load runs, and counts the faults."""

    def __init__(self, loop: Callable[[threading.Event, random.Random], int]) -> None:
        self.stop = threading.Event()
        self.faults = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(loop,), daemon=True)

    def _run(self, loop: Callable[[threading.Event, random.Random], int]) -> None:
        try:
            self.faults = loop(self.stop, random.Random(7))
        except BaseException as exc:
            self.error = exc

    def __enter__(self) -> Injector:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        self._thread.join(timeout=180)
        assert not self._thread.is_alive(), "the fault injector did not stop"
        if self.error is not None:
            raise self.error


def run_load(
    server: GunicornServer,
    calls: list[Call],
    inject: Callable[[threading.Event, random.Random], int] | None = None,
) -> int:
    """Send the calls, with ``inject`` injecting faults meanwhile, then the late retries.

    Returns how many faults were injected.
    """
    client = client_for(server)
    with Injector(inject or (lambda stop, rng: 0)) as injector:
        client.send_all(calls, threads=CLIENT_THREADS)
    settle(client, calls)
    return injector.faults


def settle(client: RetryingClient, calls: list[Call], rounds: int = 3) -> None:
    """The client's late retries: every call that never succeeded is sent again."""
    for _ in range(rounds):
        pending = [call for call in calls if not call.succeeded and _retryable(call)]
        if not pending:
            return
        client.send_all(pending, threads=min(CLIENT_THREADS, len(pending)))


def _retryable(call: Call) -> bool:
    final = call.final
    return final is None or final.status is None or final.status >= 409


def check_invariant(
    scenario: str,
    calls: list[Call],
    effect_model: type[Model],
    faults: int,
    record: Callable[[Row], None],
) -> Row:
    """Record the scenario's row, then assert one effect per key, each success carrying it.

    The row is recorded before asserting, so a failing scenario still shows
    its numbers in the report.
    """
    labels = {call.label for call in calls}
    effects: dict[str, list[int]] = defaultdict(list)
    rows = effect_model.objects.filter(item__in=labels).values_list("pk", "item")  # type: ignore[attr-defined]
    for pk, item in rows:
        effects[item].append(pk)
    attempts = [attempt for call in calls for attempt in call.attempts]
    row = Row(
        scenario=scenario,
        requests=len(attempts),
        faults=faults,
        keys=len(labels),
        effects=sum(len(pks) for pks in effects.values()),
        duplicates=sum(len(pks) - 1 for pks in effects.values() if len(pks) > 1),
        lost=sum(1 for label in labels if not effects.get(label)),
        server_errors=sum(1 for a in attempts if a.status is not None and a.status >= 500),
    )
    record(row)
    assert row.duplicates == 0, row
    assert row.lost == 0, row
    problems = []
    for call in calls:
        if not call.succeeded:
            problems.append(f"{call.key}: never succeeded: {call.attempts[-3:]}")
            continue
        (effect,) = effects[call.label]
        for attempt in call.attempts:
            if attempt.status is not None and 200 <= attempt.status < 300:
                answer = json.loads(attempt.body)
                expected = {"effect": effect, "item": call.label, "scope": call.scope}
                if answer != expected:
                    problems.append(f"{call.key}: answered {answer}, expected {expected}")
    assert not problems, problems[:10]
    stuck = IdempotencyKey.objects.filter(key__in={call.key for call in calls}).exclude(
        state=IdempotencyKey.State.COMPLETED
    )
    assert not stuck.exists(), list(stuck.values("key", "state"))
    return row
