"""Every section, run in order against throwaway databases.

Runs of the things being compared are interleaved (A B C A B C ...), so that
the noise of a shared machine falls on all of them alike; each figure is the
median of several runs with its min-max spread, and the headline is each
variant's ratio to the undecorated handler measured in the same round.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import django

from benchmarks.postgres import admin_sql
from benchmarks.report import MISSED, OK, Table, environment

ROOT = Path(__file__).resolve().parent.parent
DOCS_TABLE = ROOT / "docs" / "_generated" / "benchmarks.rst"
DATABASE_NAME = f"bench_idempotency_{os.getpid()}"
#: Per-run and per-section time limits: every load loop also stops on these.
RUN_LIMIT = 120.0
STORM_LIMIT = 60.0
PURGE_LIMIT = 900.0


class UsageError(ValueError):
    """Options of :func:`run_all` that cannot go together; raised before anything runs."""


@dataclass(frozen=True)
class Plan:
    requests: int  # per timed run
    runs: int  # per variant, interleaved
    inprocess_requests: int  # per variant and round, section 5
    inprocess_rounds: int
    latency_requests: int  # the same, behind added latency
    threads: int  # client threads
    replay_pool: int  # completed keys each replay run cycles through
    storm_keys: int
    duplicates: int  # simultaneous requests per storm key
    work_ms: int  # the storm handler's own work
    purge_rows: tuple[int, ...]


FULL = Plan(1500, 7, 1500, 5, 300, 4, 300, 40, 50, 50, (100_000, 1_000_000))
QUICK = Plan(200, 2, 200, 2, 100, 4, 100, 6, 50, 50, (100_000,))
#: Round-trip delays of the latency rows, in milliseconds.
LATENCIES_MS = (0.0, 0.5, 1.0)


@dataclass(frozen=True)
class Case:
    label: str
    variant: str
    replay: bool = False
    baseline: str | None = None
    ours: bool = False


def _cases(peers: set[str]) -> list[Case]:
    cases = [
        Case("plain view, undecorated", "plain"),
        Case("@idempotent, first requests", "ours", baseline="plain", ours=True),
        Case("@idempotent, replays", "ours", replay=True, baseline="plain", ours=True),
        Case("django-idempotency-key, first", "dik", baseline="plain"),
        Case("django-idempotency-key, replays", "dik", replay=True, baseline="plain"),
        Case("DRF APIView, undecorated", "drf"),
        Case("IdempotentMixin, first requests", "ours-mixin", baseline="drf", ours=True),
        Case("IdempotentMixin, replays", "ours-mixin", replay=True, baseline="drf", ours=True),
        Case("drf-idempotency, first", "drfi", baseline="drf"),
        Case("drf-idempotency, replays", "drfi", replay=True, baseline="drf"),
        Case("djangorestframework-idempotency-key, first", "drfik", baseline="drf"),
        Case("djangorestframework-idempotency-key, replays", "drfik", replay=True, baseline="drf"),
    ]
    ours = {"plain", "ours", "drf", "ours-mixin"}
    return [case for case in cases if case.variant in ours | peers]


def _spread(values: Sequence[float], fmt: str) -> str:
    middle, low, high = (
        format(value, fmt) for value in (statistics.median(values), min(values), max(values))
    )
    return f"{middle} ({low}-{high})"


def _statuses(counter: Counter) -> str:
    return ", ".join(f"{status or 'conn. error'}: {n}" for status, n in sorted(counter.items()))


def _verdict(met: bool) -> str:
    return OK if met else MISSED


# Set-up -------------------------------------------------------------------


def _setup_django() -> str:
    os.environ["DJANGO_SETTINGS_MODULE"] = "benchmarks.bench.settings"
    os.environ["BENCH_DATABASE_NAME"] = DATABASE_NAME
    django.setup()
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", run_syncdb=True, verbosity=0)
    call_command("createcachetable", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        return str(cursor.fetchone()[0])


def _rows(variant: str) -> int:
    from benchmarks.bench.models import BenchOrder

    return BenchOrder.objects.filter(variant=variant).count()


# Section 1 ------------------------------------------------------------------

OUR_VARIANTS = {"plain", "ours", "ours-lease", "drf", "ours-mixin", "plain-async", "ours-async"}


def section_statements(peers: set[str]) -> Table:
    from benchmarks.statements import count_statements

    table = Table(
        "1. SQL statements per request",
        [
            "variant",
            "first",
            "extra vs undecorated",
            "replay",
            "handler ran on replay",
            "same key, other body",
            "target",
        ],
    )
    table.notes = [
        "Counted with Django's CaptureQueriesContext; BEGIN/COMMIT/ROLLBACK/SAVEPOINT/"
        "RELEASE are not counted. The undecorated handler makes one INSERT.",
        "Target (ours): first request <= 2 statements beyond the handler's own (the claim, "
        "the store), 3 on PostgreSQL (which looks for a replay first); replay and reused key "
        "<= 2 statements, 1 on PostgreSQL (the lookup, no transaction); the handler does not "
        "run and the reused key answers 422.",
    ]
    rows = [
        ("plain view, undecorated", "plain", "plain", False),
        ("@idempotent", "ours", "plain", True),
        ("@idempotent(atomic=False)", "ours-lease", "plain", True),
        ("DRF APIView, undecorated", "drf", "drf", False),
        ("IdempotentMixin", "ours-mixin", "drf", True),
        ("async view, undecorated", "plain-async", "plain-async", False),
        ("@idempotent async", "ours-async", "plain-async", True),
        ("django-idempotency-key", "dik", "plain", False),
        ("drf-idempotency", "drfi", "drf", False),
        ("djangorestframework-idempotency-key", "drfik", "drf", False),
    ]
    from django.db import connection

    reads_first = connection.vendor == "postgresql"
    own: dict[str, int] = {}
    for label, variant, baseline, ours in rows:
        if variant not in peers | OUR_VARIANTS:
            continue
        counts = count_statements(variant)
        if variant == baseline:
            own[variant] = counts.first
            table.add(label, counts.first, "-", "(runs again)", "yes", "-", "-")
            continue
        extra = counts.first - own[baseline]
        mismatch = f"{counts.mismatch} ({counts.mismatch_status}"
        mismatch += ", handler ran)" if counts.mismatch_ran_handler else ")"
        verdict = "-"
        if ours:
            verdict = _verdict(
                extra <= (3 if reads_first else 2)
                and counts.replay <= (1 if reads_first else 2)
                and not counts.replay_ran_handler
                and counts.mismatch <= (1 if reads_first else 2)
                and counts.mismatch_status == 422
            )
        table.add(
            label,
            counts.first,
            f"+{extra}",
            counts.replay,
            "yes" if counts.replay_ran_handler else "no",
            mismatch,
            verdict,
        )
    return table


# Section 2 ------------------------------------------------------------------


def section_throughput(port: int, plan: Plan, peers: set[str], progress: Callable) -> Table:
    return _throughput(
        port, plan, _cases(peers), "2. Throughput and latency (gunicorn, 4 sync workers)", progress
    )


def _throughput(
    port: int,
    plan: Plan,
    cases: list[Case],
    title: str,
    progress: Callable,
    close: bool = False,
) -> Table:
    from benchmarks.load import cycle, hammer, new_keys, percentile

    # Warm every worker and fill each variant's pool of completed keys.
    pools: dict[str, list[str]] = {}
    for variant in dict.fromkeys(case.variant for case in cases):
        pools[variant] = new_keys(plan.replay_pool)
        deadline = time.monotonic() + RUN_LIMIT
        hammer(port, f"/{variant}/", pools[variant], plan.threads, deadline, close)

    results: dict[str, list] = {case.label: [] for case in cases}
    ratios: dict[str, list[float]] = {case.label: [] for case in cases}
    executions: Counter = Counter()
    for round_number in range(plan.runs):
        progress(f"{title.split(' (')[0]}: round {round_number + 1}/{plan.runs}")
        this_round = {}
        for case in cases:
            if case.replay:
                keys = cycle(pools[case.variant], plan.requests)
            else:
                keys = new_keys(plan.requests)
            before = _rows(case.variant)
            deadline = time.monotonic() + RUN_LIMIT
            run = hammer(port, f"/{case.variant}/", keys, plan.threads, deadline, close)
            executions[case.label] += _rows(case.variant) - before
            results[case.label].append(run)
            this_round[case.variant if case.baseline is None else case.label] = run
            if case.baseline is not None:
                ratios[case.label].append(run.rate / this_round[case.baseline].rate)

    table = Table(
        title,
        [
            "variant",
            "req/s",
            "x undecorated",
            "p50 ms",
            "p99 ms",
            "handler runs",
            "answers",
            "target",
        ],
    )
    table.notes = [
        f"{plan.runs} interleaved runs of {plan.requests} requests per variant, "
        f"{plan.threads} client threads with http.client on 127.0.0.1; median (min-max).",
        "'x undecorated' is the median of per-round ratios to the undecorated view of the same "
        "framework (plain Django, DRF APIView, or the same async view) measured in the same "
        "round.",
        f"Replays cycle through {plan.replay_pool} keys completed before the timed runs. "
        "django-idempotency-key answers replays with 409 (its default CONFLICT_STATUS_CODE).",
        "Target (ours): first requests >= 0.85x undecorated; replays >= 1.0x and the handler "
        "never runs.",
    ]
    for case in cases:
        runs = results[case.label]
        rates = [run.rate for run in runs]
        p50 = [percentile(run.latencies, 0.50) * 1000 for run in runs]
        p99 = [percentile(run.latencies, 0.99) * 1000 for run in runs]
        statuses: Counter = sum((run.statuses for run in runs), Counter())
        ratio = _spread(ratios[case.label], ".2f") if case.baseline else "1 (baseline)"
        verdict = "-"
        if case.ours:
            failures = sum(run.failures for run in runs)
            if case.replay:
                met = statistics.median(ratios[case.label]) >= 1.0 and executions[case.label] == 0
            else:
                met = statistics.median(ratios[case.label]) >= 0.85
            verdict = _verdict(met and failures == 0)
        table.add(
            case.label,
            _spread(rates, ".0f"),
            ratio,
            f"{statistics.median(p50):.1f}",
            f"{statistics.median(p99):.1f}",
            executions[case.label],
            _statuses(statuses),
            verdict,
        )
    return table


# Section 5 ------------------------------------------------------------------


def section_async(port: int, plan: Plan, progress: Callable) -> Table:
    cases = [
        Case("async view, undecorated", "plain-async"),
        Case("@idempotent async, first requests", "ours-async", baseline="plain-async", ours=True),
        Case(
            "@idempotent async, replays",
            "ours-async",
            replay=True,
            baseline="plain-async",
            ours=True,
        ),
    ]
    title = "5. Async views (uvicorn, 4 workers, pooled connections)"
    table = _throughput(port, plan, cases, title, progress, close=True)
    table.notes.insert(
        1,
        "The same handler as an async def view writing with acreate(), undecorated and with "
        "@idempotent, served by uvicorn; database connections come from psycopg's pool, since "
        "under ASGI each request's database work runs in a thread of its own. Each request "
        "asks for 'Connection: close', as gunicorn's sync workers close every connection: "
        "kept-alive connections to uvicorn's multi-worker mode added about 45 ms to every "
        "answer on this machine, for every variant alike.",
    )
    return table


def section_throughput_per_request(plan: Plan, progress: Callable) -> Table:
    """Our views over HTTP with a connection per request, the replay cache on Redis too.

    Two servers of our views only (the peers refuse an ``IDEMPOTENCY`` dict
    with our keys): one without the cache, one with it on Redis, used in
    turn round by round.
    """
    from benchmarks.load import BenchServer, cycle, hammer, new_keys

    prefix = f"bench-{os.getpid()}"
    common = {"BENCH_DATABASE_NAME": DATABASE_NAME, "BENCH_CONN_MAX_AGE": "0"}
    common["BENCH_OURS_ONLY"] = "1"
    plain_server = BenchServer(common)
    cache_server = BenchServer(
        {**common, "BENCH_REPLAY_CACHE": "redis", "BENCH_REDIS_PREFIX": prefix}
    )
    rows = [
        ("plain view, undecorated", plain_server, "plain", None),
        ("@idempotent, first requests", plain_server, "ours", "new"),
        ("@idempotent, replays", plain_server, "ours", "pool"),
        ("@idempotent, replays from the cache (Redis)", cache_server, "ours", "cached"),
    ]
    results: dict[str, list] = {row[0]: [] for row in rows}
    ratios: dict[str, list[float]] = {row[0]: [] for row in rows}
    executions: Counter = Counter()
    plain_server.start(probe_path="/plain/")
    try:
        cache_server.start(probe_path="/plain/")
        try:
            pool = new_keys(plan.replay_pool)
            deadline = time.monotonic() + RUN_LIMIT
            hammer(plain_server.port, "/ours/", pool, plan.threads, deadline)
            # One replay of each key through the cache server fills the cache.
            hammer(cache_server.port, "/ours/", pool, plan.threads, deadline)
            hammer(plain_server.port, "/plain/", new_keys(plan.replay_pool), plan.threads, deadline)
            for round_number in range(plan.runs):
                progress(f"per-request throughput round {round_number + 1}/{plan.runs}")
                baseline = None
                for label, server, path, keys_kind in rows:
                    keys = (
                        new_keys(plan.requests)
                        if keys_kind in (None, "new")
                        else cycle(pool, plan.requests)
                    )
                    before = _rows(path)
                    run = hammer(
                        server.port, f"/{path}/", keys, plan.threads, time.monotonic() + RUN_LIMIT
                    )
                    if keys_kind is not None:
                        executions[label] += _rows(path) - before
                    results[label].append(run)
                    if baseline is None:
                        baseline = run
                    else:
                        ratios[label].append(run.rate / baseline.rate)
        finally:
            cache_server.stop()
    finally:
        plain_server.stop()
    _clear_redis(prefix)
    table = Table(
        "2b. Throughput, a connection per request, replay cache (gunicorn, 4 sync workers)",
        ["variant", "req/s", "x undecorated", "handler runs", "answers", "target"],
    )
    table.notes = [
        "CONN_MAX_AGE = 0: every request opens and closes its own PostgreSQL connection. "
        f"{plan.runs} interleaved runs of {plan.requests} requests, {plan.threads} client threads; "
        "median (min-max).",
        "The cached row runs on a second server with REPLAY_CACHE on the local Redis; its "
        f"{plan.replay_pool} keys were replayed once through it before the timed runs.",
        "Target: first requests >= 0.8x undecorated; replays >= 1.0x; replays from the cache "
        ">= 1.3x; the handler never runs on a replay.",
    ]
    targets = {rows[1][0]: 0.8, rows[2][0]: 1.0, rows[3][0]: 1.3}
    for label, _server, _path, keys_kind in rows:
        runs = results[label]
        statuses: Counter = sum((run.statuses for run in runs), Counter())
        verdict = "-"
        ratio = "1 (baseline)"
        if label in targets:
            ratio = _spread(ratios[label], ".2f")
            met = statistics.median(ratios[label]) >= targets[label]
            if keys_kind != "new":
                met = met and executions[label] == 0
            verdict = _verdict(met and sum(run.failures for run in runs) == 0)
        table.add(
            label,
            _spread([run.rate for run in runs], ".0f"),
            ratio,
            executions[label] if keys_kind not in (None, "new") else "-",
            _statuses(statuses),
            verdict,
        )
    return table


def _clear_redis(prefix: str) -> None:
    """Delete this run's cache entries (only keys under its own prefix)."""
    try:
        import redis
    except ImportError:
        return
    client = redis.Redis.from_url(os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        client.delete(key)


# Section 5 ------------------------------------------------------------------

INPROCESS_CONFIGS = [
    ("PostgreSQL", "postgresql", 600, False),
    ("PostgreSQL", "postgresql", 0, False),
    ("PostgreSQL, prepared statements", "postgresql", 600, True),
    ("MariaDB", "mariadb", 600, False),
    ("MariaDB", "mariadb", 0, False),
    ("SQLite", "sqlite", 600, False),
    ("SQLite", "sqlite", 0, False),
]
#: The columns of :func:`_inprocess_cells`, before its verdict.
INPROCESS_COLUMNS = [
    "undecorated",
    "statements alone",
    "first",
    "first - undecorated",
    "replay",
    "replay from Redis",
    "replay from locmem",
]


def section_inprocess(plan: Plan, progress: Callable) -> Table:
    from benchmarks.inprocess import run

    table = Table(
        "6. Per request in one process (Django test client), median microseconds",
        ["database", "connections", *INPROCESS_COLUMNS, "target"],
    )
    table.notes = [
        f"Each row is its own process and throwaway database; {plan.inprocess_rounds} rounds of "
        f"{plan.inprocess_requests} requests per variant, interleaved within the row; the median "
        "over rounds of the mean time per request. Includes the test client's own work.",
        "Handler: one INSERT and a small JSON answer. 'persistent' is CONN_MAX_AGE = 600, "
        "'per request' CONN_MAX_AGE = 0 (a new connection for every request).",
        "'prepared statements' is Django's OPTIONS {'server_side_binding': True, "
        "'prepare_threshold': 5}: the claim is planned once per connection instead of per "
        "request. Django leaves it off by default for transaction-pooling proxies.",
        "'statements alone' (PostgreSQL): a first request's statements sent through Django "
        "by the handler itself, with none of the package's code: what the contract costs any "
        "Django implementation here; 'first' minus it is the package's own Python.",
        "Targets (PostgreSQL): first <= undecorated + 600 us; replay <= undecorated; replay "
        "from the cache <= undecorated / 2. The machine is shared: rows run minutes apart, so "
        "compare within a row.",
    ]
    for label, backend, max_age, prepared in INPROCESS_CONFIGS:
        progress(f"in-process {label}, CONN_MAX_AGE={max_age}")
        try:
            result = run(
                backend,
                max_age,
                plan.inprocess_requests,
                plan.inprocess_rounds,
                prepared=prepared,
            )
        except Exception as exc:  # a backend that is not running drops its row only
            reason = f"not run: {str(exc).splitlines()[0]}"
            table.add(label, _connections(max_age), reason, *["-"] * len(INPROCESS_COLUMNS))
            continue
        table.add(label, _connections(max_age), *_inprocess_cells(result, backend == "postgresql"))
    return table


def _connections(max_age: int) -> str:
    return "per request" if max_age == 0 else "persistent"


def _inprocess_cells(result: dict[str, list[float]], with_targets: bool) -> list[str]:
    med = {name: statistics.median(values) for name, values in result.items()}
    plain, first, replay = med["undecorated"], med["first"], med["replay"]
    redis_, locmem = med["replay, cache on Redis"], med["replay, cache on locmem"]
    verdict = "-"
    if with_targets:
        missed = []
        if first > plain + 600:
            missed.append("first")
        if replay > plain:
            missed.append("replay")
        if max(redis_, locmem) > plain / 2:
            missed.append("cache")
        verdict = OK if not missed else f"{MISSED}: {', '.join(missed)}"
    alone = med.get("statements alone")
    return [
        f"{plain:.0f}",
        "-" if alone is None else f"{alone:.0f}",
        f"{first:.0f}",
        f"{first - plain:+.0f}",
        f"{replay:.0f}",
        f"{redis_:.0f}",
        f"{locmem:.0f}",
        verdict,
    ]


def section_latency(plan: Plan, progress: Callable) -> list[Table]:
    """Sections 6 and 7: PostgreSQL behind added round-trip latency."""
    from benchmarks.inprocess import PIPELINE_VARIANTS, run
    from benchmarks.latency import DelayProxy, netem_available

    usable, how = netem_available()
    port = int(os.environ.get("PGPORT", "5432"))
    method = (
        "tc netem is available, but these rows use the relay so that they match machines without it"
        if usable
        else f"tc netem is not available on this machine ({how})"
    )
    requests = plan.latency_requests
    rounds = plan.inprocess_rounds
    latency = Table(
        "7. Per request behind added latency (PostgreSQL, persistent), median microseconds",
        ["added round trip", *INPROCESS_COLUMNS],
    )
    latency.notes = [
        f"{method}: the delay is added by a user-space relay on 127.0.0.1 (benchmarks/latency.py) "
        "that holds every chunk PostgreSQL sends for the added round-trip time. The 0 ms row "
        "goes through the relay too, so rows differ only in the delay. Redis is not delayed.",
        f"{rounds} rounds of {requests} requests per variant, interleaved; as section 5.",
        "Round trips per request (tests/test_queries.py): undecorated 1 (INSERT, autocommit); "
        "first 5 (BEGIN, claim, INSERT, store, COMMIT); replay 3 (BEGIN, claim, COMMIT); "
        "replay from the cache 0.",
    ]
    pipeline = Table(
        "8. psycopg pipeline mode behind added latency (PostgreSQL, persistent), median us",
        ["added round trip", *PIPELINE_VARIANTS, "pipeline pays?"],
    )
    pipeline.notes = [
        "The statements of a first request (the lookup in autocommit, then the claim, INSERT, "
        "store and COMMIT) and of a replay (the lookup alone), sent by psycopg directly with "
        "the same SQL on the same table: one round trip per statement as today, or inside "
        "psycopg's pipeline mode, meant to send BEGIN with the claim and the store with "
        "COMMIT. A libpq trace shows psycopg still waits for BEGIN on its own and synchronises "
        "once more when the pipeline ends; a replay is one statement either way.",
        "Adopted only if it wins with latency and does not lose without.",
    ]
    verdicts = []
    for delay in LATENCIES_MS:
        progress(f"latency {delay} ms")
        with DelayProxy(port, delay) as proxy:
            result = run("postgresql", 600, requests, rounds, db_port=proxy.port)
            latency.add(f"{delay:g} ms", *_inprocess_cells(result, False)[:-1])
            piped = run("postgresql", 600, requests, rounds, db_port=proxy.port, pipeline=True)
        med = {name: statistics.median(values) for name, values in piped.items()}
        first_gain = med[PIPELINE_VARIANTS[0]] - med[PIPELINE_VARIANTS[1]]
        replay_gain = med[PIPELINE_VARIANTS[2]] - med[PIPELINE_VARIANTS[3]]
        verdicts.append(first_gain > 0 and replay_gain > 0)
        pipeline.add(
            f"{delay:g} ms",
            *(f"{med[name]:.0f}" for name in PIPELINE_VARIANTS),
            f"first {first_gain:+.0f} us, replay {replay_gain:+.0f} us",
        )
    adopt = all(verdicts)
    pipeline.notes.append(
        "Verdict: "
        + (
            "pipelining wins at every delay here."
            if adopt
            else "pipelining loses at one delay or more (see the 0 ms row); left out."
        )
    )
    return [latency, pipeline]


# Section 3 ------------------------------------------------------------------


def section_storms(
    port: int, plan: Plan, peers: set[str], wait: float, progress: Callable
) -> Table:
    from benchmarks.bench.models import BenchOrder
    from benchmarks.load import percentile, storm

    cases = [
        Case("@idempotent", "ours", ours=True),
        Case("@idempotent(atomic=False)", "ours-lease", ours=True),
        Case("IdempotentMixin", "ours-mixin", ours=True),
        Case("django-idempotency-key", "dik"),
        Case("drf-idempotency", "drfi"),
        Case("djangorestframework-idempotency-key", "drfik"),
    ]
    cases = [case for case in cases if case.ours or case.variant in peers]
    storms: dict[str, list] = {case.label: [] for case in cases}
    with ThreadPoolExecutor(plan.duplicates) as pool:
        for number in range(plan.storm_keys):
            if number % 10 == 0:
                progress(f"storms {number}/{plan.storm_keys} keys")
            for case in cases:
                path = f"/{case.variant}/?work_ms={plan.work_ms}"
                deadline = time.monotonic() + STORM_LIMIT
                storms[case.label].append(storm(pool, port, path, plan.duplicates, deadline))

    table = Table(
        "3. Duplicate storms",
        [
            "variant",
            "handler runs per key",
            "keys run twice or more",
            "5xx / errors",
            "answers",
            "original p50 ms",
            "duplicates p50 ms",
            "duplicates p99 ms",
            "over original + WAIT",
            "target",
        ],
    )
    table.notes = [
        f"{plan.storm_keys} keys x {plan.duplicates} simultaneous requests per key (released by "
        f"a barrier), interleaved across variants; the handler does {plan.work_ms} ms of work "
        "besides its INSERT, so duplicates arrive while the original runs.",
        "Handler runs are the handler's own rows per key; the 'original' is the request whose "
        "nonce the row holds, every other request is a duplicate.",
        f"Target (ours): exactly one run per key, no 5xx, and no duplicate slower than its "
        f"original's latency + WAIT ({wait:g} s).",
    ]
    for case in cases:
        runs_per_key = []
        original_latencies: list[float] = []
        duplicate_latencies: list[float] = []
        over_bound = 0
        statuses: Counter = Counter()
        for result in storms[case.label]:
            executors = set(
                BenchOrder.objects.filter(variant=case.variant, key=result.key).values_list(
                    "nonce", flat=True
                )
            )
            runs_per_key.append(len(executors))
            originals = [result.answers[n][1] for n in executors if n in result.answers]
            original_latencies += originals
            bound = (max(originals) if originals else 0.0) + wait
            for nonce, (status, latency) in result.answers.items():
                statuses[status] += 1
                if nonce in executors:
                    continue
                duplicate_latencies.append(latency)
                over_bound += latency > bound
        failures = sum(n for status, n in statuses.items() if status == 0 or status >= 500)
        twice = sum(runs > 1 for runs in runs_per_key)
        verdict = "-"
        if case.ours:
            verdict = _verdict(
                all(runs == 1 for runs in runs_per_key) and failures == 0 and over_bound == 0
            )
        table.add(
            case.label,
            f"{min(runs_per_key)}-{max(runs_per_key)} (total {sum(runs_per_key)})",
            twice,
            failures,
            _statuses(statuses),
            f"{percentile(original_latencies, 0.5) * 1000:.0f}",
            f"{percentile(duplicate_latencies, 0.5) * 1000:.0f}",
            f"{percentile(duplicate_latencies, 0.99) * 1000:.0f}",
            over_bound,
            verdict,
        )
    return table


# Section 4 ------------------------------------------------------------------


def section_purge(plan: Plan, progress: Callable) -> Table:
    table = Table(
        "4. Purge (benchmarks/purge.py, PostgreSQL, claims every 10 ms beside it)",
        [
            "expired rows",
            "deleted",
            "seconds",
            "rows/s",
            "peak RSS MB",
            "claim p99 idle ms",
            "claim p99 during ms",
            "longest claim during ms",
            "target",
        ],
    )
    table.notes = [
        "Each size runs in its own process (so peak RSS is its own), with the purge's default "
        "pace, while a writer process claims a key every 10 ms, half of them taking over "
        "expired rows the purge is deleting (so a few rows are taken over rather than "
        "deleted). docs/benchmarks.rst's 'Purge beside traffic' compares it with the purge "
        "before it yielded.",
        "Target: 1,000,000 rows in under 20 s, with flat memory (peak RSS within 16 MB of "
        "the 100,000-row run).",
    ]
    results = []
    with tempfile.TemporaryDirectory() as directory:
        for rows in plan.purge_rows:
            progress(f"purge {rows:,} rows")
            path = Path(directory) / f"purge-{rows}.json"
            subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "benchmarks" / "purge.py"),
                    *("--rows", str(rows), "--pace", "after", "--json", str(path)),
                ],
                capture_output=True,
                text=True,
                timeout=PURGE_LIMIT,
                check=True,
            )
            result = json.loads(path.read_text())["runs"][0]
            # The writer takes a few expired rows over before the purge reaches
            # them, so fewer rows than were filled are deleted.
            results.append({**result, "filled": rows})
    baseline_rss = results[0]["rss_mb"]
    for result in results:
        verdict = "-"
        if result["filled"] >= 1_000_000:
            flat = result["rss_mb"] <= baseline_rss + 16
            verdict = _verdict(result["seconds"] < 20 and flat)
        table.add(
            f"{result['filled']:,}",
            f"{result['rows']:,.0f}",
            f"{result['seconds']:.1f}",
            f"{result['rows_per_s']:,.0f}",
            f"{result['rss_mb']:.0f}",
            f"{result['idle_p99_ms']:.1f}",
            f"{result['during_p99_ms']:.1f}",
            f"{result['during_max_ms']:.0f}",
            verdict,
        )
    return table


# Orchestration ----------------------------------------------------------------


#: The section names ``--only`` accepts, in the order a full run takes them.
SECTIONS = (
    "statements",
    "throughput",
    "storms",
    "per-request",
    "async",
    "purge",
    "inprocess",
    "latency",
)


def run_all(
    *,
    quick: bool,
    write_docs: bool,
    command: str,
    only: Sequence[str] = SECTIONS,
    charts: Path | None = None,
) -> None:
    """Run the sections named in ``only`` (all of them by default).

    Only a full run writes the docs table: a partial one would drop the
    other sections' tables from the page. The charts of the sections run
    are written into ``charts``, and a run that writes the docs table writes
    them into the docs too, so that the page and its charts are one run's;
    ``charts`` naming the docs' own directory in a run that leaves the page
    alone is refused, since its charts would disagree with the page's tables.
    """
    wanted = {only} if isinstance(only, str) else set(only)
    if not wanted or wanted - set(SECTIONS):
        raise UsageError(f"only= takes some of {', '.join(SECTIONS)}, not {sorted(wanted)}")
    plan = QUICK if quick else FULL
    write_docs = write_docs and wanted == set(SECTIONS)
    chart_dirs = [charts] if charts is not None else []
    if write_docs or chart_dirs:
        # Before anything runs: without matplotlib this fails now, not at the end.
        from benchmarks import figures

        if charts is not None and figures.is_docs_chart_dir(charts) and not write_docs:
            raise UsageError(
                f"--charts {charts} would replace the committed charts without rewriting "
                f"{DOCS_TABLE.relative_to(ROOT)}, so the page's charts would disagree with its "
                "tables. Give --charts another directory, or run every section without "
                "--only and --no-docs (the page and its charts are then written together)."
            )
        if write_docs:
            chart_dirs.append(figures.CHART_DIR)
    from benchmarks.bench import peers as peer_registry

    started = time.monotonic()

    def progress(message: str) -> None:
        print(f"[{time.monotonic() - started:6.0f} s] {message}", file=sys.stderr, flush=True)

    def show(table: Table) -> Table:
        print(table.text(), "\n", flush=True)
        return table

    installed = peer_registry.installed()
    peers = {peer.variant for peer in installed}
    missing = [peer.name for peer in peer_registry.ALL if peer not in installed]
    if missing:
        progress(f"not installed, left out: {', '.join(missing)}")

    admin_sql(f'CREATE DATABASE "{DATABASE_NAME}"')
    tables: list[Table] = []
    async_table = None
    try:
        postgres_version = _setup_django()
        from benchmarks.load import BenchAsgiServer, BenchServer
        from django_idempotency.conf import idempotency_settings

        if "statements" in wanted:
            progress("statements")
            tables.append(show(section_statements(peers)))
        if wanted & {"throughput", "storms"}:
            server = BenchServer({"BENCH_DATABASE_NAME": DATABASE_NAME})
            server.start(probe_path="/plain/")
            try:
                if "throughput" in wanted:
                    tables.append(show(section_throughput(server.port, plan, peers, progress)))
                if "storms" in wanted:
                    wait = idempotency_settings.wait
                    tables.append(show(section_storms(server.port, plan, peers, wait, progress)))
            finally:
                server.stop()
        if "per-request" in wanted:
            # The page keeps it beside the other throughput table.
            per_request = show(section_throughput_per_request(plan, progress))
            tables.insert(min(2, len(tables)), per_request)
        if "async" in wanted:
            asgi_server = BenchAsgiServer({"BENCH_DATABASE_NAME": DATABASE_NAME})
            asgi_server.start(probe_path="/plain/")
            try:
                async_table = show(section_async(asgi_server.port, plan, progress))
            finally:
                asgi_server.stop()
    finally:
        from django.db import connections

        connections.close_all()
        admin_sql(f'DROP DATABASE IF EXISTS "{DATABASE_NAME}" WITH (FORCE)')

    if "purge" in wanted:
        tables.append(show(section_purge(plan, progress)))
    if async_table is not None:
        tables.append(async_table)
    if "inprocess" in wanted:
        tables.append(show(section_inprocess(plan, progress)))
    if "latency" in wanted:
        tables.extend(show(table) for table in section_latency(plan, progress))
    progress("done")
    facts = environment(postgres_version, [peer.name for peer in installed])
    if chart_dirs:
        # The page before the charts: a chart that fails keeps the run's tables.
        page = DOCS_TABLE if write_docs else None
        written = figures.publish(tables, facts, command, page=page, directories=chart_dirs)
        if page is not None:
            print(f"Wrote {DOCS_TABLE.relative_to(ROOT)}")
        print("Wrote", *(str(path) for path in written))
