"""Two app servers on two nodes of a real MariaDB Galera cluster (``.ci/galera.sh``).

Every node takes writes: the same request sent to both servers at once,
to one and then the other, and to a node that has not yet applied the
original, must have one effect, no 500, and end in a replay of the one
run that committed. A node killed mid-load and started again loses and
duplicates nothing. Runs with the MariaDB suite (``dev.py test`` runs it
beside that run); without a cluster it skips, unless ``REQUIRE_GALERA=1``
(CI), where it fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db.backends.base.base import BaseDatabaseWrapper
from django.test import override_settings

from tests import galera
from tests.galera import Tally
from tests.server import DATABASE_NAME_ENV, ROOT, GunicornServer
from tests.settings import BACKEND, NAME

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(
        BACKEND != "mariadb", reason="the Galera cluster's tests run with the MariaDB suite"
    ),
]

#: The database the servers share on the cluster, after this run's test database name.
DATABASE = f"test_{NAME}_galera"


@pytest.fixture(scope="module", autouse=True)
def cluster() -> None:
    why = galera.unavailable()
    if why is None:
        return
    if os.environ.get("REQUIRE_GALERA") == "1":
        pytest.fail(f"REQUIRE_GALERA=1, but the Galera cluster is not there: {why}")
    pytest.skip(f"no three-node Galera cluster (start one with .ci/galera.sh start): {why}")


def run(tmp_path: Path, scenario: Callable[[list[GunicornServer], str], Tally]) -> Tally:
    return galera.scenario(DATABASE, tmp_path, scenario)


def assert_one_run_answered(tally: Tally) -> None:
    """What holds in every scenario: one effect, no 500, no late 409, replays at the end."""
    summary = tally.summary()
    assert [k for k in tally.keys if tally.effects[k] != 1] == [], summary
    assert tally.with_status(500) + tally.with_status(500, finals=True) == [], summary
    assert tally.conflicts_after_original() == [], summary
    assert tally.not_replays() == [], summary


class AtOnceTests:
    """The same request sent to both nodes at the same moment."""

    @pytest.mark.parametrize(
        ("path", "prefix"),
        [
            ("atomic", "a"),
            # A lost certification reported by one of the view's own statements starts over.
            ("middleware", "m"),
            ("drf-mixin", "d"),
            ("drf-function", "d"),
            ("async", "v"),
            # A view that is not protected calls a function protected by the request's key.
            ("function", "f"),
            # The same event id delivered to both nodes, as a provider's redeliveries may be.
            ("webhook", "evt"),
            # The key in the form's field, sent as a browser sends a double click.
            ("form", "b"),
        ],
    )
    def test_atomic(self, tmp_path: Path, path: str, prefix: str) -> None:
        keys = galera.keys(prefix, 60)
        tally = run(tmp_path, lambda s, db: galera.at_once(s, path, keys, 6))
        assert_one_run_answered(tally)

    def test_atomic_with_a_one_second_handler(self, tmp_path: Path) -> None:
        tally = run(tmp_path, lambda s, db: galera.at_once(s, "slow", galera.keys("s", 16), 8))
        assert_one_run_answered(tally)

    def test_lease(self, tmp_path: Path) -> None:
        tally = run(tmp_path, lambda s, db: galera.at_once(s, "lease", galera.keys("l", 60), 6))
        assert_one_run_answered(tally)
        # The claim commits before the handler: never a second run.
        assert [k for k in tally.keys if tally.runs[k] != 1] == [], tally.summary()

    @pytest.mark.parametrize("path", ["function-in-view", "function-in-middleware"])
    def test_atomic_function_in_a_protected_view(self, tmp_path: Path, path: str) -> None:
        # A race the function's claim loses is the view's claim's to start over: a replay,
        # not the function's in-flight error (a 409, or a 500 through the middleware).
        keys = galera.keys("n", 60)
        tally = run(tmp_path, lambda s, db: galera.at_once(s, path, keys, 6))
        assert_one_run_answered(tally)
        assert tally.with_status(409) == [], tally.summary()


def retried(path: str, count: int, *, lag: bool) -> Callable[[list[GunicornServer], str], Tally]:
    def scenario(servers: list[GunicornServer], db: str) -> Tally:
        keys = galera.keys(path, count)
        if not lag:
            return galera.after_original(servers, path, keys, 4, db, alternate=True)
        with galera.lagging(db):
            return galera.after_original(
                servers, path, keys, 4, db, alternate=False, ballast=galera.BALLAST
            )

    return scenario


@pytest.mark.parametrize(("path", "count"), [("atomic", 40), ("lease", 40), ("slow", 12)])
class RetryOnTheOtherNodeTests:
    """A retry sent to the other node 0-50 ms after the original answered."""

    def test_alternating(self, tmp_path: Path, path: str, count: int) -> None:
        tally = run(tmp_path, retried(path, count, lag=False))
        assert_one_run_answered(tally)
        assert [k for k in tally.keys if tally.runs[k] != 1] == [], tally.summary()

    def test_on_a_lagging_node(self, tmp_path: Path, path: str, count: int) -> None:
        tally = run(tmp_path, retried(path, count, lag=True))
        assert_one_run_answered(tally)
        # The claim waited for the node to apply the original: never a second run.
        assert [k for k in tally.keys if tally.runs[k] != 1] == [], tally.summary()
        # What the test is about: some retries reached a node that lagged.
        assert tally.stale > 0, tally.summary()


def test_a_node_killed_mid_load_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    tally = run(
        tmp_path, lambda s, db: galera.killed_mid_load(s, "atomic", galera.keys("k", 60), 6)
    )
    summary = tally.summary()
    assert [k for k in tally.keys if tally.effects[k] != 1] == [], summary
    # Node 2's server fails while its node is down; node 1's never does.
    assert tally.with_status_from(500, 0) == [], summary
    assert tally.with_status(500, finals=True) == [], summary
    assert tally.not_replays() == [], summary


@pytest.fixture
def node_as_other(django_db_blocker: Any) -> Iterator[BaseDatabaseWrapper]:
    """The ``other`` alias pointed at node 2, and the records kept there.

    A connection to the cluster's own ``mysql`` database: nothing is
    written, so no test database is needed.
    """
    from django.db import connections
    from django.db.backends.mysql.base import DatabaseWrapper

    previous = connections["other"]
    settings_dict = {**previous.settings_dict, "NAME": "mysql"}
    settings_dict.update(HOST=galera.HOST, PORT=str(galera.PORTS[1]), ATOMIC_REQUESTS=False)
    node = DatabaseWrapper(settings_dict, alias="other")
    connections["other"] = node
    try:
        with override_settings(IDEMPOTENCY={"DATABASE": "other"}), django_db_blocker.unblock():
            yield node
            node.close()
    finally:
        connections["other"] = previous


class NodeTests:
    """In this process, a connection to a node: the claim's causal wait, and the checks."""

    def test_a_claim_on_a_node_waits_for_inserts(self, node_as_other: BaseDatabaseWrapper) -> None:
        from django_idempotency.store import galera_sync_wait

        # Galera's default wsrep_sync_wait is 0: the claim adds the INSERT bit.
        assert galera_sync_wait(node_as_other) == 4

    def test_check_warns_w202(self, node_as_other: BaseDatabaseWrapper) -> None:
        from django_idempotency.backend_checks import check_galera

        [warning] = check_galera(databases=["other"])
        assert warning.id == "django_idempotency.W202"
        assert "lease mode" in warning.hint

    def test_check_refuses_atomic_requests_e202(self, node_as_other: BaseDatabaseWrapper) -> None:
        from django_idempotency.backend_checks import check_galera

        node_as_other.settings_dict["ATOMIC_REQUESTS"] = True
        messages = check_galera(databases=["other"])
        assert [message.id for message in messages] == [
            "django_idempotency.W202",
            "django_idempotency.E202",
        ]


def manage_check(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    environment = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.galera_settings",
        DATABASE_NAME_ENV: "mysql",
        galera.NODE_ENV: str(galera.PORTS[1]),
        **env,
    }
    return subprocess.run(
        [sys.executable, "-m", "django", "check", "--database", "default"],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


class ChecksOnANodeTests:
    def test_a_node_is_w202(self) -> None:
        checked = manage_check({})
        assert checked.returncode == 0, checked.stderr
        assert "django_idempotency.W202" in checked.stderr
        assert "django_idempotency.E202" not in checked.stderr

    def test_a_node_with_atomic_requests_is_e202(self) -> None:
        checked = manage_check({galera.ATOMIC_REQUESTS_ENV: "1"})
        assert checked.returncode != 0
        assert "django_idempotency.E202" in checked.stderr
