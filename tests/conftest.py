from __future__ import annotations

import pytest

from tests.views import calls


@pytest.fixture(autouse=True)
def reset_calls():
    calls.reset()
    yield calls
