"""Waiting on a condition another thread or process will make true, bounded in time."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    """Poll ``condition`` until it holds; fail the test, naming ``what``, after ``limit`` s."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)
