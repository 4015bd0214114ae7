"""The example project as a new user meets it: its tests, and the walkthrough."""

from __future__ import annotations

import html
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from example_project import walkthrough
from tests.browsers import chromium_fixture  # noqa: F401  a fixture used by name

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(
        os.environ.get("TEST_DATABASE", "sqlite") != "sqlite",
        reason="runs once, in the SQLite run: the example project has its own SQLite database",
    ),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def example_env(tmp_path):
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "example_project.settings",
        "EXAMPLE_SQLITE_PATH": str(tmp_path / "example.sqlite3"),
        # Long enough that the retry "at once" still meets the dead worker's
        # lease after gunicorn has booted a new worker on a loaded machine.
        "EXAMPLE_PAYMENT_LEASE": "10",
        # The walkthrough's Celery worker takes only this run's messages.
        "EXAMPLE_CELERY_QUEUE": f"example-{tmp_path.name}-{os.getpid()}",
    }
    env.pop("DATABASE_URL", None)
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
        cwd=ROOT,
        env=env,
        check=True,
    )
    return env


def test_example_project_tests_pass(example_env):
    completed = subprocess.run(
        [sys.executable, "manage.py", "test", "example_project", "-v", "1"],
        cwd=ROOT,
        env=example_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "Ran 11 tests" in completed.stderr


@pytest.fixture
def example_server(example_env):
    """The example served as ``dev.py serve`` serves it: through an ASGI server."""
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "example_project.asgi:application",
            "--port",
            str(port),
            "--workers",
            "2",
        ],
        cwd=ROOT,
        env=example_env,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{base}/provider/charges/", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "the example server did not start"
                time.sleep(0.2)
        yield base
    finally:
        server.terminate()
        server.wait(10)


def serve_prints(monkeypatch, capsys) -> str:
    """What ``python3 dev.py serve`` prints before it hands over to uvicorn."""
    import dev

    monkeypatch.setattr(dev, "ensure_venv", lambda extras: None)
    monkeypatch.setattr(dev, "run", lambda *args, **kwargs: 0)
    monkeypatch.setattr(dev.os, "execv", lambda *args: None)
    dev.serve()
    return capsys.readouterr().out


def test_landing_page_lists_the_endpoints_and_the_curl_lines_serve_prints(
    example_server, monkeypatch, capsys
):
    printed = serve_prints(monkeypatch, capsys)
    try_it = printed.split("Try, in another terminal:\n\n", 1)[1].split("\n\nOr run", 1)[0]
    assert "http://127.0.0.1:8000/" in printed  # the address the README's quick start shows

    with urllib.request.urlopen(f"{example_server}/", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/html")
        page = html.unescape(response.read().decode())

    # The same lines, for the address the page was read at.
    expected = textwrap.dedent(try_it).replace("http://127.0.0.1:8000", example_server)
    assert expected.strip() in page
    routes = re.findall(r'path\("([^"]+)"', (ROOT / "example_project" / "urls.py").read_text())
    assert routes, "no routes found in example_project/urls.py"
    for route in routes:
        assert f"<code>/{route}" in page, f"/{route} is not on the landing page"
    assert "/api/bookings/" in page
    assert "python3 dev.py walkthrough" in page


def test_walkthrough_shows_every_behaviour(example_env, example_server):
    crash_port = free_port()
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "example_project.walkthrough",
            "--base-url",
            example_server,
            "--crash-port",
            str(crash_port),
        ],
        cwd=ROOT,
        env=example_env,
        capture_output=True,
        text=True,
        timeout=120,
    )

    out = completed.stdout
    assert completed.returncode == 0, out + completed.stderr
    # Every step of the walkthrough's own list ran, numbered in order.
    numbers = re.findall(r"^(\d+)\. ", out, re.MULTILINE)
    assert numbers == [str(n) for n in range(1, len(walkthrough.STEPS) + 1)], out
    assert "first request                      -> 201" in out
    assert "retry                              -> 201  Idempotent-Replayed: true" in out
    assert "changed body                       -> 422" in out
    assert "async first request                -> 201" in out
    assert "async retry                        -> 201  Idempotent-Replayed: true" in out
    assert re.search(r"^  bookings for table-for-two-\w+: 1$", out, re.MULTILINE)
    assert "worker was killed mid-request" in out
    assert "retry at once (lease still held)   -> 409" in out
    assert "retry after the lease              -> 201" in out
    assert (
        "the retry was attempt 2, resumed after its checkpoints ['charged']: "
        "it did not charge again" in out
    )
    assert re.search(
        r"^  charges at the provider under derive\('charge'\) = \w+\.\.\.: 1$", out, re.M
    )
    assert "POST /receipts/ (queued on commit) -> 202" in out
    assert "the worker process died mid-task, transaction open (signal 9)" in out
    assert re.search(r"^  receipts for order \d+: 1 \(", out, re.M)


def test_a_double_click_on_the_checkout_is_one_order(example_server, chromium):
    """``dev.py serve``'s checkout in Chromium: two POSTs of the form, one order, its page."""
    context = chromium.new_context()
    try:
        page = context.new_page()
        posts = []
        page.on("request", lambda request: posts.append(request) if request.method == "POST" else 0)
        page.goto(f"{example_server}/checkout/")
        box = page.locator("button[type=submit]").bounding_box()
        x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2

        with page.expect_request(lambda request: request.method == "POST"):
            page.mouse.click(x, y)
        page.mouse.click(x, y)  # while the payment step (a second) runs
        page.get_by_text("in all").wait_for(timeout=20_000)

        assert len(posts) == 2
        assert re.search(r"/orders/\d+/$", page.url), page.url
        assert page.get_by_text("The shop has 1 order in all.").is_visible()
    finally:
        context.close()
