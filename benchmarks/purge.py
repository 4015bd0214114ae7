"""Benchmark the purge on PostgreSQL beside a steady stream of claims.

Creates its own database and, for each pace, fills it with ``--rows``
expired records in one ``INSERT ... SELECT generate_series`` statement,
then measures claims made by a writer in a separate process (as a web
server's would be), one every ``--claim-interval`` seconds (default
0.01 s) through the package's claim (``store.claim`` in a transaction),
half of them new keys and half taking over expired rows the purge is
deleting. The writer claims for ``--idle-seconds`` with no purge running
(*idle*), then during :func:`django_idempotency.purge.purge_expired`
(*during*), and stops when the purge ends. The paces (``--pace``):

* ``before``: the purge as it was, fixed batches of ``--batch-size`` back
  to back, each walking the ``expires_at`` index from its start;
* ``unpaced``: this version's batches (each starting where the last
  ended), back to back;
* ``after``: this version with its defaults, or with ``--batch-seconds``,
  ``--pause`` and ``--rate`` when given.

It prints one row per pace (the purge's rows/s and seconds, and the
claims' p50, p99 and max latency idle and during the purge; with
``--repeat`` the medians of interleaved runs), writes the rows and the
time series (each claim's latency, the purge's progress) as JSON with
``--json PATH``, and two SVG charts with ``--charts DIR``.

    python benchmarks/purge.py --rows 1000000 --json purge.json --charts docs/_static/benchmarks

Connection settings come from ``PGHOST``/``PGPORT``/``PGUSER``/``PGPASSWORD``
(default: postgres on 127.0.0.1:5432). The database is dropped at the end.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import resource
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import django
from django.conf import settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.postgres import SERVER, admin_sql
from benchmarks.report import Table, environment

DATABASE_NAME = f"idempotency_purge_bench_{os.getpid()}"

PACES = ("before", "unpaced", "after")

#: Claims the writer makes before it is measured.
WARM_UP = 50

#: The shortest window of the latency chart, in seconds: one point per window.
CHART_WINDOW = 0.5


def configure() -> None:
    settings.configure(
        DATABASES={
            "default": {"ENGINE": "django.db.backends.postgresql", "NAME": DATABASE_NAME} | SERVER,
        },
        INSTALLED_APPS=["django_idempotency"],
        USE_TZ=True,
        TIME_ZONE="UTC",
    )
    django.setup()


def fill(rows: int) -> None:
    """``rows`` expired records written by the server in one statement, once per run.

    Each pace then purges a copy of this database (:func:`copy_database`),
    which takes seconds where filling takes minutes at 10,000,000 rows.
    """
    from django.db import connection

    from django_idempotency.models import IdempotencyKey

    table = connection.ops.quote_name(IdempotencyKey._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (scope, key, fingerprint, state, status_code, "
            "response_headers, response_body, owner_token, created_at, expires_at, attempt) "
            "SELECT 'bench', 'expired-' || n, repeat('f', 64), 'completed', 201, "
            """'[["Content-Type", "application/json"]]'::jsonb, '{"ok": true}'::bytea, '', """
            "now() - interval '25 hours', now() - interval '1 hour' - n * interval '1 ms', 1 "
            "FROM generate_series(1, %s) AS n",
            [rows],
        )
        cursor.execute(f"VACUUM ANALYZE {table}")
    connection.close()


def copy_database(name: str) -> None:
    """A copy of the filled database, for one pace, that Django's connections use.

    ``FILE_COPY`` checkpoints and copies the files, so every pace starts from
    the same state: nothing dirty left to write, nothing of the table cached.
    """
    from django.db import connections

    connections.close_all()
    admin_sql(f'CREATE DATABASE "{name}" TEMPLATE "{DATABASE_NAME}" STRATEGY FILE_COPY')
    connections["default"].settings_dict["NAME"] = name


def checkpoint() -> None:
    """Write what the purge left dirty, so that the claims after it are idle again."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("CHECKPOINT")


def write_claims(rows: int, interval: float, ready: Any, stop: Any, results: Any) -> None:
    """The writer process: one claim every ``interval`` seconds, each timed.

    Claims start on a fixed schedule; one that overruns its slot delays the
    next, which then starts at once (no burst to catch up). Latency is from
    the claim's start to its commit. Sends ``[(start, seconds, failed)]``.
    """
    from django.db import DatabaseError, connection, transaction

    from django_idempotency import store
    from django_idempotency.info import IdempotencyInfo

    rng = random.Random(0)
    samples: list[tuple[float, float, bool]] = []

    def claim(count: int) -> None:
        key = f"expired-{rng.randint(1, rows)}" if count % 2 else f"new-{count}-{rng.random()}"
        info = IdempotencyInfo(key=key, scope="bench", fingerprint="f" * 64)
        new = store.NewClaim.of(info, ttl=timedelta(hours=24))
        started = time.monotonic()
        failed = False
        try:
            with transaction.atomic():
                store.claim("default", new, wait=5.0)
        except DatabaseError:
            failed = True
        samples.append((started, time.monotonic() - started, failed))

    try:
        # Connected, statements prepared, caches warm: measured from then on.
        for count in range(WARM_UP):
            claim(count)
        samples.clear()
        ready.set()
        due = time.monotonic()
        count = WARM_UP
        while not stop.is_set():
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            claim(count)
            count += 1
            due = max(due + interval, time.monotonic())
    finally:
        connection.close()
        results.put(samples)


def delete_batch_before(connection: Any, cutoff: Any, batch_size: int, passed: Any) -> Any:
    """The batch as it was before the purge yielded: each one walks the index from its start."""
    from django_idempotency import purge as purge_module

    table, pk, expires = purge_module._names(connection)
    batch = f"SELECT {pk} FROM {table} WHERE {expires} <= %s ORDER BY {expires} LIMIT %s"
    sql = f"DELETE FROM {table} WHERE {pk} = ANY(ARRAY({batch} FOR UPDATE SKIP LOCKED))"
    with connection.cursor() as cursor:
        cursor.execute(sql, [cutoff, batch_size])
        removed = cursor.rowcount
    return purge_module.Batch(removed)


@dataclass
class Run:
    pace: str
    settings: dict[str, Any]
    rows: int
    seconds: float
    idle: list[float]
    during: list[float]
    failed: int
    claims: list[tuple[float, float]]
    progress: list[tuple[float, int]]
    #: The machine's one-minute load average when the purge ended.
    load: float
    #: Seconds from the purge's start to the idle window after it.
    idle_again: float

    def summary(self) -> dict[str, Any]:
        idle, during = _stats(self.idle), _stats(self.during)
        return {
            "pace": self.pace,
            **self.settings,
            "rows": self.rows,
            "seconds": round(self.seconds, 2),
            "rows_per_s": round(self.rows / self.seconds),
            "idle_p50_ms": idle["p50"],
            "idle_p99_ms": idle["p99"],
            "idle_max_ms": idle["max"],
            "during_p50_ms": during["p50"],
            "during_p99_ms": during["p99"],
            "during_max_ms": during["max"],
            "p99_ratio": round(during["p99"] / idle["p99"], 2),
            "claims_idle": len(self.idle),
            "claims_during": len(self.during),
            "claims_failed": self.failed,
            # Linux reports kilobytes; the purge's process only (the writer has its own).
            "rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "load": round(self.load, 1),
        }


#: The figures a table row shows, each the median over a pace's runs.
MEASURED = (
    "rows",
    "seconds",
    "rows_per_s",
    "idle_p50_ms",
    "idle_p99_ms",
    "idle_max_ms",
    "during_p50_ms",
    "during_p99_ms",
    "during_max_ms",
    "p99_ratio",
    "load",
)


def _median(values: list[float]) -> float:
    return statistics.median(values)


def median_run(runs: list[Run]) -> Run:
    """The run whose p99 ratio is the median (the lower middle one of an even count)."""
    ordered = sorted(runs, key=lambda one: one.summary()["p99_ratio"])
    return ordered[(len(ordered) - 1) // 2]


def _stats(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    ms = sorted(value * 1000 for value in seconds)
    cuts = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else ms * 99
    return {"p50": round(cuts[49], 2), "p99": round(cuts[98], 2), "max": round(ms[-1], 2)}


def run(options: argparse.Namespace, pace: str) -> Run:
    """Claim idle for a while, purge while claiming, checkpoint, claim idle again."""
    from django.db import connections

    from django_idempotency import purge

    if pace in ("before", "unpaced"):
        pacing: dict[str, Any] = {"batch_seconds": None, "pause": 0.0, "rate": None}
    else:
        pacing = {
            "batch_seconds": options.batch_seconds or purge.DEFAULT_BATCH_SECONDS,
            "pause": purge.DEFAULT_PAUSE if options.pause is None else options.pause,
            "rate": options.rate,
        }
    copy = f"{DATABASE_NAME}_{pace}"
    copy_database(copy)  # and no connection open: the writer is forked
    try:
        return _run(options, pace, pacing)
    finally:
        connections.close_all()
        connections["default"].settings_dict["NAME"] = DATABASE_NAME
        admin_sql(f'DROP DATABASE IF EXISTS "{copy}" WITH (FORCE)')


def _run(options: argparse.Namespace, pace: str, pacing: dict[str, Any]) -> Run:
    from django.db import connections

    from django_idempotency import purge

    context = multiprocessing.get_context("fork")
    ready, stop, results = context.Event(), context.Event(), context.Queue()
    writer = context.Process(
        target=write_claims,
        args=(options.rows, options.claim_interval, ready, stop, results),
    )
    writer.start()
    if not ready.wait(60):
        raise SystemExit("The writer did not connect within 60 s.")
    time.sleep(options.idle_seconds)  # the idle window being measured

    progress: list[tuple[float, int]] = []
    started = time.monotonic()
    progress.append((started, 0))
    statement = purge._DELETE_BATCH["postgresql"]
    if pace == "before":
        purge._DELETE_BATCH["postgresql"] = delete_batch_before
    try:
        deleted = purge.purge_expired(
            batch_size=options.batch_size,
            progress=lambda total: progress.append((time.monotonic(), total)),
            **pacing,
        )
    finally:
        purge._DELETE_BATCH["postgresql"] = statement
    ended = time.monotonic()
    checkpoint()
    idle_again = time.monotonic()
    time.sleep(options.idle_seconds)  # the idle window after the purge
    stop.set()
    samples = results.get(timeout=60)
    writer.join(60)
    connections.close_all()

    ok = [(at, seconds) for at, seconds, failed in samples if not failed]
    return Run(
        pace=pace,
        settings={"batch_size": options.batch_size, **pacing},
        rows=deleted,
        seconds=ended - started,
        idle=[seconds for at, seconds in ok if at < started or at >= idle_again],
        during=[seconds for at, seconds in ok if started <= at <= ended],
        failed=sum(1 for *_, failed in samples if failed),
        claims=[(round(at - started, 4), round(seconds * 1000, 3)) for at, seconds in ok],
        idle_again=idle_again - started,
        progress=[(round(at - started, 4), total) for at, total in progress],
        load=os.getloadavg()[0],
    )


def table(runs: list[Run], options: argparse.Namespace) -> Table:
    result = Table(
        f"Purge of {options.rows:,} expired rows beside claims every "
        f"{options.claim_interval * 1000:g} ms (PostgreSQL)",
        [
            "pace",
            "settings",
            "rows",
            "seconds",
            "rows/s",
            "idle p50 ms",
            "idle p99 ms",
            "idle max ms",
            "during p50 ms",
            "during p99 ms",
            "during max ms",
            "p99 during/idle",
            "load",
        ],
    )
    for pace in options.pace:
        mine = [one.summary() for one in runs if one.pace == pace]
        row = {name: _median([one[name] for one in mine]) for name in MEASURED}
        result.add(
            pace,
            _describe(next(one for one in runs if one.pace == pace).settings),
            f"{row['rows']:,.0f}",
            f"{row['seconds']:.1f}",
            f"{row['rows_per_s']:,.0f}",
            f"{row['idle_p50_ms']:.1f}",
            f"{row['idle_p99_ms']:.1f}",
            f"{row['idle_max_ms']:.0f}",
            f"{row['during_p50_ms']:.1f}",
            f"{row['during_p99_ms']:.1f}",
            f"{row['during_max_ms']:.0f}",
            f"{row['p99_ratio']:.1f}x",
            f"{row['load']:.1f}",
        )
    result.notes = [
        f"Claims: one every {options.claim_interval * 1000:g} ms from a separate process, "
        "half new keys, half taking over expired rows; latency from the claim's start to "
        f"its commit. Idle: the {options.idle_seconds:g} s before the purge and the "
        f"{options.idle_seconds:g} s after it, once a CHECKPOINT has written what it left "
        "dirty (claims during that CHECKPOINT are in neither).",
        "Load: the machine's one-minute load average as the purge ended.",
    ]
    if options.repeat > 1:
        result.notes.append(
            f"Each cell is the median of {options.repeat} interleaved runs of each pace."
        )
    return result


def _describe(pacing: dict[str, Any]) -> str:
    return ", ".join(f"{name}={value:g}" for name, value in pacing.items() if value is not None)


def charts(runs: list[Run], directory: Path, rows: int) -> None:
    """Claim latency over time (the worst claim per window) and rows deleted over time."""
    from benchmarks.charts import line_chart

    # About 150 windows across the longest run: every stall shows, and the
    # chart stays readable.
    window = max(CHART_WINDOW, round(max(one.seconds for one in runs) / 150))
    latency: dict[str, list[tuple[float, float]]] = {}
    deleted: dict[str, list[tuple[float, float]]] = {}
    for one in runs:
        windows = {
            "idle before": [(at, ms) for at, ms in one.claims if at < 0],
            "purge running": [(at, ms) for at, ms in one.claims if 0 <= at <= one.seconds],
            "idle after": [(at, ms) for at, ms in one.claims if at >= one.idle_again],
        }
        for name, points in windows.items():
            if points:
                latency[f"{one.pace}: {name}"] = _worst_per_window(points, window)
        deleted[one.pace] = _thin([(at, float(total)) for at, total in one.progress], 60)
    line_chart(
        directory / "purge-latency.svg",
        f"Claims beside a purge of {rows:,} records",
        "seconds since the purge started",
        f"worst claim per {window:g} s (ms)",
        latency,
        log_y=True,
    )
    line_chart(
        directory / "purge-rate.svg",
        f"A purge of {rows:,} records",
        "seconds since the purge started",
        "records deleted",
        deleted,
    )


def _worst_per_window(
    points: list[tuple[float, float]], seconds: float
) -> list[tuple[float, float]]:
    windows: dict[int, float] = {}
    for at, ms in points:
        window = int(at // seconds)
        windows[window] = max(windows.get(window, 0.0), ms)
    return [(window * seconds, ms) for window, ms in sorted(windows.items())]


def replot(path: Path, directory: Path) -> None:
    """The charts again from a run's ``--json`` file, without running anything."""
    saved = json.loads(path.read_text())
    runs = [
        Run(
            pace=pace,
            settings={},
            rows=0,
            seconds=series["seconds"],
            idle=[],
            during=[],
            failed=0,
            claims=[(at, ms) for at, ms in series["claims_ms"]],
            progress=[(at, total) for at, total in series["progress_rows"]],
            load=0.0,
            idle_again=series["idle_again"],
        )
        for pace, series in saved["series"].items()
        if pace != "unpaced" or len(saved["series"]) == 1
    ]
    charts(runs, directory, saved["filled"])


def _thin(points: list[tuple[float, float]], most: int = 400) -> list[tuple[float, float]]:
    if len(points) <= most:
        return points
    step = len(points) / most
    kept = [points[int(index * step)] for index in range(most)]
    return [*kept, points[-1]]


def main() -> None:
    configure()
    from django_idempotency.purge import DEFAULT_BATCH_SIZE

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument(
        "--pace",
        nargs="+",
        choices=PACES,
        default=["before", "after"],
        help="before: the purge as it was (each batch walks the index from its start, "
        "back to back); unpaced: this version's batches, back to back; after: this "
        "version with its defaults, or the options below",
    )
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--batch-seconds", type=float, default=None)
    parser.add_argument("--pause", type=float, default=None)
    parser.add_argument("--rate", type=float, default=None)
    parser.add_argument("--claim-interval", type=float, default=0.01, help="seconds")
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs of each pace; the table shows the medians"
    )
    parser.add_argument("--json", type=Path, default=None, help="write rows and series here")
    parser.add_argument("--charts", type=Path, default=None, help="write the SVG charts here")
    parser.add_argument(
        "--replot",
        type=Path,
        default=None,
        metavar="JSON",
        help="draw the --charts again from a run's --json file, and run nothing",
    )
    options = parser.parse_args()
    if options.replot:
        if not options.charts:
            parser.error("--replot needs --charts DIR: where to write the charts")
        replot(options.replot, options.charts)
        return

    from django.core.management import call_command
    from django.db import connection, connections

    # A terminated run still drops its database (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    admin_sql(f'CREATE DATABASE "{DATABASE_NAME}"')
    runs: list[Run] = []
    try:
        call_command("migrate", "django_idempotency", verbosity=0)
        with connection.cursor() as cursor:
            cursor.execute("SHOW server_version")
            postgres = cursor.fetchone()[0]
        fill(options.rows)
        # Repeats are interleaved, so that a busy minute on the machine
        # falls on every pace alike.
        for _ in range(options.repeat):
            for pace in options.pace:
                runs.append(run(options, pace))
                print(f"{pace}: {json.dumps(runs[-1].summary())}", file=sys.stderr, flush=True)
    finally:
        connections.close_all()
        admin_sql(f'DROP DATABASE IF EXISTS "{DATABASE_NAME}" WITH (FORCE)')

    result = table(runs, options)
    shown = [median_run([one for one in runs if one.pace == pace]) for pace in options.pace]
    facts = dict(environment(postgres, []))
    print(result.text())
    print(f"  * machine: {facts['machine']}; PostgreSQL {postgres}")
    command = "python benchmarks/purge.py " + " ".join(sys.argv[1:])
    if options.json:
        options.json.write_text(
            json.dumps(
                {
                    "command": command,
                    "date": facts["date"],
                    "machine": facts["machine"],
                    "postgresql": postgres,
                    "claim_interval": options.claim_interval,
                    "filled": options.rows,
                    "table": [dict(zip(result.header, row, strict=True)) for row in result.rows],
                    "runs": [one.summary() for one in runs],
                    "series": {
                        one.pace: {
                            "seconds": one.seconds,
                            "idle_again": one.idle_again,
                            "claims_ms": one.claims,
                            "progress_rows": one.progress,
                        }
                        for one in shown
                    },
                },
                indent=1,
            )
            + "\n"
        )
    if options.charts:
        # Before against after; the unpaced row is for the table.
        charted = [one for one in shown if one.pace != "unpaced"] or shown
        charts(charted, options.charts, options.rows)


if __name__ == "__main__":
    main()
