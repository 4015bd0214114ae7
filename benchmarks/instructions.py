"""CPU instructions per request, counted by callgrind: repeatable where wall time is not.

    python -m benchmarks.instructions [--requests 200] [--warmup 50] [--json PATH]

Wall time on a shared machine moves with whatever else runs; the number of
instructions the client process executes for a request does not. Each path
runs in a process of its own under ``valgrind --tool=callgrind``, with the
same settings and views as the in-process rows (:mod:`benchmarks.inprocess`):
PostgreSQL through psycopg 3, a persistent connection, Django's test client.
After warm-up requests, the measured requests run inside one call of
``operator.call``, and callgrind collects only inside that function
(``--collect-atstart=no --toggle-collect=_operator_call*``), so start-up,
warm-up and shutdown are left out without a client request compiled into
the process or a second process steering it. Instructions per request are
the collected total over the number of requests. Only the client counts:
PostgreSQL's own work is another process.

The paths, each against what it is compared with:

* a first request through ``@idempotent`` (atomic mode) against
  ``statements alone``, the same SQL sent through Django by a plain view
  (``benchmarks.bench.views.statements_alone``): the difference is the
  package's own share;
* a replay of a completed key against the undecorated handler, which runs
  its one ``INSERT``;
* a first request through the DRF mixin against the undecorated DRF view
  plus what the statements alone add to the plain view.

Then one request of each kind is traced without valgrind: the package's
Python frames (``sys.setprofile``) and the round trips to PostgreSQL
(libpq's trace, which sees ``BEGIN`` and ``COMMIT`` where Django's query
capture does not).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BODY = json.dumps({"item": "book", "quantity": 1})
#: The function callgrind collects inside: the measured batch is its only caller.
TOGGLE = "_operator_call*"
REPLAY_HEADER = "Idempotent-Replayed"
#: The package's goals, in millions of instructions per request.
FIRST_SHARE_GOAL = 0.25
REPLAY_GOAL = 0.0


@dataclass(frozen=True)
class Route:
    """One measured path: a view's URL, and whether its requests are replays."""

    url: str
    replay: bool = False


PATHS = {
    "undecorated": Route("/plain/"),
    "statements alone": Route("/statements-alone/"),
    "first": Route("/ours/"),
    "replay": Route("/ours/", replay=True),
    "undecorated DRF view": Route("/drf/"),
    "DRF mixin, first": Route("/ours-mixin/"),
}


def _keys(name: str, part: str, count: int) -> list[str]:
    """Keys of their own for each path and part, the same on every run."""
    return [hashlib.sha256(f"{name}/{part}/{i}".encode()).hexdigest()[:32] for i in range(count)]


def _post(client: Any, path: Route, key: str) -> Any:
    """One request; anything but the ``201`` it should be stops the count."""
    response = client.post(
        path.url, BODY, content_type="application/json", headers={"Idempotency-Key": key}
    )
    replayed = response.headers.get(REPLAY_HEADER) == "true"
    if response.status_code != 201 or replayed != path.replay:
        raise RuntimeError(
            f"{path.url} answered {response.status_code} (replayed: {replayed}) to key {key}"
        )
    return response


# Inside a process under callgrind ------------------------------------------------


def _measure(name: str, requests: int, warmup: int) -> None:
    """Warm ``name``'s path up, then send the measured requests inside ``operator.call``."""
    import operator

    import django

    django.setup()
    from django.test import Client

    path = PATHS[name]
    client = Client()
    warm, measured = _keys(name, "warm-up", warmup), _keys(name, "measured", requests)
    if path.replay:
        for key in warm + measured:  # complete every key the replays will send
            _post(client, PATHS["first"], key)
    for key in warm:
        _post(client, path, key)
    gc.collect()  # every run's window starts from the same heap

    def batch() -> None:
        for key in measured:
            _post(client, path, key)

    operator.call(batch)


# In the command's own process ----------------------------------------------------


class Unavailable(SystemExit):
    """What the command needs is missing; the message says how to get it."""

    def __init__(self, message: str) -> None:
        super().__init__(f"benchmarks.instructions: {message}")


def _check_requirements() -> str:
    """valgrind's version, once valgrind, Python and PostgreSQL are known to be usable."""
    if sys.version_info < (3, 11):
        raise Unavailable("needs Python 3.11 or later (the count is toggled on operator.call).")
    if shutil.which("valgrind") is None:
        raise Unavailable(
            "valgrind is not installed. Install it (Debian and Ubuntu: "
            "apt-get install valgrind; Fedora: dnf install valgrind) and run again."
        )
    found = subprocess.run(["valgrind", "--version"], capture_output=True, text=True, check=False)
    import psycopg

    from benchmarks.postgres import SERVER

    try:
        psycopg.connect(
            dbname="postgres",
            host=SERVER["HOST"],
            port=SERVER["PORT"],
            user=SERVER["USER"],
            password=SERVER["PASSWORD"] or None,
            connect_timeout=5,
        ).close()
    except psycopg.OperationalError as error:
        raise Unavailable(
            f"PostgreSQL is not reachable at {SERVER['HOST']}:{SERVER['PORT']} as user "
            f"{SERVER['USER']} ({' '.join(str(error).split())}). Start it, or point PGHOST, "
            "PGPORT, PGUSER and PGPASSWORD at a server this user may create databases on."
        ) from None
    return found.stdout.strip()


def _environment(database: str) -> dict[str, str]:
    """The settings every process of one run shares (the in-process rows')."""
    return {
        "DJANGO_SETTINGS_MODULE": "benchmarks.bench.inprocess_settings",
        "BENCH_BACKEND": "postgresql",
        "BENCH_CONN_MAX_AGE": "600",
        "BENCH_DATABASE_NAME": database,
    }


def _count(name: str, requests: int, warmup: int, database: str) -> int:
    """The instructions callgrind collected for ``requests`` requests of ``name``'s path."""
    with tempfile.TemporaryDirectory(prefix="bench-callgrind-") as directory:
        out = Path(directory) / "callgrind.out"
        command = [
            "valgrind",
            "--tool=callgrind",
            "--collect-atstart=no",
            f"--toggle-collect={TOGGLE}",
            f"--callgrind-out-file={out}",
            sys.executable,
            "-m",
            "benchmarks.instructions",
            "--measure",
            name,
            f"--requests={requests}",
            f"--warmup={warmup}",
        ]
        # A fixed hash seed: dictionaries probe alike on every run.
        env = {**os.environ, **_environment(database), "PYTHONHASHSEED": "0"}
        completed = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, check=False
        )
        if completed.returncode:
            raise RuntimeError(f"{name} under callgrind failed:\n{completed.stderr[-3000:]}")
        total = _total(out.read_text())
    if total == 0:
        raise Unavailable(
            f"callgrind collected nothing: it found no function {TOGGLE} in {sys.executable}, "
            "whose symbols are stripped. Use a Python that keeps its symbol table (one "
            "built from source, as pyenv does), or install its debug symbols."
        )
    return total


def _total(callgrind_out: str) -> int:
    """The instructions (``Ir``) a callgrind output file records in all."""
    lines = callgrind_out.splitlines()
    for prefix in ("totals:", "summary:"):
        for line in lines:
            if line.startswith(prefix):
                return int(line.split()[1])
    raise RuntimeError("callgrind wrote no totals")


@dataclass
class Traced:
    """One request, followed: the package's Python calls and the round trips."""

    calls: int
    modules: list[str]
    round_trips: list[str]
    captured: list[str]


def _trace(client: Any, path: Route, key: str) -> Traced:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from tests.databases import RoundTrips

    calls, modules = 0, set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            if module == "django_idempotency" or module.startswith("django_idempotency."):
                calls += 1
                modules.add(module)

    connection.ensure_connection()
    with RoundTrips(connection.connection) as trips, CaptureQueriesContext(connection) as queries:
        sys.setprofile(profile)
        try:
            _post(client, path, key)
        finally:
            sys.setprofile(None)
    captured = [query["sql"] for query in queries.captured_queries]
    return Traced(calls, sorted(modules), trips.sent(), captured)


TRACED = ["first", "replay", "DRF mixin, first", "statements alone", "undecorated"]


def _traces() -> dict[str, Traced]:
    """One request of each kind, after warm-up, in this process."""
    from django.test import Client

    client = Client()
    traced = {}
    for name in TRACED:
        path = PATHS[name]
        warm, (key,) = _keys(name, "traced warm-up", 5), _keys(name, "traced", 1)
        if path.replay:
            for first in [*warm, key]:
                _post(client, PATHS["first"], first)
        for warm_key in warm:
            _post(client, path, warm_key)
        traced[name] = _trace(client, path, key)
    return traced


def _short(sql: str, width: int = 64) -> str:
    text = " ".join(sql.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _in_capture(sent: str, captured: list[str]) -> bool:
    start = " ".join(sent.split())[:48]
    return any(" ".join(sql.split()).startswith(start) for sql in captured)


def _tables(per_request: dict[str, float], traced: dict[str, Traced]) -> list[Any]:
    from benchmarks.report import MISSED, OK, Table

    millions = {name: count / 1e6 for name, count in per_request.items()}
    statements_cost = millions["statements alone"] - millions["undecorated"]
    counted = Table(
        "Instructions per request (PostgreSQL, client process, callgrind)",
        ["path", "instructions per request (M)", "baseline", "baseline (M)",
         "package's share (M)", "goal"],
    )  # fmt: skip
    rows = [
        ("first request, @idempotent", "first", "statements alone",
         millions["statements alone"], FIRST_SHARE_GOAL),
        ("replay, @idempotent", "replay", "undecorated view",
         millions["undecorated"], REPLAY_GOAL),
        ("first request, DRF mixin", "DRF mixin, first",
         "undecorated DRF view + the statements",
         millions["undecorated DRF view"] + statements_cost, FIRST_SHARE_GOAL),
    ]  # fmt: skip
    for label, name, baseline_label, baseline, goal in rows:
        share = millions[name] - baseline
        verdict = OK if share <= goal else MISSED
        counted.add(
            label,
            f"{millions[name]:.3f}",
            baseline_label,
            f"{baseline:.3f}",
            f"{share:+.3f}",
            f"<= {goal:+.2f}: {verdict}",
        )
    counted.notes += [
        f"undecorated view {millions['undecorated']:.3f} M, statements alone "
        f"{millions['statements alone']:.3f} M (the contract's statements through Django, "
        f"{statements_cost:+.3f} M), undecorated DRF view "
        f"{millions['undecorated DRF view']:.3f} M",
        "goals: the package's own share of a first request at most 0.25 M; "
        "a replay no more than the undecorated handler",
        "the middleware is not counted: the in-process harness has no view behind it",
    ]
    followed = Table(
        "One request followed (PostgreSQL)",
        ["request", "package's Python calls", "package's modules", "round trips",
         "statements in Django's capture"],
    )  # fmt: skip
    for name, one in traced.items():
        followed.add(name, one.calls, len(one.modules), len(one.round_trips), len(one.captured))
    followed.notes += [
        "calls: Python functions of django_idempotency entered (sys.setprofile 'call' "
        "events, generators resumed included); the views without the package use its SQL "
        "builders and its request-end receivers",
        "modules a first request crosses: " + ", ".join(traced["first"].modules),
    ]
    trips = Table(
        "Round trips of one first request through @idempotent (libpq's trace)",
        ["#", "statement", "in Django's capture"],
    )
    first = traced["first"]
    for number, sent in enumerate(first.round_trips, 1):
        trips.add(number, _short(sent), "yes" if _in_capture(sent, first.captured) else "no")
    missing = [
        sent.split()[0] for sent in first.round_trips if not _in_capture(sent, first.captured)
    ]
    trips.notes.append(
        "every round trip is in Django's query capture too, BEGIN and COMMIT included"
        if not missing
        else f"Django's query capture does not list {', '.join(missing)}: only libpq's trace does"
    )
    return [counted, followed, trips]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="measured requests per path")
    parser.add_argument("--warmup", type=int, default=50, help="requests before the count")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the figures here too")
    parser.add_argument("--measure", choices=sorted(PATHS), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.requests < 1 or options.warmup < 0:
        parser.error("--requests must be at least 1 and --warmup at least 0")
    sys.path.insert(0, str(ROOT))
    if options.measure:
        _measure(options.measure, options.requests, options.warmup)
        return
    valgrind = _check_requirements()
    database = f"bench_instructions_{uuid.uuid4().hex[:12]}"
    os.environ.update(_environment(database))
    import django

    django.setup()
    from django.db import connection

    old_name = connection.creation.create_test_db(verbosity=0, autoclobber=True)
    try:
        traced = _traces()
        connection.ensure_connection()
        server = connection.pg_version
        connection.close()
        per_request = {}
        for name in PATHS:
            print(f"counting {name} ...", file=sys.stderr, flush=True)
            per_request[name] = _count(name, options.requests, options.warmup, database) / (
                options.requests
            )
    finally:
        connection.close()
        connection.creation.destroy_test_db(old_name, verbosity=0)
    tables = _tables(per_request, traced)
    facts = (
        f"{valgrind}, Python {platform.python_version()}, Django {version('Django')}, "
        f"psycopg {version('psycopg')}, PostgreSQL {server // 10000}.{server % 10000}; "
        f"{options.requests} requests per path after {options.warmup} warm-up requests"
    )
    sys.stderr.flush()
    print(facts)
    for table in tables:
        print()
        print(table.text())
    if options.json:
        options.json.write_text(
            json.dumps(
                {
                    "facts": facts,
                    "requests": options.requests,
                    "warmup": options.warmup,
                    "instructions_per_request": per_request,
                    "traced": {name: vars(one) for name, one in traced.items()},
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
