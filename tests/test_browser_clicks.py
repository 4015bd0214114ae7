"""A person at a real browser (SPEC 9): Chromium, driven by Playwright, against gunicorn.

The checkout's view takes a second (a payment provider's round trip), so a
double click, or a click then Enter, sends a second POST of the same form
while the first runs. With ``{% idempotency_key_field %}`` the server sees
two POSTs, makes one order, and the browser ends on that order's page (the
second POST waits for the first and is answered with its redirect). The
same form without the tag makes two orders: the control, so that these
tests fail if the browser stopped sending the second POST.

Chromium is Debian's ``chromium`` package, never a downloaded browser;
``python3 dev.py test`` installs it when run as root, and CI does. Where it
cannot run, the tests fail under CI (``CI`` or ``REQUIRE_BACKENDS`` set)
and are skipped with the fix named elsewhere.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from django_idempotency.models import IdempotencyKey
from tests.browser_views import GATE_ENV, POST_LOG_ENV
from tests.browsers import (
    BrowserGunicorn,
    chromium_fixture,  # noqa: F401  a fixture used by name
)
from tests.models import Order
from tests.polling import wait_until
from tests.server import GunicornServer, running

pytestmark = [pytest.mark.server, pytest.mark.django_db(transaction=True)]

#: How long the browser may take to land on the order's page: the slow
#: view's second, the duplicate's wait for it, and a loaded machine's slack.
LANDING_TIMEOUT_MS = 20_000
ORDER_PAGE = re.compile(r"/browser/orders/(\d+)/$")


@pytest.fixture(scope="module")
def post_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("browser") / "posts.log"


@pytest.fixture(scope="module")
def gate(post_log: Path) -> Path:
    """The file the gated (lease-mode) view waits for."""
    return post_log.parent / "gate"


@pytest.fixture(scope="module")
def server(
    django_db_setup: None, post_log: Path, gate: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GunicornServer]:
    log_dir = tmp_path_factory.mktemp("browser-gunicorn")
    env = {POST_LOG_ENV: str(post_log), GATE_ENV: str(gate)}
    with running(BrowserGunicorn, "tests.browser_server_settings", log_dir, env, workers=2) as up:
        yield up


@pytest.fixture
def page(chromium: Any, post_log: Path) -> Iterator[Any]:
    """A fresh browser (its own cookies, so its own session) and an empty POST log."""
    post_log.write_text("")
    context = chromium.new_context()
    try:
        yield context.new_page()
    finally:
        context.close()


def posts(post_log: Path, path: str) -> int:
    return post_log.read_text().splitlines().count(path)


def landed_order(page: Any) -> int:
    """Wait for the browser to show an order's page; that order's id."""
    # The locator outlives navigations: the first POST's, which the second
    # submission aborts, included (waiting for the URL would fail with it).
    page.locator("#order").wait_for(state="visible", timeout=LANDING_TIMEOUT_MS)
    match = ORDER_PAGE.search(page.url)
    assert match is not None, page.url
    assert page.locator("#order").inner_text() == f"Order {match.group(1)}"
    return int(match.group(1))


def first_post_arrived(page: Any, post_log: Path) -> None:
    """Wait until the server has the first POST: a person's second click comes while it runs.

    Sooner (Playwright's ``dblclick`` sends both clicks within a
    millisecond), Chromium replaces the submission it has not started yet
    with the second one, and only one POST leaves the browser.
    """
    path = "/" + page.url.split("/", 3)[3]
    wait_until(lambda: posts(post_log, path) == 1, "the first POST to reach the server")


def double_click(page: Any, post_log: Path) -> None:
    # The mouse, where a person's is: a locator's click would wait for the
    # first POST's navigation to finish before clicking again.
    box = page.locator("#pay").bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.click(x, y)
    first_post_arrived(page, post_log)
    page.mouse.click(x, y)


def double_click_once_claimed(page: Any, post_log: Path) -> None:
    """A double click whose second click comes once the first POST holds its key.

    Lease mode answers whichever POST claims second with the 409 page; the
    browser shows only the second POST's answer, so the second click waits
    for the first POST's committed claim, not only for its arrival (on a
    loaded machine the second POST could otherwise claim first, and the
    409 would go to the POST the browser had already dropped).
    """
    box = page.locator("#pay").bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.click(x, y)
    wait_until(IdempotencyKey.objects.exists, "the first POST to claim its key")
    page.mouse.click(x, y)


def click_then_enter(page: Any, post_log: Path) -> None:
    page.click("#pay", no_wait_after=True)
    first_post_arrived(page, post_log)
    page.keyboard.press("Enter")  # the button keeps the focus the click gave it


GESTURES = [
    pytest.param(double_click, id="double-click"),
    pytest.param(click_then_enter, id="enter"),
]


@pytest.mark.parametrize("gesture", GESTURES)
def test_two_posts_of_the_tagged_form_make_one_order(
    page: Any, server: GunicornServer, post_log: Path, gesture: Any
) -> None:
    page.goto(server.url + "/browser/slow/")
    page.fill("#item", "book")

    gesture(page, post_log)
    landed = landed_order(page)

    assert posts(post_log, "/browser/slow/") == 2
    assert list(Order.objects.values_list("pk", flat=True)) == [landed]


@pytest.mark.parametrize("gesture", GESTURES)
def test_without_the_tag_two_posts_make_two_orders(
    page: Any, server: GunicornServer, post_log: Path, gesture: Any
) -> None:
    page.goto(server.url + "/browser/slow-untagged/")
    page.fill("#item", "book")

    gesture(page, post_log)
    landed = landed_order(page)

    assert posts(post_log, "/browser/slow-untagged/") == 2
    # The first POST's answer was dropped by the browser; its order commits
    # in its own time.
    wait_until(lambda: Order.objects.count() == 2, "the first POST's order")
    assert landed in Order.objects.values_list("pk", flat=True)


def test_lease_mode_answers_the_second_post_with_a_page_that_sends_it_again(
    page: Any, server: GunicornServer, post_log: Path, gate: Path
) -> None:
    """Lease mode: the duplicate gets the 409 page, which resends the same form; one order."""
    gate.unlink(missing_ok=True)
    page.goto(server.url + "/browser/slow-lease/")
    page.fill("#item", "book")

    # The first POST holds until the duplicate has its answer.
    with page.expect_response(lambda response: response.status == 409) as conflict:
        double_click_once_claimed(page, post_log)
    gate.touch()
    assert "text/html" in conflict.value.headers["content-type"]
    landed = landed_order(page)

    # Two POSTs of the double click, and at least one resent by the 409 page.
    assert posts(post_log, "/browser/slow-lease/") >= 3
    assert list(Order.objects.values_list("pk", flat=True)) == [landed]
