"""Real threads racing on real databases: one effect per key, never a 5xx.

These tests commit for real (``transaction=True``) so that each thread's
connection sees the others' transactions exactly as app instances would.
"""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Callable

import pytest
from django.db import connection

from django_idempotency import signals
from django_idempotency.models import IdempotencyKey
from tests.clients import send
from tests.models import Order
from tests.views import calls, fail_next

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.concurrency]


def run_in_threads(jobs: list[Callable[[], object]], threads: int, timeout: float = 300) -> list:
    """Run ``jobs`` on ``threads`` real threads, each with its own DB connection.

    Results come back in job order. A barrier releases the first wave at once
    so that duplicates really do arrive together. ``timeout`` only guards
    against a hang: a slow machine must not fail a storm that finishes.
    """
    results: list = [None] * len(jobs)
    work: queue.Queue[int] = queue.Queue()
    for index in range(len(jobs)):
        work.put(index)
    start = threading.Barrier(threads)

    def worker() -> None:
        start.wait()
        try:
            while True:
                try:
                    index = work.get_nowait()
                except queue.Empty:
                    return
                try:
                    results[index] = jobs[index]()
                except Exception as exc:  # surfaced by the assertions below
                    results[index] = exc
        finally:
            connection.close()

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(timeout)
        assert not thread.is_alive(), "a request thread did not finish in time"
    return results


def assert_one_original_rest_replays_or_409(responses: list) -> None:
    errors = [r for r in responses if not hasattr(r, "status_code")]
    assert not errors, errors
    assert [r.status_code for r in responses if r.status_code >= 500] == []
    originals = [r for r in responses if r.status_code == 201 and "Idempotent-Replayed" not in r]
    replays = [r for r in responses if "Idempotent-Replayed" in r]
    conflicts = [r for r in responses if r.status_code == 409]
    assert len(originals) == 1
    assert len(originals) + len(replays) + len(conflicts) == len(responses)
    for replay in replays:
        assert replay.status_code == 201
        assert replay.content == originals[0].content
    for conflict in conflicts:
        assert int(conflict["Retry-After"]) >= 1


def test_twenty_simultaneous_duplicates_have_one_effect():
    responses = run_in_threads([lambda: send("/orders/?hold=0.5", "same")] * 20, threads=20)

    assert_one_original_rest_replays_or_409(responses)
    assert Order.objects.count() == 1
    assert calls.value == 1
    assert IdempotencyKey.objects.count() == 1


def test_hundred_keys_with_five_duplicates_each_have_hundred_effects():
    jobs = [
        (lambda key=f"key-{n}": send("/orders/?hold=0.02", key))
        for n in range(100)
        for _ in range(5)
    ]
    order = list(range(len(jobs)))
    random.Random(7).shuffle(order)
    shuffled = [jobs[i] for i in order]

    responses = run_in_threads(shuffled, threads=20)

    by_key: dict[int, list] = {}
    for position, response in zip(order, responses, strict=True):
        by_key.setdefault(position // 5, []).append(response)
    # 409 is a valid answer while another copy holds the key (or, on SQLite,
    # the whole database). A client retries it; so do we, once the storm is
    # over, for any key none of whose copies got through.
    for n, group in by_key.items():
        if all(getattr(r, "status_code", None) == 409 for r in group):
            group.append(send("/orders/?hold=0.02", f"key-{n}"))
    connection.close()

    assert Order.objects.count() == 100
    assert calls.value == 100
    assert IdempotencyKey.objects.count() == 100
    for group in by_key.values():
        assert_one_original_rest_replays_or_409(group)


def test_duplicate_past_wait_gets_409_then_replay_after_commit():
    claimed = threading.Event()

    def on_claim(**kwargs: object) -> None:
        claimed.set()

    signals.key_claimed.connect(on_claim)
    try:
        original: list = []
        thread = threading.Thread(
            target=lambda: (
                (original.append(send("/orders/short-wait/?hold=1.5", "slow")),)
                and connection.close()
            )
        )
        thread.start()
        assert claimed.wait(10)
        duplicate = send("/orders/short-wait/?hold=1.5", "slow")
        thread.join(20)
    finally:
        signals.key_claimed.disconnect(on_claim)
        connection.close()

    assert duplicate.status_code == 409
    assert duplicate["Content-Type"] == "application/problem+json"
    assert int(duplicate["Retry-After"]) >= 1
    assert original[0].status_code == 201
    retry = send("/orders/short-wait/?hold=1.5", "slow")
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == original[0].content
    assert Order.objects.count() == 1


def test_duplicates_waiting_on_an_original_that_rolls_back_never_500():
    # The original fails after holding its claim; the waiting duplicates must
    # end in one fresh run plus replays (or 409s), never a deadlock's 500.
    # On MariaDB this is where waiters on a rolled-back INSERT deadlock.
    claimed = threading.Event()

    def on_claim(**kwargs: object) -> None:
        claimed.set()

    fail_next.set()
    signals.key_claimed.connect(on_claim)
    try:
        original: list = []
        thread = threading.Thread(
            target=lambda: (
                (original.append(send("/orders/?hold=0.5", "doomed")),) and connection.close()
            )
        )
        thread.start()
        assert claimed.wait(10)
        duplicates = run_in_threads([lambda: send("/orders/?hold=0.5", "doomed")] * 8, threads=8)
        thread.join(20)
    finally:
        signals.key_claimed.disconnect(on_claim)

    assert original[0].status_code == 500
    assert_one_original_rest_replays_or_409(duplicates)
    assert Order.objects.count() == 1
    assert IdempotencyKey.objects.count() == 1
