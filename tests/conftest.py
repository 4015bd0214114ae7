from __future__ import annotations

import pytest

from tests.faults.plugin import (  # noqa: F401  the fault suite's session hooks
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_logreport,
    pytest_terminal_summary,
)
from tests.views import calls


@pytest.fixture(autouse=True)
def reset_calls():
    calls.reset()
    yield calls
