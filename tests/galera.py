"""The three-node Galera cluster the multi-primary tests run on (``.ci/galera.sh``).

Where the nodes are, statements on one node, a node killed and started
again, a writer that keeps the other nodes' appliers busy (so that they
lag), and the scenarios the tests race across two app servers, each on
its own node. ``python -m tests.galera`` prints the scenarios' table.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from tests.server import DATABASE_NAME_ENV, ROOT, GunicornServer, kill9, wait_for_exit

HOST = os.environ.get("TEST_GALERA_HOST", "127.0.0.1")
#: The nodes' SQL ports, node 1 first.
PORTS = [int(port) for port in os.environ.get("TEST_GALERA_PORTS", "3311,3312,3313").split(",")]
#: Where ``.ci/galera.sh`` keeps each node's data directory and pid file.
CLUSTER_ROOT = Path(os.environ.get("GALERA_ROOT", "/var/tmp/idempotency-galera"))
SCRIPT = ROOT / ".ci" / "galera.sh"
#: The environment variable naming the file each handler run is appended to.
RUNS_ENV = "IDEMPOTENCY_GALERA_RUNS"
#: The environment variable naming the node a server talks to (its SQL port).
NODE_ENV = "IDEMPOTENCY_GALERA_PORT"
#: Set to ``1`` to turn ``ATOMIC_REQUESTS`` on in ``tests.galera_settings``.
ATOMIC_REQUESTS_ENV = "IDEMPOTENCY_GALERA_ATOMIC_REQUESTS"
REQUEST_TIMEOUT = 30
#: Rows each request updates in the lagging-node scenarios (see :func:`lagging`).
BALLAST = int(os.environ.get("TEST_GALERA_BALLAST", "200"))
#: The signing secret of the webhook receiver (``webhook/``).
WEBHOOK_SECRET = "whsec_galera"
#: The form field a browser's form (``form/``) carries its key in: the default ``FORM_FIELD``.
FORM_FIELD = "idempotency_key"


def connect(port: int, database: str | None = None) -> Any:
    """A connection to one node, in autocommit."""
    import MySQLdb  # only where the MariaDB driver is installed

    connection = MySQLdb.connect(
        host=HOST,
        port=port,
        user=os.environ.get("TEST_GALERA_USER", "root"),
        password=os.environ.get("TEST_GALERA_PASSWORD", ""),
        database=database or "",
        charset="utf8mb4",
        connect_timeout=5,
    )
    connection.autocommit(True)
    return connection


def query(port: int, sql: str, database: str | None = None) -> list[tuple[Any, ...]]:
    connection = connect(port, database)
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql)
            return list(cursor.fetchall())
    finally:
        connection.close()


def unavailable() -> str | None:
    """Why the cluster cannot be used, or ``None`` when its three nodes are synced."""
    import MySQLdb

    try:
        for port in PORTS:
            status = dict(query(port, "SHOW STATUS LIKE 'wsrep_%'"))
            if status.get("wsrep_local_state_comment") != "Synced":
                return f"node on port {port} is {status.get('wsrep_local_state_comment')!r}"
            if status.get("wsrep_cluster_size") != str(len(PORTS)):
                return f"the cluster has {status.get('wsrep_cluster_size')} nodes"
    except MySQLdb.Error as exc:
        return f"no Galera node answers on {HOST}:{PORTS}: {exc}"
    return None


def kill_node(index: int) -> None:
    """``kill -9`` the server of node ``index`` (0 is node 1)."""
    pid = int((CLUSTER_ROOT / f"node{index + 1}" / "mysqld.pid").read_text())
    kill9(pid)
    wait_for_exit(pid, limit=30)


def start_missing_nodes() -> None:
    """Start the nodes that are down again; they rejoin (IST or SST) before this returns."""
    subprocess.run([str(SCRIPT), "start"], check=True, capture_output=True, timeout=300)


@contextmanager
def database(name: str) -> Iterator[str]:
    """A fresh database on the cluster with the test apps' tables, dropped on the way out."""
    query(PORTS[0], f"DROP DATABASE IF EXISTS `{name}`")
    query(PORTS[0], f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci")
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.galera_settings"}
    env.update({DATABASE_NAME_ENV: name, NODE_ENV: str(PORTS[0]), RUNS_ENV: os.devnull})
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--run-syncdb", "--skip-checks", "-v", "0"],
        check=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    try:
        yield name
    finally:
        query(PORTS[0], f"DROP DATABASE IF EXISTS `{name}`")


@contextmanager
def servers(
    name: str, log_dir: Path, runs: Path, nodes: tuple[int, ...] = (0, 1)
) -> Iterator[list[GunicornServer]]:
    """One gunicorn server per node in ``nodes``, all on database ``name``."""
    started: list[GunicornServer] = []
    try:
        for index in nodes:
            env = {
                "DJANGO_SETTINGS_MODULE": "tests.galera_settings",
                DATABASE_NAME_ENV: name,
                NODE_ENV: str(PORTS[index]),
                RUNS_ENV: str(runs),
            }
            server_log = log_dir / f"node{index + 1}"
            server_log.mkdir(exist_ok=True)
            server = GunicornServer(env, server_log, workers=4)
            server.start("/ping/")
            started.append(server)
        yield started
    finally:
        for server in started:
            server.stop()


@contextmanager
def lagging(name: str, rows: int = BALLAST) -> Iterator[None]:
    """A table that makes a request's write set slow to apply on the other nodes.

    ``galera_ballast`` has no primary key: a node applying another node's
    write set finds each updated row by scanning the table, while the node
    that ran the ``UPDATE`` found them all in one scan. A request sent with
    ``ballast`` (see :func:`post`) updates a twentieth of its ``20 * rows``
    rows, so for a moment after it answered, the other nodes have not
    applied it (nor anything it committed).
    """
    query(PORTS[0], "CREATE TABLE galera_ballast (part INT NOT NULL, v INT NOT NULL)", name)
    query(
        PORTS[0],
        f"INSERT INTO galera_ballast SELECT seq % 20, 0 FROM seq_1_to_{20 * rows}",
        name,
    )
    try:
        yield
    finally:
        query(PORTS[0], "DROP TABLE galera_ballast", name)


@dataclass
class Answer:
    server: int
    status: int
    body: bytes
    replayed: bool
    retry_after: str | None = None


def stripe_event(key: str) -> dict[str, Any]:
    """A Stripe delivery of the event whose id is ``key``, signed as Stripe signs it."""
    from django_idempotency.webhooks import stripe_signature

    body = json.dumps({"id": key, "type": "checkout.session.completed"}).encode()
    headers = stripe_signature(WEBHOOK_SECRET).headers(body)
    return {"data": body, "headers": {**headers, "Content-Type": "application/json"}}


def form_submission(key: str) -> dict[str, Any]:
    """A browser's submission of a rendered form: the key in its field, no header."""
    accept = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
    return {"data": {FORM_FIELD: key, "item": "book"}, "headers": {"Accept": accept}}


#: How a request to each path carries its key, where not in the ``Idempotency-Key`` header.
REQUESTS: dict[str, Callable[[str], dict[str, Any]]] = {
    "webhook": stripe_event,
    "form": form_submission,
}


def post(server: GunicornServer, index: int, path: str, key: str, ballast: int = 0) -> Answer:
    """POST to ``path`` with the key; with ``ballast``, a write set slow to apply elsewhere."""
    request = REQUESTS.get(path, lambda key: {"headers": {"Idempotency-Key": key}})(key)
    try:
        response = requests.post(
            f"{server.url}/{path}/",
            params={"ballast": ballast} if ballast else None,
            timeout=REQUEST_TIMEOUT,
            **request,
        )
    except requests.RequestException as exc:
        return Answer(index, 0, str(exc).encode(), False)
    return Answer(
        index,
        response.status_code,
        response.content,
        response.headers.get("Idempotent-Replayed") == "true",
        response.headers.get("Retry-After"),
    )


@dataclass
class Tally:
    """What one scenario saw, per key: the answers, the final retries, the runs, the effects."""

    keys: list[str]
    answers: dict[str, list[Answer]] = field(default_factory=lambda: defaultdict(list))
    finals: dict[str, list[Answer]] = field(default_factory=lambda: defaultdict(list))
    runs: Counter[str] = field(default_factory=Counter)
    effects: Counter[str] = field(default_factory=Counter)
    #: Keys whose record the retry's node had not applied when the retry was sent.
    stale: int = 0

    def with_status(self, status: int, *, finals: bool = False) -> list[str]:
        source = self.finals if finals else self.answers
        return [key for key in self.keys if any(a.status == status for a in source[key])]

    def with_status_from(self, status: int, server: int) -> list[str]:
        return [
            key
            for key in self.keys
            if any(a.status == status and a.server == server for a in self.all(key))
        ]

    def all(self, key: str) -> list[Answer]:
        return [*self.answers[key], *self.finals[key]]

    def conflicts_after_original(self) -> list[str]:
        """Keys answered 409 by a request sent after another request of the key had answered."""
        return [key for key in self.keys if any(a.status == 409 for a in self.finals[key])]

    def not_replays(self) -> list[str]:
        """Keys whose final retries were not replays of the one run that answered 201."""
        wrong = []
        for key in self.keys:
            fresh = {a.body for a in self.all(key) if a.status == 201 and not a.replayed}
            finals = self.finals[key]
            replays = all(a.status == 201 and a.replayed for a in finals)
            same = all(a.body in fresh for a in finals) if fresh else True
            if len(fresh) > 1 or not replays or not same:
                wrong.append(key)
        return wrong

    def summary(self) -> dict[str, Any]:
        return {
            "keys": len(self.keys),
            "effects != 1": sum(1 for key in self.keys if self.effects[key] != 1),
            "keys run on 2 nodes": sum(1 for key in self.keys if self.runs[key] > 1),
            "keys with a 500": len(
                set(self.with_status(500)) | set(self.with_status(500, finals=True))
            ),
            "keys with a 500 from node 1's server": len(self.with_status_from(500, 0)),
            "keys with 409 after the original answered": len(self.conflicts_after_original()),
            "final retries not a replay": len(self.not_replays()),
            "stale node at retry": self.stale,
        }

    def collect(self, name: str, runs: Path) -> None:
        for line in runs.read_text().splitlines():
            self.runs[line.split()[0]] += 1
        rows = query(PORTS[0], "SELECT item, COUNT(*) FROM tests_order GROUP BY item", name)
        self.effects.update({item: count for item, count in rows})


def _stale_on(port: int, name: str, key: str) -> bool:
    """Whether the node has not yet applied the key's record (read without a causal wait)."""
    rows = query(
        port,
        "SELECT SQL_NO_CACHE COUNT(*) FROM django_idempotency_idempotencykey "
        f"WHERE `key` = '{key}' AND state = 'completed'",
        name,
    )
    return rows[0][0] == 0


def at_once(
    servers: list[GunicornServer],
    path: str,
    keys: list[str],
    parallel: int,
    *,
    retry: bool = True,
    answered: Callable[[int], None] | None = None,
) -> Tally:
    """Each key sent to both servers at the same moment; then (``retry``) one retry to each.

    ``answered`` is told how many keys have had both answers, after each.
    """
    tally = Tally(keys)
    done = [0]
    lock = threading.Lock()

    def race(key: str) -> None:
        barrier = threading.Barrier(2)

        def send(index: int) -> Answer:
            barrier.wait(timeout=REQUEST_TIMEOUT)
            return post(servers[index], index, path, key)

        with ThreadPoolExecutor(max_workers=2) as pair:
            tally.answers[key].extend(pair.map(send, [0, 1]))
        if answered is not None:
            with lock:
                done[0] += 1
                answered(done[0])
        if retry:
            retry_all(servers, path, key, tally)

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        list(pool.map(race, keys))
    return tally


def retry_all(servers: list[GunicornServer], path: str, key: str, tally: Tally) -> None:
    """The key sent once more to each server, after every earlier request of it answered."""
    for index, server in enumerate(servers):
        tally.finals[key].append(post(server, index, path, key))


def killed_mid_load(
    servers: list[GunicornServer], path: str, keys: list[str], parallel: int
) -> Tally:
    """Duplicates at once on both nodes; node 2 killed a third of the way in, then restarted.

    Once node 2 is back (it rejoins by state transfer), every key is sent
    to both servers again: each must replay the one run that committed.
    """
    killed = threading.Event()

    def kill_at_a_third(count: int) -> None:
        if count >= len(keys) // 3 and not killed.is_set():
            killed.set()
            kill_node(1)

    try:
        tally = at_once(servers, path, keys, parallel, retry=False, answered=kill_at_a_third)
        assert killed.is_set()
    finally:
        # Back whatever happened: the tests after this one need three nodes.
        start_missing_nodes()
    for key in keys:
        retry_all(servers, path, key, tally)
    return tally


def after_original(
    servers: list[GunicornServer],
    path: str,
    keys: list[str],
    parallel: int,
    name: str,
    *,
    alternate: bool,
    ballast: int = 0,
) -> Tally:
    """Each key sent to one server, then again to the other 0-50 ms after it answered.

    With ``alternate`` the servers take turns (even keys go to the first
    one first), else the originals all go to the first. With ``ballast``
    (see :func:`lagging`) the other node applies each request late. The retry's
    node is read beside the retry (without a causal wait), to count the
    retries that reached a node which had not applied the original yet.
    """
    tally = Tally(keys)
    stale = [0]
    lock = threading.Lock()

    def original_then_retry(position: int) -> None:
        key = keys[position]
        first, second = (1, 0) if alternate and position % 2 else (0, 1)
        tally.answers[key].append(post(servers[first], first, path, key, ballast))
        time.sleep(random.uniform(0, 0.05))  # the client's own retry delay
        with ThreadPoolExecutor(max_workers=1) as side:
            seen = side.submit(_stale_on, PORTS[second], name, key)
            tally.finals[key].append(post(servers[second], second, path, key, ballast))
            if seen.result():
                with lock:
                    stale[0] += 1

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        list(pool.map(original_then_retry, range(len(keys))))
    tally.stale = stale[0]
    return tally


def scenario(name: str, log_dir: Path, run: Callable[[list[GunicornServer], str], Tally]) -> Tally:
    """``run`` against two servers on nodes 1 and 2, on a fresh database; its tally collected."""
    runs = log_dir / "runs.txt"
    runs.write_text("")
    with database(name) as db, servers(db, log_dir, runs) as both:
        tally = run(both, db)
        tally.collect(db, runs)
    return tally


SCENARIOS: dict[str, Callable[[list[GunicornServer], str], Tally]] = {
    "atomic, at once": lambda s, db: at_once(s, "atomic", keys("a", 60), 6),
    "atomic, 1 s handler, at once": lambda s, db: at_once(s, "slow", keys("s", 24), 8),
    "lease, at once": lambda s, db: at_once(s, "lease", keys("l", 60), 6),
}


def keys(prefix: str, count: int) -> list[str]:
    return [f"{prefix}-{index}" for index in range(count)]


def alternating(path: str, count: int) -> Callable[[list[GunicornServer], str], Tally]:
    def run(both: list[GunicornServer], db: str) -> Tally:
        return after_original(both, path, keys(path[0], count), 4, db, alternate=True)

    return run


def lagged(path: str, count: int) -> Callable[[list[GunicornServer], str], Tally]:
    def run(both: list[GunicornServer], db: str) -> Tally:
        with lagging(db):
            return after_original(
                both, path, keys(path[0], count), 4, db, alternate=False, ballast=BALLAST
            )

    return run


SCENARIOS.update(
    {
        "atomic, node 2 killed mid-load": lambda s, db: killed_mid_load(
            s, "atomic", keys("k", 90), 6
        ),
        "atomic, alternating": alternating("atomic", 60),
        "lease, alternating": alternating("lease", 60),
        "atomic, retry on a lagging node": lagged("atomic", 60),
        "atomic, 1 s handler, retry on a lagging node": lagged("slow", 16),
        "lease, retry on a lagging node": lagged("lease", 60),
    }
)


def main() -> None:
    """Print each scenario's tally: ``python -m tests.galera [name-prefix]``."""
    import tempfile

    only = sys.argv[1] if len(sys.argv) > 1 else ""
    for name, run in SCENARIOS.items():
        if not name.startswith(only):
            continue
        with tempfile.TemporaryDirectory() as log_dir:
            started = time.monotonic()
            tally = scenario("idempotency_galera_demo", Path(log_dir), run)
            print(f"{name} ({time.monotonic() - started:.0f} s): {tally.summary()}", flush=True)


if __name__ == "__main__":
    import django

    django.setup()
    main()
