"""What the browser tests share: Debian's Chromium under Playwright, and the server it drives.

Chromium is Debian's ``chromium`` package, never a downloaded browser;
``python3 dev.py test`` installs it when run as root, and CI does. Where it
cannot run, the tests fail under CI (``CI`` or ``REQUIRE_BACKENDS`` set)
and are skipped elsewhere, with the fix named.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from tests.server import GunicornServer

ASYNC_UNSAFE = "DJANGO_ALLOW_ASYNC_UNSAFE"


def unavailable(reason: str) -> None:
    """Fail where the browser tests must run (CI), skip with the fix named elsewhere."""
    if os.environ.get("CI") or os.environ.get("REQUIRE_BACKENDS"):
        pytest.fail(f"The browser tests cannot run: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module", name="chromium")
def chromium_fixture() -> Iterator[Any]:
    """Debian's Chromium, headless, for the module's tests."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("Playwright is not installed: pip install --group test")
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        unavailable(
            "Chromium is not installed: apt-get install chromium "
            "(python3 dev.py test installs it when run as root)"
        )
    # Playwright's sync API keeps an event loop in this thread while the
    # browser is open; the tests' own queries (and pytest-django's flush)
    # are plain synchronous code run between its calls.
    allowed = os.environ.get(ASYNC_UNSAFE)
    os.environ[ASYNC_UNSAFE] = "true"
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=path, headless=True)
            try:
                yield browser
            finally:
                browser.close()
    finally:
        if allowed is None:
            del os.environ[ASYNC_UNSAFE]
        else:
            os.environ[ASYNC_UNSAFE] = allowed


class BrowserGunicorn(GunicornServer):
    """Gunicorn with threaded workers, as a browser needs.

    Chromium opens connections ahead of its requests; a sync worker that
    accepts one waits on it, idle, while the other holds the first POST, and
    the second POST then queues behind both. Threaded workers read whichever
    connection has a request.
    """

    probe_path = "/browser/ping/"

    def arguments(self) -> list[str]:
        arguments = super().arguments()
        arguments[arguments.index("sync")] = "gthread"
        return [*arguments[:-1], "--threads", "4", arguments[-1]]
