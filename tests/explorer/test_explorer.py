"""Explore the claim protocol's interleavings on the real database.

``IDEMPOTENCY_EXPLORER=full`` runs the larger search documented in
docs/reliability.rst ("Exploring the claim protocol"); the default is the
size the test suite runs in CI.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.explorer.engine import MODES, Budget, Result, Spec, run_schedule, run_script

FULL = os.environ.get("IDEMPOTENCY_EXPLORER", "ci") == "full"
# MariaDB's lock table is read at most every 0.12 s (see engine), so each
# schedule that waits on a lock costs more there.
_CI_EXAMPLES = 50 if os.environ.get("TEST_DATABASE") == "mariadb" else 120
EXAMPLES = int(os.environ.get("IDEMPOTENCY_EXPLORER_EXAMPLES", 2000 if FULL else _CI_EXAMPLES))

pytestmark = pytest.mark.django_db(transaction=True)


class Tally:
    """What one test explored, printed after it so that runs can be compared."""

    def __init__(self) -> None:
        self.schedules = self.steps = self.faults = 0
        self.started = time.monotonic()

    def add(self, result: Result) -> None:
        self.schedules += 1
        self.steps += result.moves
        self.faults += result.faults
        if result.violations:
            pytest.fail(result.script, pytrace=False)

    def report(self, name: str) -> str:
        return (
            f"explorer {name}: {self.schedules} schedules, {self.steps} steps, "
            f"{self.faults} faults injected, {time.monotonic() - self.started:.0f}s"
        )


@pytest.fixture
def tally(request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]) -> Iterator[Tally]:
    counted = Tally()
    yield counted
    with capsys.disabled():
        print("\n" + counted.report(request.node.name))


def spec_lists(most: int) -> st.SearchStrategy[list[Spec]]:
    one = st.tuples(
        st.sampled_from(MODES),
        st.sampled_from(["s1", "s1", "s2"]),
        st.sampled_from(["f1", "f1", "f2"]),
        st.sampled_from([False, False, False, True]),
    )
    return st.lists(one, min_size=2, max_size=most).map(
        lambda found: [Spec("ABCD"[i], *values) for i, values in enumerate(found)]
    )


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(specs=spec_lists(4 if FULL else 3), data=st.data())
def test_random_schedules(tally: Tally, specs: list[Spec], data: st.DataObject) -> None:
    """Hypothesis picks the actors and every move, and shrinks a failing schedule."""
    budget = Budget(moves=40 if FULL else 24, ticks=2, purges=2, faults=2 if FULL else 1)
    tally.add(
        run_schedule(
            specs,
            # A fixed range, so that a step that blocks on one run and not
            # on another changes the schedule, not what Hypothesis draws.
            lambda moves: moves[data.draw(st.integers(0, 15), label="move") % len(moves)],
            budget,
        )
    )


#: Pairs explored exhaustively: one key, the scopes and fingerprints alike
#: unless said otherwise.
PAIRS = [
    ("A:atomic:s1:f1", "B:atomic:s1:f1"),
    ("A:atomic:s1:f1", "B:lease:s1:f1"),
    ("A:lease:s1:f1", "B:lease:s1:f1"),
    ("A:lease:s1:f1", "B:lease_in_tx:s1:f1"),
    ("A:atomic:s1:f1", "B:atomic:s1:f2"),
    ("A:lease:s1:f1:fails", "B:atomic:s1:f1"),
    # Checkpoints and takeovers, without a recovery policy and with each one.
    ("A:lease:s1:f1:steps", "B:lease:s1:f1:steps"),
    ("A:lease:s1:f1:steps:reconcile", "B:lease:s1:f1:steps:reconcile"),
    ("A:lease:s1:f1:steps:hold", "B:lease:s1:f1:steps:hold"),
]


def exhaust(specs: Sequence[Spec], budget: Budget, depth: int) -> Iterator[Result]:
    """Every schedule whose first ``depth`` choices differ; the rest runs in order."""
    prefix: list[int] = []
    while True:
        used: list[int] = []

        def choose(
            moves: list[str], used: list[int] = used, prefix: list[int] = prefix
        ) -> str | None:
            if len(used) >= depth:
                return None
            choice = prefix[len(used)] if len(used) < len(prefix) else 0
            used.append(min(choice, len(moves) - 1))
            return moves[used[-1]]

        result = run_schedule(specs, choose, budget)
        yield result
        points = result.choice_points
        at = len(used) - 1
        while at >= 0 and used[at] + 1 >= points[at]:
            at -= 1
        if at < 0:
            return
        prefix = [*used[:at], used[at] + 1]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda pair: "-".join(s[2:] for s in pair))
def test_every_interleaving_of_two(tally: Tally, pair: tuple[str, str]) -> None:
    """Every interleaving of two requests' steps, with one extra move in the full run.

    The extra move (a tick of the clock, a purge or a fault) is tried at
    every point of every interleaving.
    """
    specs = [Spec.parse(text) for text in pair]
    budget = Budget(moves=99, ticks=1, purges=1, faults=1, extras=1 if FULL else 0)
    for result in exhaust(specs, budget, depth=99):
        tally.add(result)


def test_a_takeover_after_waiting_keeps_the_views_lock_wait(tally: Tally) -> None:
    """B waits for A's uncommitted claim, finds it expired, and takes it over on a second pass."""
    tally.add(run_script("A:atomic:s1:f1 B:atomic:s1:f1", "A A tick:ttl B B A A A B B B B"))


def test_a_lease_ended_on_a_dead_connection_is_given_back(tally: Tally) -> None:
    tally.add(run_script("A:lease:s1:f1:fails B:lease:s1:f1", "A A cut:A A A B B B B"))


def test_a_refused_body_keeps_the_key(tally: Tally) -> None:
    tally.add(run_script("A:lease:s1:f1 B:lease:s1:f1", "A A A refuse:A A A A B B B"))


def test_a_claim_that_ran_after_its_lease_ended_is_its_own_epoch(tally: Tally) -> None:
    """B's lease counts from its start: claimed after it ran out, it is taken over at once."""
    tally.add(run_script("A:lease:s1:f1 B:lease:s1:f1", "B tick:lease A B A A A B B"))


def test_a_refused_body_inside_the_request_transaction(tally: Tally) -> None:
    """On SQLite the lease shares the request's transaction, which rolls back whole."""
    tally.add(run_script("A:atomic:s1:f1:fails B:lease_in_tx:s1:f1", "A A A B B refuse:B B B"))


def test_a_store_that_takes_the_request_transaction_down_fails_the_request(tally: Tally) -> None:
    """A lease inside the request's transaction loses that connection while storing.

    The request's writes roll back with it, so the request must not answer
    201; its claim, committed on the lease's own connection, is released.
    """
    tally.add(
        run_script("A:lease_in_tx:s1:f1 B:atomic:s1:f1 C:atomic:s1:f1", "A A A B cut:A A A A B C C")
    )


def test_a_takeover_resumes_after_a_checkpoint_of_a_killed_owner(tally: Tally) -> None:
    """A checkpoints its effect and dies; after its lease B resumes: the effect runs once."""
    tally.add(
        run_script("A:lease:s1:f1:steps B:lease:s1:f1:steps", "A A A A kill:A tick:lease B B B B")
    )


def test_an_owner_that_outlived_its_lease_cannot_checkpoint_over_the_new_one(
    tally: Tally,
) -> None:
    """A's checkpoint after B took the key over fails (LeaseLost) and changes nothing of B's."""
    tally.add(
        run_script("A:lease:s1:f1:steps B:lease:s1:f1:steps", "A A tick:lease B B A A B B B A")
    )


def test_a_policy_settles_or_holds_a_killed_owners_claim(tally: Tally) -> None:
    for policy in ("reconcile", "hold"):
        actors = f"A:lease:s1:f1:steps:{policy} B:lease:s1:f1:steps:{policy}"
        tally.add(run_script(actors, "A A A A kill:A tick:lease B B B B"))


def test_the_operators_release_refuses_a_live_lease(tally: Tally) -> None:
    """``idempotency_keys release`` while A holds its lease: refused, so B is answered 409."""
    result = run_script("A:lease:s1:f1 B:lease:s1:f1", "A A release B B A A")
    tally.add(result)
    assert "release: refused (lease held)" in result.script
    assert "B              done: conflict" in result.script


def test_the_operators_release_frees_a_killed_owners_claim(tally: Tally) -> None:
    result = run_script("A:lease:s1:f1 B:lease:s1:f1", "A A kill:A tick:lease release B B B B")
    tally.add(result)
    assert "release: released" in result.script
    assert "B              done: ran" in result.script


def test_a_clock_jump_on_the_app_hosts_takes_no_live_lease_over(tally: Tally) -> None:
    """The app hosts' clocks jump a day ahead, past A's lease: the database's clock decides."""
    result = run_script("A:lease:s1:f1 B:lease:s1:f1", "A A jump B B A A")
    tally.add(result)
    assert "B              done: conflict" in result.script
    assert "A              done: ran" in result.script
