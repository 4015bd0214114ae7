from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from tests.faults.plugin import (  # noqa: F401  the fault suite's session hooks
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_logreport,
    pytest_terminal_summary,
)
from tests.views import calls

# Property tests check what the code does, not how fast: speed is measured by
# the benchmarks. Hypothesis's timing checks (a deadline per example, slow
# generation) would fail a correct run on a loaded two-core machine.
settings.register_profile("project", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("project")


@pytest.fixture(autouse=True)
def reset_calls():
    calls.reset()
    yield calls


@pytest.fixture(autouse=True)
def no_request_cycle_left_open():
    """End a request cycle a test left open, so the next test does not run inside it.

    A view that raises ``SystemExit`` (a test standing in for a killed
    process) leaves Django's test client without sending ``request_finished``:
    a later test's lease-mode function would then wait for the end of a
    request that never comes, which no server does.
    """
    from django_idempotency import engine

    yield
    engine._pending.set(None)
    engine._this_thread.unclosed = None
