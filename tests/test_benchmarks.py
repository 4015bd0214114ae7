"""The benchmark modules import, and section 1's statement count holds on every backend.

The peer packages are not installed here: the bench URLs and settings
leave them out, so this runs the same counting function as
``benchmarks/run.py`` against our views only.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from django.db import connection
from django.test import override_settings

from benchmarks.bench.models import BenchOrder
from benchmarks.statements import count_statements

MODULES = [
    "benchmarks.bench.settings",
    "benchmarks.bench.urls",
    "benchmarks.bench.inprocess_urls",
    "benchmarks.inprocess",
    "benchmarks.instructions",
    "benchmarks.latency",
    "benchmarks.load",
    "benchmarks.report",
    "benchmarks.statements",
    "benchmarks.suite",
]


@pytest.mark.parametrize("module", MODULES)
def test_benchmark_module_imports(module):
    importlib.import_module(module)


@pytest.fixture
def bench_table():
    # The bench app is not installed in the test project; its one table is
    # made for the test and dropped after it.
    with connection.schema_editor() as editor:
        editor.create_model(BenchOrder)
    yield
    with connection.schema_editor() as editor:
        editor.delete_model(BenchOrder)


@pytest.mark.django_db(transaction=True)
@override_settings(ROOT_URLCONF="benchmarks.bench.urls")
def test_section_one_counts_the_claim_and_store_and_on_postgresql_a_one_read_replay(bench_table):
    undecorated = {
        variant: count_statements(variant) for variant in ("plain", "drf", "plain-async")
    }
    assert undecorated["plain"].first == undecorated["plain-async"].first == 1
    for variant, baseline in [
        ("ours", "plain"),
        ("ours-lease", "plain"),
        ("ours-mixin", "drf"),
        ("ours-async", "plain-async"),
    ]:
        counts = count_statements(variant)

        if connection.vendor == "postgresql":
            # The replay lookup, the claim and the stored response.
            assert counts.first - undecorated[baseline].first <= 3, counts
            # The lookup alone, outside a transaction.
            assert counts.replay == counts.mismatch == 1, counts
        else:
            # The claim and the stored response; the claim answers a retry.
            assert counts.first - undecorated[baseline].first <= 2, counts
            assert counts.replay <= 2 and counts.mismatch <= 2, counts
        assert not counts.replay_ran_handler, counts
        assert counts.mismatch_status == 422, counts
        assert not counts.mismatch_ran_handler, counts


def test_the_latency_relay_adds_its_delay_and_passes_bytes_unchanged():
    import socket
    import threading
    import time

    from benchmarks.latency import DelayProxy

    # An echo server on 127.0.0.1 stands in for the database.
    listener = socket.create_server(("127.0.0.1", 0))

    def echo() -> None:
        conn, _ = listener.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    with (
        DelayProxy(listener.getsockname()[1], 20.0) as proxy,
        socket.create_connection(("127.0.0.1", proxy.port)) as client,
    ):
        started = time.monotonic()
        client.sendall(b"ping")
        received = b""
        while len(received) < 4:
            received += client.recv(16)
        elapsed = time.monotonic() - started
    listener.close()
    assert received == b"ping"
    assert 0.02 <= elapsed < 1.0


def test_inprocess_verdicts_name_each_missed_target():
    from benchmarks.suite import INPROCESS_COLUMNS, _inprocess_cells

    row = {
        "undecorated": [400.0],
        "first": [900.0],
        "replay": [380.0],
        "replay, cache on Redis": [150.0],
        "replay, cache on locmem": [90.0],
    }
    assert _inprocess_cells(row, True)[-1] == "ok"
    # One cell per column the tables name, then the verdict.
    assert len(_inprocess_cells(row, True)) == len(INPROCESS_COLUMNS) + 1
    assert _inprocess_cells(row, True)[1] == "-"  # no "statements alone" off PostgreSQL
    assert _inprocess_cells({**row, "statements alone": [700.0]}, True)[1] == "700"
    row["first"] = [1100.0]
    row["replay"] = [500.0]
    assert _inprocess_cells(row, True)[-1] == "MISSED: first, replay"
    assert _inprocess_cells(row, False)[-1] == "-"


def test_a_virtualenv_installs_again_only_when_its_fingerprint_changes(tmp_path):
    import dev

    where = tmp_path / "venv"
    python = where / dev.PYTHON.relative_to(dev.VENV)
    python.parent.mkdir(parents=True)
    python.touch()  # an existing virtualenv: none is created
    # A stamp as earlier versions of dev.py wrote it.
    (where / ".installed").write_text("test,postgres:1\n")
    installs: list[tuple[str, Path]] = []

    def prepare(name: str, fingerprint: str) -> Path:
        return dev.prepare_venv(
            where, name, fingerprint, lambda python: installs.append((name, python))
        )

    assert prepare("test,postgres", "1") == python
    assert installs == []
    prepare("example", "1")
    prepare("example", "1")
    prepare("test,postgres", "1")
    assert installs == [("example", python)]
    prepare("test,postgres", "2")
    prepare("test,postgres", "2")
    assert installs == [("example", python), ("test,postgres", python)]
    assert (where / ".installed").read_text() == "test,postgres:2\nexample:1\n"


def test_the_bench_virtualenv_is_made_by_dev_py_and_keyed_by_its_requirements(monkeypatch):
    import dev
    from benchmarks import run

    calls = []

    def prepare_venv(where, name, fingerprint, install):
        calls.append((where, name, fingerprint, install))
        return where / "bin" / "python"

    def execv(path, args):
        raise SystemExit(args)

    monkeypatch.setattr(dev, "prepare_venv", prepare_venv)
    monkeypatch.setattr(run.os, "execv", execv)
    monkeypatch.setattr(run.sys, "argv", ["benchmarks/run.py", "--quick"])
    with pytest.raises(SystemExit) as exited:
        run._bootstrap()

    [(where, name, fingerprint, install)] = calls
    assert (where, name, install) == (run.VENV, "bench", run._install)
    assert exited.value.code == [
        str(run.VENV / "bin" / "python"),
        str(Path(run.__file__).resolve()),
        "--quick",
    ]
    # Another requirement, another fingerprint: the bench virtualenv installs again.
    monkeypatch.setattr(run, "PEERS", [*run.PEERS, "another-peer"])
    calls.clear()
    with pytest.raises(SystemExit):
        run._bootstrap()
    assert calls[0][2] != fingerprint


def test_only_runs_the_named_sections_and_refuses_an_unknown_one(monkeypatch, capsys):
    from benchmarks import run, suite

    runs = []
    monkeypatch.setattr(run, "_in_bench_venv", lambda: True)
    monkeypatch.setattr(suite, "run_all", lambda **given: runs.append(given))

    monkeypatch.setattr(run.sys, "argv", ["run.py", "--only", "per-request", "--only", "async"])
    run.main()
    [given] = runs
    assert given["only"] == ["per-request", "async"]

    monkeypatch.setattr(run.sys, "argv", ["run.py", "--only", "per_request"])
    with pytest.raises(SystemExit) as exited:
        run.main()
    assert exited.value.code == 2
    assert "unknown section per_request; choose from statements, throughput" in (
        capsys.readouterr().err
    )
    assert len(runs) == 1


@pytest.mark.parametrize("only", [["per_request"], [], ["statements", "no-such-section"]])
def test_run_all_refuses_what_names_no_section_before_touching_a_database(only):
    from benchmarks.suite import run_all

    with pytest.raises(ValueError, match="only= takes some of statements, throughput"):
        run_all(quick=True, write_docs=False, command="", only=only)


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the purge bench is PostgreSQL's")
@pytest.mark.django_db(transaction=True)
def test_the_purge_bench_fills_records_the_purge_deletes():
    from benchmarks.purge import fill
    from django_idempotency.models import IdempotencyKey
    from django_idempotency.purge import purge_expired

    fill(5)

    assert IdempotencyKey.objects.filter(scope="bench").count() == 5
    assert purge_expired(batch_size=2) == 5
    assert not IdempotencyKey.objects.exists()


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the pipeline bench is PostgreSQL's")
def test_the_pipeline_bench_sends_this_versions_statements():
    from benchmarks.inprocess import PIPELINE_VARIANTS, run

    results = run("postgresql", 600, requests=5, rounds=1, pipeline=True, timeout=300)

    assert set(results) == set(PIPELINE_VARIANTS)
    assert all(len(values) == 1 and values[0] > 0 for values in results.values())


@pytest.mark.skipif(
    connection.vendor != "postgresql", reason="the statements alone are PostgreSQL's"
)
def test_the_inprocess_bench_times_the_statements_alone_beside_ours():
    from benchmarks.inprocess import VARIANTS, run

    results = run("postgresql", 600, requests=5, rounds=1, timeout=300)

    assert set(results) == set(VARIANTS)
    assert all(len(values) == 1 and values[0] > 0 for values in results.values())
