"""The benchmark modules import, and section 1's statement count holds on every backend.

The peer packages are not installed here: the bench URLs and settings
leave them out, so this runs the same counting function as
``benchmarks/run.py`` against our views only.
"""

from __future__ import annotations

import importlib

import pytest
from django.db import connection
from django.test import override_settings

from benchmarks.bench.models import BenchOrder
from benchmarks.statements import count_statements

MODULES = [
    "benchmarks.bench.settings",
    "benchmarks.bench.urls",
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
def test_section_one_counts_at_most_two_extra_statements(bench_table):
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

        assert counts.first - undecorated[baseline].first <= 2, counts
        assert counts.replay <= 2, counts
        assert not counts.replay_ran_handler, counts
        assert counts.mismatch_status == 422, counts
        assert not counts.mismatch_ran_handler, counts
