"""Waiting on a condition another thread or process will make true, bounded in time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import connection


def wait_until(condition: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    """Poll ``condition`` until it holds; fail the test, naming ``what``, after ``limit`` s."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


def in_background(call: Callable[[], Any], limit: float = 30.0) -> Callable[[], Any]:
    """Run ``call`` in a thread with its own connection; the returned join is bounded.

    The join hands back ``call``'s result, or raises its exception.
    """
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = call()
        except BaseException as exc:  # handed to the joining test
            result["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()

    def join() -> Any:
        thread.join(timeout=limit)
        assert not thread.is_alive(), "the background call did not finish"
        if "error" in result:
            raise result["error"]
        return result["value"]

    return join


def updating(session: list[int]) -> Callable[[], bool]:
    """Whether the MySQL session whose id ``session`` will hold is running an ``UPDATE``.

    For a test that made that session wait on a lock in one. Not
    ``information_schema.innodb_trx``: InnoDB refreshes it only when nobody has read it
    for 0.1 s, which a poll never lets happen.
    """

    def check() -> bool:
        if not session:
            return False
        with connection.cursor() as cursor:
            cursor.execute("SELECT info FROM information_schema.processlist WHERE id = %s", session)
            return str(cursor.fetchone()[0] or "").startswith("UPDATE")

    return check
